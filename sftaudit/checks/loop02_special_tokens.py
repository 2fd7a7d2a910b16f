"""LOOP-02 tokenizer special-token alignment."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from ..core.artifacts import template_fingerprint
from ..core.tokenizer import current_fingerprint, describe_tokenizer, load_tokenizer, refusal, tokenizer_changes
from ..dataset.layout import matches, run_layout, sample_blocks
from ..dataset.template_text import TemplateOverBudget, template_source
from ..errors import InputError
from ..readers.checkpoints import CheckpointError, inside_run
from .base import AuditContext, CannotJudge, Check, Finding, share
from .recorded import end_of_turn_markers, first_manifest, recorded_samples, run_tokenizer

# Shapes of control markers in template literals: <|eot_id|>, <s>, </s>, <start_of_turn>, [INST].
_MARKER = re.compile(r"<\|[^<>|\s]+\|>|</?[A-Za-z_][\w-]*>|\[/?[A-Z_]{2,}\]")


class SpecialTokenAlignment(Check):
    """Tokenizer special-token alignment (trigger point: after tokenize).

    What it detects:
        A control marker the template emits that the tokenizer splits into several pieces
        (in the rendered samples; one only in unreached branches is info); no eos token; pad
        == the marker that ends an assistant turn while every real one is masked (the model
        never learns to stop); samples that start with two BOS tokens (the template writes one
        and the tokenizer call adds another), or with none where the template opens with BOS (inference
        sends it: the render was stripped of it and the tokenizer adds none); an embedding matrix with fewer rows than the tokenizer has ids; a tokenizer
        that changes within the run (between batches, at a checkpoint, or on resume).
    Why it matters:
        A split marker is learned as ordinary text, so generation never emits the real one;
        ids beyond the embedding index garbage or crash; a tokenizer swapped mid-run
        silently remaps every id the model has learned.
    Statistic:
        Markers: the tokenizer's own special/added tokens found in the template's literal
        strings (jinja2 AST) plus marker-shaped literals, each encoded without extra
        specials, then searched (as its pieces) in the recorded rows. pad == stop: trained share
        of the end-of-turn markers of the assistant turns (derived from the template) in the
        recorded rows, counted as LOOP-04 counts them (once per marker, where the template trains it).
        Identity: per-batch tokenizer length, checkpoint and segment fingerprints against
        the run's first manifest. A fingerprint is of what the tokenizer is (vocabulary, merges,
        added and special tokens, normaliser, pre-tokenizer, post-processor, decoder, chat
        template), never the truncation or padding it was last called with (TRL leaves
        truncation set while it tokenizes); fingerprints recorded before that are recomputed from
        the tokenizer saved with the checkpoint. What changed is named from the tokenizer saved
        with the checkpoint, else from the batch records (their tokenizer length and template).
    Threshold:
        Any split marker the samples contain, missing eos, untrained stop marker with pad ==
        stop, double or missing BOS, too few embedding rows, frozen untrained marker rows (norm below 5%
        of the median row norm) or changed tokenizer is a fail; a generation eos without the
        end-of-turn marker is a warn; a split marker only in unreached branches, or untrained
        marker rows that are trainable, is info. An imported run whose tokenizer saved last differs from
        every checkpoint's in its special tokens only (a pad token added at save, after training) is a
        warn (risk), at run scope. The tokenizer's and template's setup (split markers, eos, pad ==
        stop, BOS, embedding and marker rows, generation eos) is a configuration finding: it holds
        from the first batch, and rolling back or skipping batches does not fix it; a tokenizer that
        changes within the run is an anomaly at that step.
    Evidence:
        Each split marker with its pieces and ids; special-token ids; the doubled-BOS sample
        ids; each untrained marker's row norms and the medians; embedding rows and
        tokenizer length; the step / checkpoint, both fingerprints or lengths, and the changes (each
        special token's role before and after, the tokens added or removed, the template).
    """

    code = "LOOP-02"
    name = "tokenizer special-token alignment"
    rules = {
        "marker-split": "a template marker is split into several tokens",
        "no-eos": "the tokenizer has no eos token",
        "pad-is-end-of-turn": "pad is the end-of-turn marker and every one is masked with the padding",
        "untrained-marker-rows": "template markers have untrained embedding/output rows",
        "stop-not-in-generation-config": "generation does not stop on the template's end-of-turn marker",
        "double-bos": "samples start with two BOS tokens",
        "missing-bos": "samples do not start with the BOS the template opens with",
        "embedding-too-small": "the embedding has fewer rows than the tokenizer has ids",
        "tokenizer-length-changed": "the tokenizer's length changed during the run",
        "special-tokens-changed-at-save": "the tokenizer saved at the end differs in its special tokens only",
        "tokenizer-changed-at-save": "a tokenizer saved with a checkpoint is not the one the run trained with",
        "resume-tokenizer-changed": "the run resumed with a different tokenizer",
    }
    needs = ("tokenizer",)
    source_needs = ("tokenizer",)
    defaults = {"untrained_row_fraction": share(0.05)}

    def run(self, ctx: AuditContext) -> list[Finding]:
        try:
            return self._judge(ctx)
        except TemplateOverBudget as exc:  # LOOP-01 fails the template; its markers cannot be read off it
            raise CannotJudge(str(exc)) from None

    def _judge(self, ctx: AuditContext) -> list[Finding]:
        start = first_manifest(ctx)
        described = start.get("tokenizer") or {}
        if not described:
            return []
        tokenizer = run_tokenizer(ctx)
        findings = (
            self._identity(ctx, described, tokenizer)
            + self._embedding(ctx, start, described)
            + self._untrained(ctx, start)
        )
        if tokenizer is not None:
            findings += (
                self._markers(ctx, tokenizer)
                + self._eos(ctx, tokenizer)
                + self._double_bos(ctx, tokenizer)
                + self._bos_missing(ctx, tokenizer)
                + self._stops_on(start, tokenizer)
            )
        return findings

    def _markers(self, ctx: AuditContext, tokenizer: Any) -> list[Finding]:
        source = template_source(getattr(tokenizer, "chat_template", None))
        if source is None:
            return []
        from ..dataset.fields import template_fields  # the parser imports jinja2: only a run with a template pays

        fields = template_fields(source)
        literal_text = "\0".join(fields.literals)
        known = {str(t) for t in tokenizer.all_special_tokens}
        known |= {t.content for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()}
        candidates = {t for t in known if t and t in literal_text} | set(_MARKER.findall(literal_text))
        for role in ("bos", "eos"):
            token = getattr(tokenizer, f"{role}_token", None)
            if f"{role}_token" in fields.context and token:
                candidates.add(str(token))
        split = []
        for marker in sorted(candidates):
            ids = list(tokenizer(marker, add_special_tokens=False)["input_ids"])
            if len(ids) != 1:
                split.append({"marker": marker, "pieces": tokenizer.convert_ids_to_tokens(ids), "ids": ids})
        if not split:
            return []
        # Judged on what the data renders: a marker only in branches the rows never take (tool calls) is info.
        reached = set()
        if ctx.has_rows("samples"):
            for _, ids, _, _ in sample_blocks(recorded_samples(ctx, source)):
                reached |= {m["marker"] for m in split if m["marker"] not in reached and matches(ids, m["ids"]).any()}
        findings = []
        for severity, markers, where in (
            ("fail", [m for m in split if m["marker"] in reached], "in the samples"),
            ("info", [m for m in split if m["marker"] not in reached], "only in branches these samples never render"),
        ):
            if markers:
                first = markers[0]
                findings.append(
                    self.finding(
                        "marker-split",
                        severity,
                        f"the template emits {len(markers)} marker(s) the tokenizer splits {where}, first "
                        f"{first['marker']!r} into {len(first['pieces'])} pieces {first['pieces']}; add them as special "
                        f"tokens (and resize the embeddings) or use the tokenizer's own markers",
                        category="configuration",
                        split_markers=markers,
                        reached=severity == "fail",
                    )
                )
        return findings

    def _eos(self, ctx: AuditContext, tokenizer: Any) -> list[Finding]:
        """pad == the marker that ends an assistant turn (not the eos string: Phi-3.5 appends its eos,
        which is also its pad, after the `<|end|>` that stops a turn), with every real one masked."""
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        if eos is None:
            return [
                self.finding(
                    "no-eos",
                    "fail",
                    "the tokenizer has no eos token, so generation cannot learn to stop; "
                    "set eos_token to the template's end-of-turn marker",
                    category="configuration",
                )
            ]
        layout = _turn_layout(tokenizer)
        stop = layout.turn_end[-1] if layout is not None and layout.turn_end else eos
        if pad is None or pad != stop or not ctx.has_rows("samples"):
            return []
        if layout is not None and layout.turn_end and "assistant" in layout.headers:
            # The assistant turns' markers, counted as LOOP-04 counts them: one count, one definition.
            ends = end_of_turn_markers(recorded_samples(ctx, template_source(tokenizer.chat_template)), layout, pad)
            attended, trained = ends["total"], ends["trained"]
            step, sample = (ends["rows"][0][0], ends["rows"][0][1]) if ends["rows"] else (None, None)
            what = "that end an assistant turn"
        else:  # a template without turns: every attended stop token is one
            attended, trained, step, sample = ctx.row(
                """
                SELECT count(*), count(*) FILTER (WHERE label <> -100), min(step), arg_min(sample_id, step)
                FROM (SELECT step, sample_id, unnest(input_ids) AS id, unnest(labels) AS label,
                             unnest(attention_mask) AS attended FROM samples)
                WHERE id = ? AND attended = 1
                """,
                [stop],
            )
            what = "in the samples"
        if not attended or trained:
            return []
        marker = tokenizer.convert_ids_to_tokens(stop)
        return [
            self.finding(
                "pad-is-end-of-turn",
                "fail",
                f"pad is the end-of-turn marker {marker!r} (id {stop}) and all {attended} {what} are masked "
                f"with the padding, so the model never learns to stop; use a distinct pad token or mask padding by "
                f"attention_mask",
                step=step,
                category="configuration",
                sample_ids=[sample],
                pad_id=pad,
                eos_id=stop,
                stop_marker=marker,
                eos_attended=attended,
                eos_trained=trained,
            )
        ]

    def _untrained(self, ctx: AuditContext, start: dict) -> list[Finding]:
        """Template markers the samples use whose embedding and output rows are near zero at start:
        frozen, they never train, so the model cannot read or emit them."""
        rows = start.get("marker_rows")
        if not rows or not ctx.has_rows("samples"):
            return []
        fraction = self.params["untrained_row_fraction"]
        output = rows.get("output_norm") or [None] * len(rows["ids"])
        low = [
            (i, t, e, o)
            for i, t, e, o in zip(rows["ids"], rows["tokens"], rows["embed_norm"], output)
            if e < fraction * rows["embed_median"] and (o is None or o < fraction * rows["output_median"])
        ]
        if not low:
            return []
        used = {
            r[0]
            for r in ctx.con.execute(
                f"SELECT DISTINCT id FROM (SELECT unnest(input_ids) AS id FROM samples) WHERE id IN ({','.join('?' * len(low))})",
                [i for i, *_ in low],
            ).fetchall()
        }
        low = [r for r in low if r[0] in used]
        if not low:
            return []
        frozen = not rows.get("embed_trainable") or rows.get("output_trainable") is False
        return [
            self.finding(
                "untrained-marker-rows",
                "fail" if frozen else "info",
                f"{len(low)} template marker(s) the samples use have untrained embedding/output rows (norm below "
                f"{fraction:.0%} of the median), first {low[0][1]!r} (embedding {low[0][2]:.3g}, median "
                f"{rows['embed_median']:.3g})"
                + (
                    "; the rows are frozen, so they never train: make the embeddings and "
                    "lm_head trainable (modules_to_save with LoRA) or initialise the rows "
                    "from the mean embedding"
                    if frozen
                    else "; they are trainable"
                ),
                category="configuration",
                kind="untrained_markers",
                markers=[{"id": i, "token": t, "embed_norm": e, "output_norm": o} for i, t, e, o in low],
                embed_median=rows["embed_median"],
                output_median=rows.get("output_median"),
                frozen=frozen,
            )
        ]

    def _stops_on(self, start: dict, tokenizer: Any) -> list[Finding]:
        """The model's generation eos (generation config, else model config) does not include the marker
        the template ends a turn with. Trained to emit it, the model is never stopped by it."""
        model = start.get("model") or {}
        stops = model.get("generation_eos")
        if stops is None:
            stops = (model.get("config") or {}).get("eos_token_id")
        layout = _turn_layout(tokenizer)
        if stops is None or layout is None or not layout.turn_end:
            return []
        stops = {int(i) for i in (stops if isinstance(stops, list) else [stops])}
        stop = layout.turn_end[-1]
        if stop in stops:
            return []
        marker = tokenizer.convert_ids_to_tokens(stop)
        return [
            self.finding(
                "stop-not-in-generation-config",
                "warn",
                f"the template ends each turn with {marker!r} (id {stop}) but generation stops on "
                f"{tokenizer.convert_ids_to_tokens(sorted(stops))} (ids {sorted(stops)}), so the tuned model runs on past "
                f"its answers; add {stop} to generation_config.eos_token_id (and the model config's eos_token_id)",
                category="configuration",
                kind="eos_differs_from_turn_end",
                turn_end_id=stop,
                turn_end=marker,
                generation_eos=sorted(stops),
            )
        ]

    def _double_bos(self, ctx: AuditContext, tokenizer: Any) -> list[Finding]:
        """The template writes BOS and the collator's tokenizer call adds another."""
        bos = tokenizer.bos_token_id
        if bos is None or not ctx.has_rows("samples"):
            return []
        hits: list[tuple[int, str]] = []
        for part, ids, _, attention in sample_blocks(recorded_samples(ctx, template_source(tokenizer.chat_template))):
            first = np.argmax(attention != 0, axis=1)
            rows = np.arange(ids.shape[0])
            second = np.minimum(first + 1, ids.shape[1] - 1)
            doubled = (ids[rows, first] == bos) & (ids[rows, second] == bos) & (second > first)
            picked = np.flatnonzero(doubled)
            hits += zip(part["step"].gather(picked).to_list(), part["sample_id"].gather(picked).to_list())
        if not hits:
            return []
        hits.sort()
        ids = list(dict.fromkeys(s for _, s in hits))
        return [
            self.finding(
                "double-bos",
                "fail",
                f"{len(ids)} sample(s) start with two BOS tokens {tokenizer.bos_token!r} from step {hits[0][0]} (first "
                f"{ids[0]}): the template writes BOS and the tokenizer adds another; tokenize the rendered text with "
                f"add_special_tokens=False",
                step=hits[0][0],
                category="configuration",
                kind="double_bos",
                bos_id=bos,
                sample_ids=ids[:50],
                samples_affected=len(ids),
            )
        ]

    def _bos_missing(self, ctx: AuditContext, tokenizer: Any) -> list[Finding]:
        """The template opens with BOS, so inference (apply_chat_template) sends it, but the trained rows start
        without it: the render was stripped of it (to avoid a double BOS) and the tokenizer adds none."""
        bos, layout = tokenizer.bos_token_id, _turn_layout(tokenizer)
        if bos is None or layout is None or not layout.starts_with_bos or not ctx.has_rows("samples"):
            return []
        hits: list[tuple[int, str, int]] = []
        for part, ids, _, attention in sample_blocks(recorded_samples(ctx, template_source(tokenizer.chat_template))):
            real = attention != 0
            first = np.argmax(real, axis=1)
            starts = ids[np.arange(ids.shape[0]), first]
            picked = np.flatnonzero(real.any(1) & (starts != bos))
            hits += zip(
                part["step"].gather(picked).to_list(),
                part["sample_id"].gather(picked).to_list(),
                starts[picked].tolist(),
            )
        if not hits:
            return []
        hits.sort()
        ids = list(dict.fromkeys(s for _, s, _ in hits))
        found = tokenizer.convert_ids_to_tokens(int(hits[0][2]))
        return [
            self.finding(
                "missing-bos",
                "fail",
                f"{len(ids)} sample(s) do not start with BOS {tokenizer.bos_token!r} from step {hits[0][0]} (first "
                f"{ids[0]} starts with {found!r}): the template opens with it and inference sends it, so the model is "
                f"trained on sequences it never sees; tokenize the template's render as it is (its BOS kept) with "
                f"add_special_tokens=False",
                step=hits[0][0],
                category="configuration",
                kind="bos_missing",
                bos_id=bos,
                first_token=found,
                sample_ids=ids[:50],
                samples_affected=len(ids),
            )
        ]

    def _embedding(self, ctx: AuditContext, start: dict, described: dict) -> list[Finding]:
        length = described.get("length")
        config = (start.get("model") or {}).get("config") or {}
        rows = config.get("vocab_size")
        if rows is None:
            rows = next(
                (p["shape"][0] for p in start.get("params", []) if "embed" in p["name"] and len(p["shape"]) == 2), None
            )
        top = ctx.scalar("SELECT max(list_max(input_ids)) FROM samples") if ctx.has_rows("samples") else None
        need = max(length or 0, (top + 1) if top is not None else 0)
        if rows is None or rows >= need:
            return []
        return [
            self.finding(
                "embedding-too-small",
                "fail",
                f"the embedding has {rows} rows but the tokenizer has {length} ids (largest recorded id {top}); "
                f"resize the token embeddings to at least {need}",
                category="configuration",
                embedding_rows=rows,
                tokenizer_length=length,
                max_input_id=top,
            )
        ]

    def _identity(self, ctx: AuditContext, described: dict, tokenizer: Any) -> list[Finding]:
        findings = []
        length = described.get("length")
        changed = ctx.row(
            """
            SELECT step, tokenizer_length, sample_ids FROM batches
            WHERE tokenizer_length IS NOT NULL AND tokenizer_length <> ? ORDER BY step, micro LIMIT 1
            """,
            [length],
        )
        if changed is not None:
            step, now, ids = changed
            findings.append(
                self.finding(
                    "tokenizer-length-changed",
                    "fail",
                    f"the tokenizer changed at step {step}: {length} ids at the start, {now} from then on; pin one "
                    f"tokenizer version for the whole run and restart from a checkpoint before step {step}",
                    step=step,
                    tokenizer_length_start=length,
                    tokenizer_length_now=now,
                    sample_ids=list(ids),
                )
            )
        return findings + self._saved_identity(ctx, described, tokenizer) + self._segment_identity(ctx, described)

    def _saved_identity(self, ctx: AuditContext, described: dict, tokenizer: Any) -> list[Finding]:
        """The tokenizer each checkpoint saved against the run's: what it is (vocabulary, merges, added and
        special tokens, normaliser, template), never the truncation or padding it was last called with."""
        fingerprint = described.get("fingerprint")
        rows = ctx.con.execute(
            "SELECT step, path, tokenizer_fingerprint FROM checkpoints WHERE event = 'saved' "
            "AND tokenizer_fingerprint IS NOT NULL ORDER BY step"
        ).fetchall()
        differing = [r for r in rows if r[2] != fingerprint]
        if not differing:
            return []
        reference = describe_tokenizer(tokenizer) if tokenizer is not None else described
        saved: dict[str, dict | None] = {}  # recorded fingerprint -> a description of its saved tokenizer
        changed = []
        for step, path, recorded in differing:
            if recorded not in saved:
                saved[recorded] = _saved_description(ctx, path)
            now = saved[recorded]
            if not (current_fingerprint(recorded) and current_fingerprint(fingerprint)):
                # Recorded before fingerprints left out truncation and padding: judged on the saved files.
                if now is None or tokenizer is None:
                    if current_fingerprint(recorded) or current_fingerprint(fingerprint):
                        continue  # two kinds of fingerprint and no files to recompute them from: not comparable
                elif now["fingerprint"] == reference["fingerprint"]:
                    continue
            changed.append((step, path, recorded, now))
        if not changed:
            return []
        step, path, recorded, now = changed[0]
        imported = bool(ctx.manifest.get("imported"))
        # An import describes the tokenizer saved last: the checkpoints' are the earlier ones.
        before, after = (now, reference) if imported else (reference, now)
        changes = tokenizer_changes(before, after) if now is not None else _batch_changes(ctx, described, step)
        what = "; ".join(c["text"] for c in changes) or (
            "what changed cannot be told: the checkpoint saved no tokenizer files (save the tokenizer with each "
            "checkpoint to have it named)"
            if now is None
            else "parts of it changed that its description does not name"
        )
        evidence = dict(
            checkpoint_path=path,
            fingerprint_start=fingerprint,
            fingerprint_now=recorded,
            checkpoints=[c[1] for c in changed],
            changes=changes,
        )
        last = rows[-1][1]
        if imported and len(changed) == len(rows) and changes and {c["part"] for c in changes} == {"special_tokens"}:
            # Every checkpoint trained with one tokenizer; only the one saved after them has other special tokens.
            roles = ", ".join(f"{c['role']} token {c['change']}" for c in changes)
            return [
                self.finding(
                    "special-tokens-changed-at-save",
                    "warn",
                    f"{roles} at save: the tokenizer saved after the last checkpoint ({last}) differs from the one "
                    f"the run trained with only in its special tokens ({what}); the weights are not affected, but "
                    f"batching with it (or training on) pads differently than this run did: ship the tokenizer the "
                    f"run trained with, or set the special tokens before training",
                    category="risk",
                    kind="special_tokens_changed_at_save",
                    **evidence,
                )
            ]
        where = (
            f"the tokenizer saved with {path} differs from the one saved last"
            if imported
            else f"the tokenizer saved with {path} is not the one the run started with"
        )
        return [
            self.finding(
                "tokenizer-changed-at-save",
                "fail",
                f"{where}: {what}; {len(changed)} checkpoint(s) affected, keep one tokenizer for the run",
                step=step,
                kind="tokenizer_changed",
                **evidence,
            )
        ]

    def _segment_identity(self, ctx: AuditContext, described: dict) -> list[Finding]:
        """A resumed segment's tokenizer against the first segment's (descriptions from the manifests)."""
        fingerprint = described.get("fingerprint")
        for seg, text in ctx.con.execute(
            "SELECT seg, manifest->'$.tokenizer' FROM manifest WHERE rank = 0 AND seg > 0 "
            "AND manifest->>'$.tokenizer.fingerprint' <> ? ORDER BY seg",
            [fingerprint],
        ).fetchall():
            now = json.loads(text) if text else {}
            changes = tokenizer_changes(described, now)
            comparable = current_fingerprint(now.get("fingerprint")) == current_fingerprint(fingerprint)
            if not changes and not comparable:
                continue  # fingerprints of two kinds, and nothing their descriptions show differs
            what = "; ".join(c["text"] for c in changes) or "parts of it changed that its description does not name"
            return [
                self.finding(
                    "resume-tokenizer-changed",
                    "fail",
                    f"the run resumed (segment {seg}) with a different tokenizer ({what}; fingerprint "
                    f"{now.get('fingerprint')}, started with {fingerprint}); resume with the tokenizer saved in the "
                    f"checkpoint",
                    segment=seg,
                    fingerprint_start=fingerprint,
                    fingerprint_now=now.get("fingerprint"),
                    changes=changes,
                )
            ]
        return []


def _batch_changes(ctx: AuditContext, described: dict, step: int) -> list[dict]:
    """What the batch records up to `step` show changed (a checkpoint that saved no tokenizer files): the
    tokenizer's length and the chat template each batch was made with."""
    length, template = described.get("length"), template_fingerprint(described.get("chat_template"))
    grown, grown_at, other_at = ctx.row(
        """
        SELECT max(tokenizer_length), min(step) FILTER (WHERE tokenizer_length <> ?),
               min(step) FILTER (WHERE template_fingerprint <> ?)
        FROM batches WHERE step <= ?
        """,
        [length, template, step],
    )
    changes = []
    if grown_at is not None and length is not None:
        changes.append(
            {
                "part": "vocabulary",
                "change": "resized",
                "text": f"the batches from step {grown_at} were made with {grown} ids, not {length}",
            }
        )
    if other_at is not None:
        changes.append(
            {
                "part": "chat_template",
                "change": "changed",
                "text": f"the batches from step {other_at} were rendered with another chat template",
            }
        )
    return changes


def _saved_description(ctx: AuditContext, path: str) -> dict | None:
    """The tokenizer saved in a checkpoint folder, described; None when it saved none (or not one sftaudit loads)."""
    try:
        folder = inside_run(ctx.run_dir, path)
    except CheckpointError:
        return None
    if not folder.is_dir() or refusal(folder) is not None:
        return None
    try:
        return describe_tokenizer(load_tokenizer(folder))
    except InputError:
        return None


def _turn_layout(tokenizer: Any) -> Any:
    """The template's turn markers, or None for a template without turns (Nemotron-Parse renders the contents
    only): its stop marker is then the tokenizer's eos."""
    try:
        return run_layout(tokenizer)
    except TemplateOverBudget:
        raise
    except InputError:
        return None
