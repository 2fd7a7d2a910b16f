"""What an imported run's logs cannot show, and what else the folder holds, said once per run: the manifest's
``notes``, each ``{"key", "text", ...details}`` under a stable key (checks and reports select by it); their texts are
the manifest's ``import_notes`` (the verdict's ``resolution.notes``). Decided from what the files hold."""

from __future__ import annotations

from itertools import compress
from operator import itemgetter
from typing import Any

import numpy as np

from ..core.safe_io import LFS_HINT

# The stable keys, in the order the notes are listed.
KEYS = (
    "other_runs",
    "earlier_run_in_log",
    "lfs_pointers",
    "skipped_records",
    "ignored_values",
    "nothing_logged",
    "log_ends_at_checkpoint",
    "logging_window",
    "nan_inf_filter",
    "no_grad_norm",
    "no_evaluation",
    "fp16_skipped_steps",
)
# A list of names in a note's text: this many, then "...".
NAMED = 3


def note(key: str, text: str, **details: Any) -> dict[str, Any]:
    assert key in KEYS, key
    return {"key": key, "text": text, **details}


def other_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs whose checkpoints share the folder with the judged one (`runs.describe` each)."""
    if not runs:
        return []
    named = []
    for r in runs:
        where = _names(r["checkpoints"]) or _names(r["state_files"])
        plan = ", ".join(f"{k} {r[k]:,}" for k in ("max_steps", "train_batch_size", "logging_steps") if k in r)
        named.append(f"{where} (step {r['global_step']:,}{'; ' + plan if plan else ''})")
    owners = f"{len(runs)} other runs'" if len(runs) > 1 else "1 other run's"
    return [
        note(
            "other_runs",
            f"{owners} checkpoints share this folder: "
            + "; ".join(named)
            + "; they are not part of the run judged here",
            runs=runs,
        )
    ]


def earlier_run_in_log(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Logs that hold another run before the judged one: {file, first_step, last_step, starts_at, why}."""
    return [
        note(
            "earlier_run_in_log",
            f"{p['file']} holds another run's log before this run's: steps {p['first_step']:,}-{p['last_step']:,}, "
            f"then {p['why']} at step {p['starts_at']:,}; only the log from step {p['starts_at']:,} is judged",
            **p,
        )
        for p in parts
    ]


def lfs(pointers: list[str]) -> list[dict[str, Any]]:
    if not pointers:
        return []
    more = ", ..." if len(pointers) > 1 else ""
    return [note("lfs_pointers", f"{len(pointers)} log file(s) ({pointers[0]}{more}) are a {LFS_HINT}", files=pointers)]


def skipped_records(skipped: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records of the log that could not be read and were skipped, per file (``{"file", "lines", "of"}``): the
    evidence coverage counts them (a run is unjudged when they are more than its share of missing evidence)."""
    return [
        note(
            "skipped_records",
            f"{s['lines']:,} of the {s['of']:,} records of {s['file']} could not be read and were skipped",
            **s,
        )
        for s in skipped
    ]


def ignored_values(ignored: dict[str, str], file: str) -> list[dict[str, Any]]:
    """Fields of the plan (or the state's ``global_step``) that hold no number (NaN, Infinity, text): left out."""
    if not ignored:
        return []
    said = ", ".join(f"{k} = {v}" for k, v in sorted(ignored.items()))
    return [note("ignored_values", f"{file} holds no number where one belongs ({said}): ignored", fields=ignored)]


def log_limits(
    timeline: list[dict[str, Any]],
    training_mask: np.ndarray,
    keys: set[str],
    newest: dict[str, Any],
    logging_steps: int | None,
    log_beyond_checkpoints: bool,
    ended: bool,
    scaler_in: list[str],
) -> list[dict[str, Any]]:
    """What the judged run's log cannot show (see `KEYS`); `training_mask`: which of the `timeline`'s entries are
    training logs (`logs.training_logs`), `keys`: the keys it holds; `ended`: the newest state says training ended
    there (its plan reached, or the Trainer told to stop), so a log that ends with it misses nothing."""
    out = []
    training = list(compress(timeline, training_mask))
    last = newest["global_step"]
    if not training:
        configured = newest.get("logging_steps")
        if isinstance(configured, int) and not isinstance(configured, bool) and configured > last:
            why = (
                f"logging_steps {configured:,} is more than the {last:,} step(s) the run trained: the Trainer "
                "logged no training step"
            )
        else:
            why = "the log holds no training step"
        out.append(note("nothing_logged", why, logging_steps=configured, global_step=last))
    if not log_beyond_checkpoints and not newest["top_level"] and not ended:
        name = newest["folder"].name
        out.append(
            note(
                "log_ends_at_checkpoint",
                f"the only log is the trainer_state.json saved with {name} (step {last:,}); no log written after it "
                "is in this folder (no trainer_state.json at its top, no trainer_log.jsonl or event file)",
                checkpoint=name,
                step=last,
            )
        )
    if training and logging_steps and logging_steps > 1:
        out.append(
            note(
                "logging_window",
                f"the Trainer logged every {logging_steps:,} steps: each loss is the mean of its window and each "
                f"grad_norm the window's last step's, so anything shorter than {logging_steps:,} steps is diluted "
                "or unseen",
                logging_steps=logging_steps,
            )
        )
    losses = list(map(itemgetter("loss"), training))
    if not set(map(type, losses)) <= {float}:  # a per-step log's are all floats: gathered in C
        losses = [v for v in losses if isinstance(v, float)]
    if losses and np.isfinite(np.array(losses, dtype=np.float64)).all():
        out.append(
            note(
                "nan_inf_filter",
                "the Trainer's logging_nan_inf_filter (on by default) logs a non-finite loss as the mean of the "
                "window's finite ones: a NaN or inf loss does not show in this log's loss (a NaN grad_norm still does)",
            )
        )
    if training and ("grad_norm" not in keys or not any("grad_norm" in e for e in training)):
        out.append(
            note(
                "no_grad_norm",
                "no gradient norm was logged (transformers before 4.38, max_grad_norm 0, or a log that keeps none): "
                "exploding gradients show only through the loss",
            )
        )
    if not any(k.startswith("eval_") for k in keys):
        out.append(
            note(
                "no_evaluation",
                "no evaluation was logged: over-fitting and the checkpoint worth keeping cannot be judged from the log",
            )
        )
    if scaler_in:
        out.append(
            note(
                "fp16_skipped_steps",
                f"the run trained with fp16 loss scaling ({_names([f'{c}/scaler.pt' for c in scaler_in])}): a step "
                "the scaler skipped on an overflow updates nothing and holds the schedule back, yet the log does not "
                "mark it",
                checkpoints=scaler_in,
            )
        )
    return out


def _names(names: list[str]) -> str:
    return ", ".join(names[:NAMED]) + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")
