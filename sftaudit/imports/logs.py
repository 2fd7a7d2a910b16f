"""Training logs kept per (re)start (LLaMA-Factory's trainer_log.jsonl, TensorBoard event files), as the
log histories a ``trainer_state.json`` would have held: what the import reads when no state survives."""

from __future__ import annotations

from typing import Any


def log_histories(segments: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """Per restart, the log history the Trainer held after it: earlier lines before its first step, then its own."""
    out = []
    for i, seg in enumerate(segments):
        start = seg[0]["step"]
        earlier = [e for s in segments[:i] for e in s if e["step"] < start]
        # Of the earlier restarts' lines, only the newest for each step: each restart overwrote what followed it.
        kept = {}
        for e in earlier:
            kept[(e["step"], tuple(sorted(e)))] = e
        out.append(sorted(kept.values(), key=lambda e: e["step"]) + seg)
    return out


def logging_interval(history: list[dict[str, Any]]) -> int | None:
    """``logging_steps`` as the log shows it (the smallest gap between training logs)."""
    steps = sorted({e["step"] for e in history if "loss" in e})
    gaps = [b - a for a, b in zip(steps, steps[1:]) if b > a]
    return min(gaps) if gaps else None
