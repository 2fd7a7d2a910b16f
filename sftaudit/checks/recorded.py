"""What the data-layer checks read of a recorded run: its own tokenizer, its first manifest, its samples."""

from __future__ import annotations

import json
from typing import Any

from ..core.artifacts import TOKENIZER_DIR, artifact_root, template_fingerprint
from ..core.tokenizer import TokenizerUnusable, load_tokenizer
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
