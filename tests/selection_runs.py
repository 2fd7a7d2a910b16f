"""Trainer outputs with evaluations, written in the test as the Hugging Face Trainer leaves them: a
`trainer_state.json` whose log history holds training logs and eval logs (any eval metric: eval_loss, eval_wer,
eval_accuracy), with the best_metric / best_global_step / best_model_checkpoint the Trainer tracks when it
selects checkpoints, and `checkpoint-N/` folders holding real (tiny) safetensors weights and their own state."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from sftaudit.imports import import_run
from sftaudit.verdict.audit import audit


def eval_run(
    run_dir: Path,
    evals: dict[str, list[float]],
    every: int = 100,
    saved: list[int] | None = None,
    best: str | None = None,
    greater_is_better: bool = False,
    config: dict | None = None,
    logging_steps: int = 10,
    seed: int = 0,
) -> Path:
    """A Trainer output evaluated every `every` steps: `evals` maps eval keys to their values at steps
    every, 2 x every, ...; training logs every `logging_steps` steps with an ordinary falling loss; a
    checkpoint folder at each step of `saved` (default: every evaluation); `best` names the metric the run
    selected on (best_metric and its step and checkpoint written as the Trainer writes them)."""
    run_dir.mkdir(parents=True)
    n = len(next(iter(evals.values())))
    last = n * every
    rng = np.random.default_rng(seed)
    history = []
    for step in range(logging_steps, last + 1, logging_steps):
        loss = (0.6 + 1.4 * np.exp(-step / (last / 5))) * np.exp(0.03 * rng.standard_normal())
        history.append(
            {
                "epoch": step / last,
                "grad_norm": float(1.0 + 0.1 * rng.standard_normal()),
                "learning_rate": 2e-5,
                "loss": round(float(loss), 4),
                "step": step,
            }
        )
    for i in range(n):
        step = (i + 1) * every
        entry = {"epoch": step / last, "step": step, "eval_runtime": 3.2, "eval_samples_per_second": 31.0}
        entry |= {key: float(values[i]) for key, values in evals.items()}
        history.append(entry)
    history.sort(key=lambda e: (e["step"], "loss" not in e))
    saved = [(i + 1) * every for i in range(n)] if saved is None else saved

    def state(upto: int) -> dict:
        logs = [e for e in history if e["step"] <= upto]
        out = {
            "global_step": upto,
            "max_steps": last,
            "logging_steps": logging_steps,
            "eval_steps": every,
            "save_steps": saved[0] if saved else 500,
            "num_train_epochs": 1,
            "train_batch_size": 8,
            "epoch": upto / last,
            "log_history": logs,
            "best_metric": None,
            "best_global_step": None,
            "best_model_checkpoint": None,
        }
        if best is not None:
            scored = [e for e in logs if best in e]
            if scored:
                values = [e[best] for e in scored]
                # The Trainer replaces its best only on a strictly better value: the earliest of equals stays.
                at = scored[int(np.argmax(values) if greater_is_better else np.argmin(values))]["step"]
                out |= {
                    "best_metric": values[[e["step"] for e in scored].index(at)],
                    "best_global_step": at,
                    # Set when a checkpoint is saved at the best step (and only then).
                    "best_model_checkpoint": f"/cluster/out/checkpoint-{at}" if at in saved else None,
                }
        return out

    for step in saved:
        folder = run_dir / f"checkpoint-{step}"
        folder.mkdir()
        weights = {"model.weight": np.full((4, 4), 1.0 + step / 1000, dtype=np.float32)}
        save_file(weights, str(folder / "model.safetensors"))
        (folder / "trainer_state.json").write_text(json.dumps(state(step)), encoding="utf-8")
    (run_dir / "trainer_state.json").write_text(json.dumps(state(last)), encoding="utf-8")
    if config is not None:
        (run_dir / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return run_dir


def audited(run_dir: Path) -> dict:
    import_run(run_dir)
    return audit(run_dir)


def findings(verdict: dict, code: str = "LOOP-26") -> list[dict]:
    assert verdict["check_errors"] == []
    return [f for f in verdict["findings"] if f["code"] == code]


def status(verdict: dict, code: str = "LOOP-26") -> tuple[str, str | None]:
    check = next(c for c in verdict["checks"] if c["code"] == code)
    return check["status"], check["reason"]
