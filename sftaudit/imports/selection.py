"""The metric a Trainer run chose its best checkpoint by, as ``trainer_state.json`` keeps it.

The Trainer tracks ``best_metric``, ``best_model_checkpoint`` and (transformers >= 4.47) ``best_global_step``
whenever ``metric_for_best_model`` is set (``load_best_model_at_end`` sets it to the loss by default). The
name of that metric lives only in ``training_args.bin``, a pickle that is never read: the metric is the eval
key whose logged value at the best step equals ``best_metric``, and whether greater is better is told by
``best_metric`` against that key's other logged values (the best of them all, at one end).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

_CHECKPOINT_STEP = re.compile(r"(?:checkpoint|ckpt)[-_]?(\d+)")


def run_selection(state: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``{metric, greater_is_better, best_metric, best_global_step, best_model_checkpoint}`` from a
    ``trainer_state.json``'s fields (`state`, its log aside) and its normalised log `history`; None when the
    run tracked no best metric. `metric` or `greater_is_better` is None when the logs do not tell it."""
    best = state.get("best_metric") if isinstance(state, dict) else None
    if not _number(best) or not math.isfinite(best):
        return None
    checkpoint = state.get("best_model_checkpoint")
    checkpoint = checkpoint if isinstance(checkpoint, str) else None
    step = state.get("best_global_step")
    if not (_number(step) and step == int(step)):
        found = _CHECKPOINT_STEP.fullmatch(Path(checkpoint).name) if checkpoint else None
        step = int(found.group(1)) if found else None
    evals = [e for e in history if any(k.startswith("eval_") for k in e)]
    at_best = [e for e in evals if step is None or e["step"] == step]
    keys = sorted({k for e in at_best for k, v in e.items() if k.startswith("eval_") and _equal(v, best)})
    metric = keys[0] if len(keys) == 1 else None
    if metric is not None and step is None:
        step = next(e["step"] for e in at_best if _equal(e.get(metric), best))
    return {
        "metric": metric,
        "greater_is_better": _greater_is_better(metric, best, evals),
        "best_metric": float(best),
        "best_global_step": int(step) if step is not None else None,
        "best_model_checkpoint": checkpoint,
    }


def _greater_is_better(metric: str | None, best: float, evals: list[dict[str, Any]]) -> bool | None:
    """True when `best` is the largest of the metric's logged values and not also the smallest; False the
    other way round; None when the values do not tell (one value, or none, or best_metric not at an end)."""
    if metric is None:
        return None
    values = [e[metric] for e in evals if _number(e.get(metric)) and math.isfinite(e[metric])]
    if not values:
        return None
    top, bottom = _equal(max(values), best), _equal(min(values), best)
    return None if top == bottom else top


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _equal(value: Any, best: float) -> bool:
    # The state keeps the float the log holds; a tolerance covers a metric logged rounded.
    return _number(value) and math.isclose(value, best, rel_tol=1e-9, abs_tol=1e-12)
