"""LLaMA-Factory's ``trainer_log.jsonl``: its training log, which survives what ``trainer_state.json`` loses.

LLaMA-Factory's ``LogCallback.on_log`` (``src/llamafactory/train/callbacks.py``) appends one JSON
object per Trainer log to ``output_dir/trainer_log.jsonl``: ``current_steps`` (the global step),
``total_steps``, ``loss``, ``eval_loss``, ``predict_loss``, ``reward``, ``accuracy``, ``lr``,
``epoch``, ``percentage``, ``elapsed_time``, ``remaining_time``, then ``throughput`` and
``total_tokens`` when tokens are counted; keys whose value is None are dropped. It has no
``grad_norm``. The file is opened in append mode and deleted at start only with
``overwrite_output_dir``, so a resumed run appends: ``current_steps`` going back (or a training
log repeating its step) marks a restart, and the lines before it from that step on are the branch
the resume abandoned (which the resumed ``trainer_state.json`` no longer holds).

Here each restart's lines become log-history entries in ``trainer_state.json``'s key names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TRAINER_LOG = "trainer_log.jsonl"
LOG_SOURCE = "imported logs: trainer_log.jsonl (LLaMA-Factory)"
NO_GRAD_NORM = {"LOOP-05": "trainer_log.jsonl has no grad_norm (LLaMA-Factory keeps it in trainer_state.json only, "
                           "and this run has none)"}
# trainer_log.jsonl key -> the Trainer's log_history key
KEYS = {"loss": "loss", "eval_loss": "eval_loss", "predict_loss": "predict_loss", "reward": "reward",
        "accuracy": "rewards/accuracies", "lr": "learning_rate", "epoch": "epoch", "total_tokens": "num_input_tokens_seen",
        "throughput": "throughput"}


def log_segments(run_dir: Path) -> list[list[dict[str, Any]]]:
    """The file's lines as log-history entries, split where ``current_steps`` goes back or a training
    log repeats (a restart);
    [] when there is no file. A line that is not JSON (a write cut short) is skipped."""
    try:
        lines = (run_dir / TRAINER_LOG).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    segments: list[list[dict[str, Any]]] = [[]]
    last = last_loss = -1
    for line in lines:
        try:
            raw = json.loads(line)
        except ValueError:
            continue
        step = raw.get("current_steps") if isinstance(raw, dict) else None
        if not isinstance(step, int) or not any(k in raw for k in KEYS if k not in ("epoch", "lr")):
            continue  # a prediction-progress line, or no training/eval number in it
        # A restart: the step goes back, or a training log repeats one (an eval logs at a training log's step).
        if step < last or ("loss" in raw and step <= last_loss):
            segments.append([])
            last_loss = -1
        last = step
        last_loss = step if "loss" in raw else last_loss
        segments[-1].append({"step": step} | {KEYS[k]: v for k, v in raw.items() if k in KEYS})
    return [s for s in segments if s]
