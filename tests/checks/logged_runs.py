"""Runs as a trainer leaves them on disk without the shim: a `trainer_state.json` written in the test, shaped as
the Hugging Face Trainer writes it (log_history of training and eval logs), imported and audited as a user's
`sftaudit audit` does. For the dynamics checks that judge what a loss curve shows (LOOP-10, LOOP-19..25)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from sftaudit.imports import import_run
from sftaudit.verdict.audit import audit

REALRUNS = Path(__file__).resolve().parents[2] / ".." / "shared" / "realruns"


def trainer_run(
    run_dir: Path,
    loss,
    lr=2e-4,
    grad_norm=None,
    every: int = 1,
    max_steps: int | None = None,
    evals=(),
    keys: dict | None = None,
    config: dict | None = None,
    train_batch_size: int | None = None,
    decimals: int | None = None,
) -> Path:
    """A Trainer output folder: `loss[i]` logged at step (i + 1) x `every`; `lr` a number or a list; `grad_norm`
    a list or None (an older Trainer logs none); `evals` (step, eval_loss) pairs; `keys` extra per-log numbers
    (name -> list, e.g. TRL's `rewards/margins`); `config` a config.json; `decimals` rounds the loss as
    transformers < 4.40 logged it."""
    run_dir.mkdir(parents=True)
    n = len(loss)
    lrs = list(lr) if isinstance(lr, (list, tuple, np.ndarray)) else [lr] * n
    history = []
    for i in range(n):
        value = float(loss[i])
        entry = {
            "epoch": round((i + 1) / n, 4),
            "learning_rate": float(lrs[i]),
            "loss": round(value, decimals) if decimals is not None and math.isfinite(value) else value,
            "step": (i + 1) * every,
        }
        if grad_norm is not None:
            entry["grad_norm"] = float(grad_norm[i])
        for name, values in (keys or {}).items():
            entry[name] = float(values[i])
        history.append(entry)
    for step, value in evals:
        history.append({"epoch": step / (n * every), "eval_loss": float(value), "eval_runtime": 1.0, "step": int(step)})
    history.sort(key=lambda e: (e["step"], "eval_loss" in e))
    last = n * every
    state = {
        "global_step": last,
        "max_steps": max_steps or last,
        "logging_steps": every,
        "num_train_epochs": 1,
        "train_batch_size": train_batch_size,
        "save_steps": 500,
        "eval_steps": 500,
        "epoch": 1.0,
        "log_history": history,
    }
    (run_dir / "trainer_state.json").write_text(
        json.dumps(state), encoding="utf-8"
    )  # NaN / Infinity as the Trainer writes
    if config is not None:
        (run_dir / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return run_dir


def audited(run_dir: Path) -> dict:
    import_run(run_dir)
    return audit(run_dir)


def findings(verdict: dict, code: str, severities=("info", "warn", "fail")) -> list[dict]:
    """One check's findings; a check that crashed (reported, not raised) fails the test."""
    assert verdict["check_errors"] == []
    return [f for f in verdict["findings"] if f["code"] == code and f["severity"] in severities]


def status(verdict: dict, code: str) -> tuple[str, str | None]:
    check = next(c for c in verdict["checks"] if c["code"] == code)
    return check["status"], check["reason"]


def falling(n: int, start: float = 2.0, end: float = 0.8, noise: float = 0.05, seed: int = 0) -> np.ndarray:
    """An ordinary SFT loss: exponential approach to `end`, multiplicative noise of `noise` per logged value."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    return (end + (start - end) * np.exp(-t / (n / 5))) * np.exp(noise * rng.standard_normal(n))


def logged(steps, loss, lr, grad_norm=None, epochs_per_step: float = 0.001) -> list[dict]:
    """Training log entries as the Trainer writes them, one per step of `steps`."""
    return [
        {
            "epoch": s * epochs_per_step,
            "learning_rate": float(lr[i]),
            "loss": float(loss[i]),
            "step": int(s),
            **({} if grad_norm is None else {"grad_norm": float(grad_norm[i])}),
        }
        for i, s in enumerate(steps)
    ]


def save_state(
    run_dir: Path, folder: str, history: list[dict], max_steps: int, save_steps: int = 500, **fields
) -> Path:
    """A `trainer_state.json` in `run_dir/folder` ("." for the run folder's own): the log history so far and the
    plan, as `TrainerState.save_to_json` writes them; `fields` other state fields (`stateful_callbacks`, ...)."""
    folder_path = run_dir / folder
    folder_path.mkdir(parents=True, exist_ok=True)
    last = max((e["step"] for e in history), default=0)
    state = {
        "global_step": fields.pop("global_step", last),
        "max_steps": max_steps,
        "logging_steps": fields.pop("logging_steps", 1),
        "save_steps": save_steps,
        "eval_steps": 500,
        "train_batch_size": 4,
        "num_train_epochs": 1,
        "log_history": history,
        **fields,
    }
    (folder_path / "trainer_state.json").write_text(json.dumps(state), encoding="utf-8")
    return run_dir


def linear_schedule(steps, peak: float, warmup: int, total: int) -> np.ndarray:
    """The Trainer's linear schedule with warm-up: the LR a step trained with."""
    s = np.asarray(steps, dtype=float)
    return np.where(s < warmup, peak * s / max(warmup, 1), peak * np.maximum(total - s, 0) / max(total - warmup, 1))
