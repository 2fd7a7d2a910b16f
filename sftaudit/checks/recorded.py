"""What the data-layer checks read of a recorded run: its own tokenizer, its first manifest, its samples."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ..core.artifacts import TOKENIZER_DIR, artifact_root, template_fingerprint
from ..core.tokenizer import TokenizerUnusable, load_tokenizer
from ..dataset.layout import IGNORE_INDEX, TRAINED, expected_labels, matches, sample_blocks
from .base import CannotJudge


def run_tokenizer(ctx: Any) -> Any | None:
    """The run's own tokenizer, as the shim saved it (None when the run recorded none)."""
    path = artifact_root(ctx.run_dir) / TOKENIZER_DIR
    try:
        return load_tokenizer(path) if path.is_dir() else None
    except TokenizerUnusable as exc:
        raise CannotJudge(str(exc).partition(": ")[2]) from None


def first_manifest(ctx: Any) -> dict:
    """The manifest of the run's first segment: the template and tokenizer it started with."""
    row = ctx.row("SELECT manifest FROM manifest WHERE rank = 0 ORDER BY seg LIMIT 1")
    return json.loads(row[0]) if row else ctx.manifest


def recorded_samples(ctx: Any, template: str | None) -> Any:
    """Recorded rows (step, sample_id, input_ids, labels, attention_mask) of batches rendered
    with `template` (rows of batches with another template are LOOP-01's)."""
    return ctx.frame(
        """
        SELECT s.step, s.sample_id, s.input_ids, s.labels, s.attention_mask
        FROM samples s JOIN batches b USING (rank, seg, step, micro)
        WHERE b.template_fingerprint IS NULL OR b.template_fingerprint = ? OR ? IS NULL
        ORDER BY s.step, s.micro, s.row
        """,
        [template_fingerprint(template), template_fingerprint(template)],
    )


def end_of_turn_markers(frame: Any, layout: Any, pad_id: int | None, last_turn_only: bool = False) -> dict[str, Any]:
    """The end-of-turn markers of the judged assistant turns in recorded rows (`recorded_samples`): the stop
    generation must learn to emit. One definition and one count for LOOP-02 and LOOP-04: a marker counts once,
    at its last token, where the template trains it; it is trained when that token carries a label. Returns
    `total`, `trained`, `rows` (step, sample id, position) of each row masking one, and `first`: that first
    row's input ids, labels, expected labels and attention mask, and the position (None when none is masked)."""
    out: dict[str, Any] = {"total": 0, "trained": 0, "rows": [], "first": None}
    k = len(layout.turn_end)
    for part, ids, labels, attention in sample_blocks(frame):
        expected, _ = expected_labels(ids, attention, layout, pad_id, last_turn_only)
        last = np.zeros(ids.shape, dtype=bool)
        if k and ids.shape[1] >= k:
            last[:, k - 1 :] = matches(ids, layout.turn_end)[:, : ids.shape[1] - k + 1]
        end = last & (expected == TRAINED)
        masked = end & (labels == IGNORE_INDEX)
        out["total"] += int(end.sum())
        out["trained"] += int((end & ~masked).sum())
        steps, sample_ids = part["step"].to_list(), part["sample_id"].to_list()
        for r in np.flatnonzero(masked.any(1)):
            pos = int(np.argmax(masked[r]))
            out["rows"].append((steps[r], sample_ids[r], pos))
            if out["first"] is None:
                out["first"] = (ids[r], labels[r], expected[r], attention[r], pos)
    return out
