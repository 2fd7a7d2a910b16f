"""The dataset report of `sftaudit preflight`: what a data engineer needs to trust a dataset
before training on it, from the preflight's DuckDB tables, its stored verdict and the preview
preflight stored in its manifest (sftaudit/dataset/preview.py). Nothing is computed here.
"""

from __future__ import annotations

from typing import Any

from ...checks import DATASET_CHECKS
from ...checks.base import SEVERITY_RANK
from . import figures, tables
from .evidence import token_block

# The run-level padding finding of LOOP-03 carries the waste and the length-grouping saving.
PADDING_KEYS = ("value", "real_tokens", "padded_tokens", "grouped_padded_tokens", "grouped_saving")


def dataset_context(
    con, manifest: dict[str, Any], checks: list[dict[str, Any]], findings: list[dict[str, Any]]
) -> dict[str, Any]:
    preview = manifest.get("preview") or {}
    figs = {}
    for div, column, title, colour in (
        ("lengths", "lengths", "tokens per sample", "#5c6bc0"),
        ("trained", "label_tokens", "trained tokens per sample", "#2e7d32"),
    ):
        frame = tables.per_sample_histogram(con, column)
        if frame.height:
            figs[f"hist-{div}"] = figures.sample_histogram(frame, title, colour)
    padding = next(
        (
            f["evidence"]
            for f in findings
            if f["code"] == "LOOP-03"
            and isinstance(f["evidence"], dict)
            and all(k in f["evidence"] for k in PADDING_KEYS)
        ),
        None,
    )
    applicable = [c for c in checks if c["code"] in DATASET_CHECKS]  # a dataset check a config switched off shows OFF
    return {
        "dataset": manifest.get("dataset") or {},
        "setup": manifest.get("preflight") or {},
        "tokenizer": manifest.get("tokenizer") or {},
        "summary": tables.dataset_summary(con),
        "samples": [dict(s, tokens_block=token_block("label view", s["tokens"])) for s in preview.get("samples") or []],
        "markers": preview.get("markers") or [],
        "padding": padding,
        "figures": figs,
        "checks": applicable,
        "training_checks": [c for c in checks if c["code"] not in DATASET_CHECKS],
        "groups": [
            {"check": c, "findings": sorted(c["findings"], key=lambda f: -SEVERITY_RANK[f["severity"]])}
            for c in applicable
            if c["findings"]
        ],
        "findings": findings,
    }
