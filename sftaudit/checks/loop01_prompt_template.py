"""LOOP-01 prompt-template consistency."""

from __future__ import annotations

from ..core.artifacts import template_fingerprint
from ..dataset.layout import empty_turns, run_layout, sample_blocks
from ..dataset.template_text import TemplateOverBudget, template_source
from ..errors import InputError
from .base import AuditContext, Check, Finding, count
from .recorded import first_manifest, recorded_samples, run_tokenizer

# Roles whose empty turn is a fail (an empty system prompt is merely suspicious).
_EMPTY_SEVERITY = {"user": "fail", "assistant": "fail", "system": "warn"}


class PromptTemplateConsistency(Check):
    """Prompt-template consistency (trigger point: after data load).

    What it detects:
        Fields the chat template reads that the dataset does not have (a case mismatch like
        `Role` vs `role` names both spellings; reads under a condition, `is defined`,
        `default` or `.get` are optional and never a finding), samples the template refuses (`raise_exception`, e.g.
        roles that do not alternate: the row and the template's message), a message whose
        content is missing from the render (a dropped system prompt, preflight), samples with
        an empty system, user or assistant turn, and samples rendered with more than one
        template in one run.
    Why it matters:
        A template that reads a missing field renders an empty string or crashes late; empty
        instruction pairs teach the model to babble on empty input; two templates
        in one run teach two prompt formats and the model answers neither reliably.
    Statistic:
        Fields: jinja2's own AST of the template (`Getitem`/`Getattr` on `messages` and the
        names bound to its items through `for`/`set`; reads under `is defined`, `in` or
        `.get` are optional, and so are the reads a condition guards by such a presence test;
        a macro's reads count as at its call sites) against the dataset's recorded field names. Empty turns: a
        role header followed directly by the end-of-turn marker in the recorded token rows
        (markers derived from the template, see LOOP-04). Templates: each batch's recorded
        template fingerprint against the one the run started with.
    Threshold:
        Any missing field, failed render, empty user/assistant turn or second template is a
        fail; an empty system turn is a warn.
    Evidence:
        Both field spellings, sample ids, the first render error, the template fingerprints
        and the step the second template first appears.
    """

    code = "LOOP-01"
    name = "prompt-template consistency"
    rules = {
        "template-over-budget": "the chat template would stall or exhaust memory when rendered",
        "template-unparsable": "the chat template is nested too deeply for the template engine to parse",
        "field-missing": "the template references a field the dataset does not have (or spells differently)",
        "render-failed": "samples fail to render with the chat template",
        "message-dropped": "the template drops a message of a sample (e.g. a system prompt it does not support)",
        "empty-turn": "samples have an empty turn",
        "second-template": "samples are rendered with a second chat template during the run",
    }
    needs = ("chat_template",)
    source_needs = ("tokenizer",)
    defaults = {"max_samples_listed": count(50)}

    def run(self, ctx: AuditContext) -> list[Finding]:
        start = first_manifest(ctx)
        source = template_source((start.get("tokenizer") or {}).get("chat_template"))
        if source is None:
            return []
        try:
            return (
                self._fields(source, start.get("dataset") or {})
                + self._render_failures(ctx)
                + self._dropped(ctx)
                + self._empty_turns(ctx, source)
                + self._templates(ctx, source)
            )
        except TemplateOverBudget as exc:
            return [
                self.finding(
                    "template-over-budget",
                    "fail",
                    f"{exc}: the run's template would stall or exhaust memory wherever it is "
                    f"rendered; fix or replace it before training",
                    kind="template_over_budget",
                    error=str(exc),
                )
            ]
        except InputError as exc:  # the template does not parse (a syntax error, nesting past the parser's limit)
            return [
                self.finding(
                    "template-unparsable",
                    "fail",
                    f"{exc}: no tokenizer can render the run's chat template; fix or replace it before training",
                    kind="template_unparsable",
                    error=str(exc),
                )
            ]

    def _fields(self, source: str, dataset: dict) -> list[Finding]:
        from ..dataset.fields import template_fields  # the parser imports jinja2: only a run with a template pays

        fields = template_fields(source)
        findings = []
        for scope, read, have in (
            ("message", fields.message_required, set(dataset.get("message_fields") or [])),
            ("dataset", fields.context & {"messages"}, set(dataset.get("fields") or [])),
        ):
            if not have:
                continue
            for name in sorted(read - have):
                spelled = sorted(h for h in have if h.lower() == name.lower())
                if spelled:
                    message = (
                        f"the template reads {scope} field '{name}' but the dataset spells it "
                        f"'{spelled[0]}'; rename the dataset field to '{name}' (or fix the template)"
                    )
                else:
                    message = (
                        f"the template reads {scope} field '{name}' that the dataset does not have "
                        f"(it has {sorted(have)}); map the dataset's field to '{name}'"
                    )
                findings.append(
                    self.finding(
                        "field-missing",
                        "fail",
                        message,
                        template_field=name,
                        dataset_fields=sorted(have),
                        spelled_as=spelled,
                    )
                )
        return findings

    def _render_failures(self, ctx: AuditContext) -> list[Finding]:
        failed = ctx.frame("SELECT sample_id, error FROM events WHERE kind = 'render_failed' ORDER BY time, sample_id")
        if failed.is_empty():
            return []
        ids = failed["sample_id"].to_list()
        return [
            self.finding(
                "render-failed",
                "fail",
                f"{len(ids)} sample(s) fail to render with the chat template (first {ids[0]}: {failed['error'][0]}); "
                f"fix or drop them before training",
                sample_ids=ids[: self.params["max_samples_listed"]],
                samples_affected=len(ids),
                error=failed["error"][0],
            )
        ]

    def _dropped(self, ctx: AuditContext) -> list[Finding]:
        """Rows whose render lacks a message's content (preflight): the template dropped it."""
        dropped = ctx.frame("SELECT sample_id, error FROM events WHERE kind = 'content_dropped' ORDER BY time")
        if dropped.is_empty():
            return []
        ids = dropped["sample_id"].to_list()
        return [
            self.finding(
                "message-dropped",
                "fail",
                f"{len(ids)} sample(s) lose a message in the render (first {ids[0]}: {dropped['error'][0]}); the template "
                f"drops it (e.g. a system prompt it does not support): merge it into the first user turn or use a "
                f"template that renders it",
                sample_ids=ids[: self.params["max_samples_listed"]],
                samples_affected=len(ids),
                error=dropped["error"][0],
                kind="content_dropped",
            )
        ]

    def _empty_turns(self, ctx: AuditContext, source: str) -> list[Finding]:
        tokenizer = run_tokenizer(ctx)
        try:
            layout = run_layout(tokenizer) if tokenizer is not None else None
        except TemplateOverBudget:
            raise
        except InputError:  # a template without turns (Nemotron-Parse renders the contents only) has no empty one
            layout = None
        if layout is None or not ctx.has_rows("samples"):
            return []
        hits: dict[str, list[tuple[int, str]]] = {}
        for part, ids, _, _ in sample_blocks(recorded_samples(ctx, source)):
            for role, mask in empty_turns(ids, layout).items():
                rows = mask.any(1).nonzero()[0]
                hits.setdefault(role, []).extend(
                    zip(part["step"].gather(rows).to_list(), part["sample_id"].gather(rows).to_list())
                )
        findings = []
        for role, rows in hits.items():
            if rows:
                rows.sort()
                ids = list(dict.fromkeys(s for _, s in rows))
                findings.append(
                    self.finding(
                        "empty-turn",
                        _EMPTY_SEVERITY[role],
                        f"{len(ids)} sample(s) have an empty {role} turn, from step {rows[0][0]} (first {ids[0]}); "
                        f"drop or repair them before training",
                        step=rows[0][0],
                        role=role,
                        sample_ids=ids[: self.params["max_samples_listed"]],
                        samples_affected=len(ids),
                    )
                )
        return findings

    def _templates(self, ctx: AuditContext, source: str) -> list[Finding]:
        expected = template_fingerprint(source)
        other = ctx.frame(
            """
            SELECT step, template_fingerprint, sample_ids FROM batches
            WHERE template_fingerprint IS NOT NULL AND template_fingerprint <> ? ORDER BY step, micro
            """,
            [expected],
        )
        if other.is_empty():
            return []
        step, fingerprint, ids = other.row(0)
        return [
            self.finding(
                "second-template",
                "fail",
                f"from step {step} samples are rendered with a second chat template ({fingerprint}, the run started "
                f"with {expected}) in {other.height} micro-batch(es); render every sample with one template",
                step=step,
                template_fingerprints=sorted({expected, *other["template_fingerprint"].to_list()}),
                first_step=step,
                last_step=int(other["step"].max()),
                batches_affected=other.height,
                sample_ids=list(ids)[: self.params["max_samples_listed"]],
            )
        ]
