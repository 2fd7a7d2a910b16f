"""LOOP-04 loss-mask validity."""

from __future__ import annotations

import functools
import importlib.metadata
import re
from typing import Any

import numpy as np

from ..dataset.layout import (
    CATEGORY_NAMES,
    EITHER,
    IGNORE_INDEX,
    MASKED,
    PADDING,
    TRAINED,
    actual_labels,
    expected_labels,
    matches,
    run_layout,
    sample_blocks,
)
from ..dataset.template_text import has_generation_block, template_source
from ..errors import InputError
from .base import AuditContext, CannotJudge, Check, Finding, at_least, count
from .recorded import end_of_turn_markers, first_manifest, recorded_samples, run_tokenizer

_ADVICE = {
    "off_by_one": "the collator's prompt boundary is off by one; mask through the last token of the assistant header",
    "prompt_trained": "set labels to -100 on every token outside the assistant turns",
    "assistant_masked": "the model never learns these tokens; make the collator keep labels on each assistant "
    "turn through its end-of-turn marker",
    "padding_confused": "build attention_mask from the sequence lengths, not from the pad id",
}


class LossMaskValidity(Check):
    """Loss-mask validity (trigger point: after forward).

    What it detects:
        Labels that disagree with the chat template: prompt tokens trained (and the common
        off-by-one, where the prompt's last token before the answer is trained), assistant
        tokens or their end-of-turn marker masked, padding trained, padding confused with
        prompt (pads attended, or real tokens hidden as padding), samples that truncation
        leaves without a single trained token.
    Why it matters:
        The loss curve looks fine either way: a model trained on prompts learns to echo
        them, one that never sees its end-of-turn marker never learns to stop, and trained
        padding teaches it to emit pads.
    Statistic:
        Expected trainable positions come from the run's own tokenizer and template, never a
        hard-coded marker: rendering sentinel conversations gives the token ids that open
        each assistant turn (the generation prompt) and end a turn (the tail of the
        template's `{% generation %}` span, or, when that span ends before the marker, what
        follows the content: generation must learn to emit the stop marker whatever span the
        template marks; whitespace pieces after it, such as a legacy SentencePiece `▁`, are
        never generated and may go either way); every recorded row is scanned for them in
        token-id space (vectorised over rows), trained = from the end of an assistant
        header through the next end-of-turn marker, padding = attention 0 or the pad runs
        outside the turns. Token-id matching needs no source messages, so it works on any
        recorded row; it assumes turn headers start with tokens that do not merge with the
        previous turn's text (true of special-token headers). Each row is compared with
        `labels != -100`; padding trained is also counted on every batch row from the
        batch records. Aggregate: trained tokens vs the template's expected count.
        No end-of-turn marker of any judged assistant turn trained is one fail naming the cause
        (pad = the marker masked by id, a `{% generation %}` block that ends before it).
        Full-sequence loss (every attended token trained, but each packed sample's first token,
        which padding-free collators mask, and the pad id) is a configuration, not a bug: one
        warn at run scope naming it and how to switch (advice for the installed TRL, read from
        its metadata, and the template), silenced by `expect = "all_tokens"`; its stop marker is
        still judged;
        `assistant_turns = "last"` declares that only the last assistant turn is trained.
        Undeclared, a run in which no multi-turn sample trains any answer before its last one
        gets one configuration warn naming that policy and how to declare it; a sample that trains some
        earlier answers while others are masked is a dropped answer (fail).
    Threshold:
        Any mismatched position in a row is a fail (padding confused with prompt: warn);
        the aggregate counts differing by more than 0.1% is a warn.
    Evidence:
        Sample ids, steps, the mismatched positions of the first sample, and a side-by-side
        of its tokens / input_ids / labels around the first mismatch.
    """

    code = "LOOP-04"
    name = "loss-mask validity"
    rules = {
        "full-sequence-loss": "every non-padding token is trained (the prompts too)",
        "trained-token-count": "the trained token count differs from the template's assistant turns",
        "last-turn-only": "only the last assistant turn of multi-turn samples is trained",
        "end-of-turn-untrained": "the assistant turns' end-of-turn markers are not trained",
        "emptied-by-truncation": "truncation cuts samples before their assistant turn: they train no token",
        "off-by-one": "the prompt token just before the assistant turn is trained",
        "prompt-trained": "prompt tokens are trained",
        "assistant-masked": "assistant tokens are masked",
        "padding-confused": "padding is confused with prompt",
        "padding-trained": "padding tokens are trained",
    }
    needs = ("batches",)
    defaults = {
        "aggregate_tolerance": at_least(0.001, 0),
        "max_samples_listed": count(50),
        "context_tokens": count(6, low=0),
        "expect": "assistant_tokens",
        "assistant_turns": "all",
    }

    def run(self, ctx: AuditContext) -> list[Finding]:
        tokenizer = run_tokenizer(ctx)
        try:
            layout = run_layout(tokenizer) if tokenizer is not None else None
        except InputError as exc:  # a template without turns (Nemotron-Parse concatenates the contents)
            unjudged = f"the chat template's turns cannot be told apart ({exc}), so the expected labels are unknown"
            layout = None
        else:
            unjudged = None
        findings = self._padding_trained(ctx, tokenizer, layout)
        if unjudged and not findings and ctx.has_rows("samples"):
            raise CannotJudge(unjudged)
        if layout is None or "assistant" not in layout.headers or not ctx.has_rows("samples"):
            return findings
        template = template_source(first_manifest(ctx).get("tokenizer", {}).get("chat_template"))
        frame = recorded_samples(ctx, template)
        if self._all_tokens_trained(frame, tokenizer.bos_token_id, tokenizer.pad_token_id):
            # The pad id may be masked wherever it occurs (pad = eos): judged on its own below.
            ends = self._end_of_turn(frame, layout, tokenizer)
            if ends["total"] and not ends["trained"]:
                findings.append(self._end_of_turn_finding(ends, tokenizer, template, full_sequence=True))
            if self.params["expect"] == "all_tokens":
                return findings
            return findings + [
                self.finding(
                    "full-sequence-loss",
                    "warn",
                    "every non-padding token is trained (full-sequence loss: TRL's default for a `messages` dataset, "
                    "axolotl's train_on_inputs), so the model also learns to write the prompts; for completion-only "
                    f"loss {assistant_only_advice(template, installed_trl())}, or declare it intended with "
                    '[checks."LOOP-04"] expect = "all_tokens"',
                    category="configuration",
                    kind="full_sequence_loss",
                    configuration="all tokens trained",
                    first_step=int(frame["step"].min()),
                )
            ]
        findings += self._emptied_by_truncation(frame)
        last_turn_only = self.params["assistant_turns"] == "last"
        hits: dict[str, list[tuple[int, str, int]]] = {k: [] for k in [*_ADVICE, "earlier_masked"]}
        first_evidence: dict[str, list[dict]] = {}
        counts = dict.fromkeys(hits, 0)
        expected_total = actual_total = earlier_total = earlier_trained_rows = 0
        # No judged turn's end-of-turn marker trained: one finding of its own, not part of the masked answers.
        ends = self._end_of_turn(frame, layout, tokenizer, last_turn_only)
        stop_untrained = ends["total"] > 0 and not ends["trained"]
        for part, ids, labels, attention in sample_blocks(frame):
            expected, earlier = expected_labels(ids, attention, layout, tokenizer.pad_token_id, last_turn_only)
            actual = actual_labels(labels, attention)
            expected_total += int((expected == TRAINED).sum())
            actual_total += int(((actual == TRAINED) & (expected != EITHER)).sum())
            kinds = _mismatches(expected, actual)
            if stop_untrained:
                kinds["assistant_masked"] &= ~(_marker_positions(ids, layout.turn_end) & (expected == TRAINED))
            if not last_turn_only:  # answers masked in earlier turns only may be the last-turn-only policy
                kinds["earlier_masked"] = kinds["assistant_masked"] & earlier
                kinds["assistant_masked"] &= ~earlier
                earlier_total += int(earlier.sum())
                earlier_trained_rows += int((earlier & (actual == TRAINED)).any(1).sum())
            steps, sample_ids = part["step"].to_list(), part["sample_id"].to_list()
            for kind, mask in kinds.items():
                counts[kind] += int(mask.sum())
                for r in np.flatnonzero(mask.any(1)):
                    pos = int(np.argmax(mask[r]))
                    hits[kind].append((steps[r], sample_ids[r], pos))
                    if kind not in first_evidence:
                        first_evidence[kind] = self._side_by_side(
                            tokenizer, ids[r], labels[r], expected[r], actual[r], pos
                        )
        if stop_untrained:
            findings.append(self._end_of_turn_finding(ends, tokenizer, template))
        earlier_rows = hits.pop("earlier_masked")
        if earlier_rows and not earlier_trained_rows:
            # No sample trains an answer before its last: a policy, not a dropped answer; it must be declared.
            findings.append(self._last_turn_only(earlier_rows, template))
            expected_total -= earlier_total
        elif earlier_rows:
            hits["assistant_masked"] += earlier_rows
            counts["assistant_masked"] += counts["earlier_masked"]
            first_evidence.setdefault("assistant_masked", first_evidence["earlier_masked"])
        for kind, rows in hits.items():
            if rows:
                findings.append(self._mask_finding(kind, rows, counts[kind], first_evidence[kind]))
        if expected_total and abs(actual_total - expected_total) / expected_total > self.params["aggregate_tolerance"]:
            share = abs(actual_total - expected_total) / expected_total
            # The count of what the other findings show: a configuration when each of them is one.
            causes = {f.category for f in findings}
            findings.append(
                self.finding(
                    "trained-token-count",
                    "warn",
                    f"the recorded samples train {actual_total} tokens but the template's assistant turns hold "
                    f"{expected_total} ({share:.2%} apart, above {self.params['aggregate_tolerance']:.1%}); "
                    f"see this check's other findings for the samples",
                    step=min((f.step for f in findings if f.step is not None), default=int(frame["step"].min())),
                    category="configuration" if causes == {"configuration"} else "anomaly",
                    value=share,
                    threshold=self.params["aggregate_tolerance"],
                    expected_trained=expected_total,
                    actual_trained=actual_total,
                )
            )
        return findings

    def _last_turn_only(self, rows: list[tuple[int, str, int]], template: str | None) -> Finding:
        """A prompt/completion split of multi-turn chats: a deliberate choice (run scope), not a step's fault."""
        rows.sort(key=lambda r: r[0])
        ids = list(dict.fromkeys(r[1] for r in rows))
        return self.finding(
            "last-turn-only",
            "warn",
            f"only the last assistant turn of each sample is trained: the earlier answers of {len(ids)} multi-turn "
            f"sample(s) are masked (first {ids[0]}), so the model learns no answer that a conversation goes on "
            f'from; if that is intended, declare it with [checks."LOOP-04"] assistant_turns = "last", '
            f"otherwise train every assistant turn of a `messages` dataset, not a prompt-completion split: "
            f"{assistant_only_advice(template, installed_trl())}",
            category="configuration",
            kind="last_turn_only",
            configuration="last assistant turn trained",
            first_step=rows[0][0],
            sample_ids=ids[: self.params["max_samples_listed"]],
            samples_affected=len(ids),
        )

    def _end_of_turn(self, frame: Any, layout: Any, tokenizer: Any, last_turn_only: bool = False) -> dict[str, Any]:
        """The judged assistant turns' end-of-turn markers in the recorded rows and how many are trained (counted
        as LOOP-02 counts them), with the rows that mask one and the first one's side-by-side."""
        out = end_of_turn_markers(frame, layout, tokenizer.pad_token_id, last_turn_only)
        if out["first"] is not None:
            ids, labels, expected, attention, pos = out["first"]
            actual = actual_labels(labels[None], attention[None])[0]
            out["evidence"] = self._side_by_side(tokenizer, ids, labels, expected, actual, pos)
        return out

    def _end_of_turn_finding(
        self, ends: dict[str, Any], tokenizer: Any, template: str | None, full_sequence: bool = False
    ) -> Finding:
        """No assistant turn's end-of-turn marker is trained: the model never learns to emit its stop token,
        whatever span the template's `{% generation %}` block marks."""
        rows = sorted(ends["rows"], key=lambda r: r[0])
        step, sample, _ = rows[0]
        ids = list(dict.fromkeys(r[1] for r in rows))
        layout = run_layout(tokenizer)
        marker = tokenizer.decode(layout.turn_end)
        if tokenizer.pad_token_id is not None and tokenizer.pad_token_id in layout.turn_end:
            cause = (
                f"the pad token is {marker!r} and the collator masks it wherever it occurs; use a distinct pad "
                f"token or mask padding by attention_mask"
            )
        elif has_generation_block(template) and not full_sequence:
            cause = (
                f"the template's {{% generation %}} block (TRL's assistant_only_loss and transformers' assistant "
                f"mask train only that block) ends before {marker!r}: move {{% endgeneration %}} after the marker"
            )
        else:
            cause = f"keep labels on each assistant turn through its {marker!r}"
        return self.finding(
            "end-of-turn-untrained",
            "fail",
            f"{ends['trained']} of {ends['total']} end-of-turn markers {marker!r} of the assistant turns are trained "
            f"(from step {step}, first {sample}): the model never learns to emit its stop token and runs on past "
            f"its answers at inference; {cause}",
            step=step,
            category="configuration",  # the collator's or template's setup: no batch to skip fixes it
            kind="end_of_turn_untrained",
            marker=marker,
            markers_total=ends["total"],
            markers_trained=ends["trained"],
            sample_ids=ids[: self.params["max_samples_listed"]],
            samples_affected=len(ids),
            first_step=step,
            last_step=rows[-1][0],
            tokens=ends.get("evidence", []),
        )

    def _emptied_by_truncation(self, frame: Any) -> list[Finding]:
        """Rows cut at the longest recorded length that train no token at all."""
        hits, longest = [], 0
        for part, _, labels, attention in sample_blocks(frame):
            lengths = (attention != 0).sum(1)
            longest = max(longest, int(lengths.max(initial=0)))
            empty = np.flatnonzero(((labels != IGNORE_INDEX).sum(1) == 0) & (lengths > 0))
            hits += zip(
                part["step"].gather(empty).to_list(), part["sample_id"].gather(empty).to_list(), lengths[empty].tolist()
            )
        truncated = sorted((step, sample) for step, sample, length in hits if length == longest)
        if not truncated or longest == 0:
            return []
        ids = list(dict.fromkeys(s for _, s in truncated))
        return [
            self.finding(
                "emptied-by-truncation",
                "fail",
                f"{len(ids)} sample(s) train no token: truncation to {longest} tokens cuts them before the assistant "
                f"turn (first {ids[0]}, step {truncated[0][0]}); raise max_length, truncate the prompt from the left, "
                f"or drop them",
                step=truncated[0][0],
                kind="emptied_by_truncation",
                max_length=longest,
                sample_ids=ids[: self.params["max_samples_listed"]],
                samples_affected=len(ids),
            )
        ]

    @staticmethod
    def _all_tokens_trained(frame: Any, bos_id: int | None, pad_id: int | None) -> bool:
        """Every attended token of every recorded row carries a label, but one per sample (the shifted last
        one, or in a packed row each sample's first: padding-free collators mask what no earlier token of
        the same sample predicts) and the pad id (a collator that masks it wherever it occurs, pad = eos)."""
        for _, ids, labels, attention in sample_blocks(frame):
            real = attention != 0
            samples = np.maximum(1, ((ids == bos_id) & real).sum(1)) if bos_id is not None else 1
            if ((real & (labels == IGNORE_INDEX) & (ids != pad_id)).sum(1) > samples).any():
                return False
        return frame.height > 0

    def _mask_finding(self, kind: str, rows: list[tuple[int, str, int]], tokens: int, evidence: list[dict]) -> Finding:
        rows.sort(key=lambda r: r[0])
        step, sample, pos = rows[0]
        ids = list(dict.fromkeys(r[1] for r in rows))
        what = {
            "off_by_one": f"the prompt token just before the assistant turn is trained in {len(ids)} sample(s)",
            "prompt_trained": f"{tokens} prompt token(s) are trained in {len(ids)} sample(s)",
            "assistant_masked": f"{tokens} assistant token(s) (content or end-of-turn marker) are masked in "
            f"{len(ids)} sample(s)",
            "padding_confused": f"padding is confused with prompt in {len(ids)} sample(s) ({tokens} position(s))",
        }[kind]
        return self.finding(
            kind.replace("_", "-"),
            "warn" if kind == "padding_confused" else "fail",
            f"{what} from step {step} (first {sample}, position {pos}); {_ADVICE[kind]}",
            step=step,
            kind=kind,
            sample_ids=ids[: self.params["max_samples_listed"]],
            samples_affected=len(ids),
            positions_affected=tokens,
            first_step=step,
            last_step=rows[-1][0],
            tokens=evidence,
        )

    def _padding_trained(self, ctx: AuditContext, tokenizer: Any, layout: Any) -> list[Finding]:
        """From every batch row (not only the recorded ones): pads with labels."""
        rows = ctx.frame(
            """
            SELECT step, sample_id, trained FROM (
              SELECT step, unnest(sample_ids) AS sample_id, unnest(padding_trained) AS trained FROM batches)
            WHERE trained > 0 ORDER BY step
            """
        )
        if rows.is_empty():
            return []
        step, sample = rows.row(0)[:2]
        ids = list(dict.fromkeys(rows["sample_id"].to_list()))
        evidence = self._padding_evidence(ctx, tokenizer, layout, step, sample)
        return [
            self.finding(
                "padding-trained",
                "fail",
                f"padding is trained in {len(ids)} sample(s) from step {step} ({int(rows['trained'].sum())} pad "
                f"token(s), first {sample}); set labels to -100 wherever attention_mask is 0",
                step=step,
                kind="padding_trained",
                sample_ids=ids[: self.params["max_samples_listed"]],
                samples_affected=len(ids),
                positions_affected=int(rows["trained"].sum()),
                first_step=step,
                last_step=int(rows["step"].max()),
                tokens=evidence,
            )
        ]

    def _padding_evidence(self, ctx: AuditContext, tokenizer: Any, layout: Any, step: int, sample: str) -> list[dict]:
        row = ctx.row(
            "SELECT input_ids, labels, attention_mask FROM samples WHERE step = ? AND sample_id = ? LIMIT 1",
            [step, sample],
        )
        if row is None or layout is None:
            return []
        ids, labels, attention = (np.asarray([v]) for v in row)
        expected, _ = expected_labels(ids, attention, layout, tokenizer.pad_token_id)
        actual = actual_labels(labels, attention)
        pos = int(np.argmax((expected[0] == PADDING) & (actual[0] == TRAINED)))
        return self._side_by_side(tokenizer, ids[0], labels[0], expected[0], actual[0], pos)

    def _side_by_side(self, tokenizer: Any, ids, labels, expected, actual, pos: int) -> list[dict]:
        k = self.params["context_tokens"]
        lo, hi = max(pos - k, 0), min(pos + k + 1, int((ids >= 0).sum()))
        window = [int(i) for i in ids[lo:hi]]
        tokens = tokenizer.convert_ids_to_tokens(window)
        return [
            {
                "pos": lo + j,
                "token": str(tokens[j]),
                "input_id": window[j],
                "label": int(labels[lo + j]),
                "actual": CATEGORY_NAMES[actual[lo + j]],
                "expected": CATEGORY_NAMES[expected[lo + j]],
            }
            for j in range(len(window))
        ]


def _mismatches(expected: np.ndarray, actual: np.ndarray) -> dict[str, np.ndarray]:
    """[N, T] masks per mismatch kind (padding trained is counted from the batch records)."""
    prompt_trained = (expected == MASKED) & (actual == TRAINED)
    answer = expected == TRAINED
    next_to_answer = np.zeros_like(answer)
    next_to_answer[:, :-1] |= answer[:, 1:]
    next_to_answer[:, 1:] |= answer[:, :-1]
    # A row whose only trained prompt tokens touch an assistant span is the off-by-one.
    off_row = prompt_trained.any(1) & ~(prompt_trained & ~next_to_answer).any(1)
    return {
        "off_by_one": prompt_trained & off_row[:, None],
        "prompt_trained": prompt_trained & ~off_row[:, None],
        "assistant_masked": answer & (actual != TRAINED),
        "padding_confused": ((expected == PADDING) & (actual == MASKED)) | ((expected == MASKED) & (actual == PADDING)),
    }


def _marker_positions(ids: np.ndarray, marker: list[int]) -> np.ndarray:
    """[N, T] bool: every position of each occurrence of the token sequence `marker`."""
    starts = matches(ids, marker)
    out = starts.copy()
    for j in range(1, len(marker)):
        out[:, j:] |= starts[:, :-j]
    return out


@functools.cache
def installed_trl() -> tuple[str, frozenset[str]] | None:
    """The installed TRL's version and the chat templates it ships a training version of (read from its files:
    the analyzer never imports trl); None without TRL."""
    try:
        dist = importlib.metadata.distribution("trl")
    except importlib.metadata.PackageNotFoundError:
        return None
    files = {
        str(f): f for f in dist.files or () if str(f).startswith("trl/chat_templates/") and str(f).endswith(".jinja")
    }
    patched = frozenset(
        dist.locate_file(f).read_text(encoding="utf-8")
        for name, f in files.items()
        if not name.endswith("_training.jinja") and name[: -len(".jinja")] + "_training.jinja" in files
    )
    return dist.version, patched


def assistant_only_advice(template: str | None, trl: tuple[str, frozenset[str]] | None) -> str:
    """How to train only the assistant turns, valid for the TRL installed (`installed_trl()`) and this template."""
    if trl is None:
        return "set labels to -100 outside the assistant turns (axolotl: train_on_inputs: false)"
    version, patched = trl
    if tuple(int(x) for x in re.findall(r"\d+", version)[:2]) < (0, 19):
        return (
            f"TRL {version} has no assistant_only_loss (it came in 0.19): upgrade TRL, or use "
            f"DataCollatorForCompletionOnlyLM with the template's assistant header as response_template and its "
            f"user header as instruction_template"
        )
    if has_generation_block(template):
        return f"set assistant_only_loss=True (TRL {version}; the template marks its assistant turns with {{% generation %}})"
    if template in patched:
        return f"set assistant_only_loss=True (TRL {version} swaps in its training version of this template)"
    return (
        f"assistant_only_loss=True needs {{% generation %}} markers, which this template lacks and TRL {version} "
        f"has no training version of: wrap each assistant turn's content and end-of-turn marker in "
        f"{{% generation %}}...{{% endgeneration %}}, or label the turns in your own collator"
    )
