"""Log histories built in the test for the loss-curve checks (LOOP-10, LOOP-19..21, LOOP-25, LOOP-27): a
`trainer_state.json` whose `log_history` is given entry by entry (any key, NaN included, evaluations with any
eval_* key), beside an optional `config.json`, imported and audited as a user's `sftaudit audit` does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .logged_runs import audited


def history(loss, lr=2e-4, grad_norm=None, every: int = 1, keys: dict | None = None) -> list[dict]:
    """Training log entries: `loss[i]` at step (i + 1) x `every`; `lr` a number or a sequence; `grad_norm` and
    each of `keys` (name -> sequence) logged beside it."""
    n = len(loss)
    lrs = np.broadcast_to(np.asarray(lr, dtype=float), (n,))
    out = []
    for i in range(n):
        entry = {"epoch": round((i + 1) / n, 4), "learning_rate": float(lrs[i]), "loss": float(loss[i])}
        if grad_norm is not None:
            entry["grad_norm"] = float(grad_norm[i])
        for name, values in (keys or {}).items():
            entry[name] = float(values[i])
        out.append(entry | {"step": (i + 1) * every})
    return out


def evaluations(steps, **metrics) -> list[dict]:
    """Evaluation log entries at `steps`, each metric (eval_loss=[...], eval_wer=[...]) one value per step."""
    return [
        {"epoch": 0.0, **{k: float(v[i]) for k, v in metrics.items()}, "eval_runtime": 1.0, "step": int(s)}
        for i, s in enumerate(steps)
    ]


def state_run(run_dir: Path, entries: list[dict], config: dict | None = None, max_steps: int | None = None) -> Path:
    """A Trainer output folder holding `entries` as its log history (sorted by step, training before eval)."""
    run_dir.mkdir(parents=True)
    entries = sorted(entries, key=lambda e: (e["step"], any(k.startswith("eval_") for k in e)))
    last = max(e["step"] for e in entries)
    logged = sorted({e["step"] for e in entries if "loss" in e})
    state = {
        "global_step": last,
        "max_steps": max_steps or last,
        "logging_steps": logged[1] - logged[0] if len(logged) > 1 else 1,
        "num_train_epochs": 1,
        "epoch": 1.0,
        "log_history": entries,
    }
    (run_dir / "trainer_state.json").write_text(json.dumps(state), encoding="utf-8")  # NaN as the Trainer writes it
    if config is not None:
        (run_dir / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return run_dir


def audit_state(run_dir: Path, entries: list[dict], config: dict | None = None) -> dict:
    return audited(state_run(run_dir, entries, config))
