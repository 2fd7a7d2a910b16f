"""Hostile inputs for the tests of this folder, each built in the test: a Trainer output folder (the
log and checkpoint folders the Hugging Face Trainer leaves) to plant them in, and the audit run in a
subprocess with a bound on its time, so a hang fails the test instead of stalling the suite."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# Generous: an audit of a small folder takes seconds (a minute or more on a loaded machine); only a hang reaches this.
AUDIT_BOUND_S = 600


def trainer_run(root: Path, steps: int = 40, checkpoints: tuple[int, ...] = (20,)) -> Path:
    """A Trainer output_dir with a smooth loss log and the given checkpoint folders (trainer_state.json only)."""
    run = root / "run"
    run.mkdir(parents=True)
    history = [
        {
            "step": s,
            "epoch": s / steps,
            "loss": 2.0 - s / (2 * steps) + 0.01 * (s % 3),
            "grad_norm": 1.0 + 0.05 * (s % 4),
            "learning_rate": 1e-4,
        }
        for s in range(1, steps + 1)
    ]
    state = {
        "global_step": steps,
        "max_steps": steps,
        "num_train_epochs": 1,
        "log_history": history,
        "logging_steps": 1,
        "save_steps": checkpoints[0] if checkpoints else 0,
    }
    (run / "trainer_state.json").write_text(json.dumps(state))
    for step in checkpoints:
        folder = run / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "trainer_state.json").write_text(
            json.dumps({**state, "global_step": step, "log_history": history[:step]})
        )
    return run


def audit(run: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`sftaudit audit RUN` in a subprocess; raises TimeoutExpired (a failed test) past the bound."""
    return subprocess.run(
        [sys.executable, "-m", "sftaudit.cli", "audit", str(run), *args],
        cwd=cwd or run.parent,
        capture_output=True,
        text=True,
        timeout=AUDIT_BOUND_S,
        stdin=subprocess.DEVNULL,
    )


def verdict(run: Path) -> dict:
    return json.loads((run.parent / "reports" / run.name / "verdict.json").read_text())


def findings(run: Path, code: str) -> list[dict]:
    return [f for f in verdict(run)["findings"] if f["code"] == code]


def preflight(root: Path, tokenizer_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """`sftaudit preflight` on a small clean dataset with `tokenizer_dir`, in a subprocess under the bound."""
    data = root / "data.jsonl"
    data.write_text(
        "\n".join(
            json.dumps(
                {
                    "id": f"r{i}",
                    "messages": [
                        {"role": "user", "content": f"question {i}"},
                        {"role": "assistant", "content": f"answer {i}"},
                    ],
                }
            )
            for i in range(20)
        )
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "sftaudit.cli",
            "preflight",
            "--data",
            str(data),
            "--tokenizer",
            str(tokenizer_dir),
            "--out",
            str(root / "out"),
            *args,
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=AUDIT_BOUND_S,
        stdin=subprocess.DEVNULL,
    )


def recorded_run(
    root: Path, name: str = "run", steps: int = 30, nan_step: int | None = None, tensor_names: list[str] | None = None
) -> Path:
    """A run in the shim's artifact format, written by the shim's own writer without training: four tensors'
    gradient norms (Parquet parts every 10 steps; `tensor_names` names them), one batch per step; from `nan_step`
    on, the loss and every norm are NaN (LOOP-05 fails it there). The clean one passes."""
    import math

    from sftaudit.fixtures.recording import bare_batch, bare_manifest

    from sftaudit.core.artifacts import rank_dir
    from sftaudit.shim.writer import JsonlWriter

    run = root / name
    writer = JsonlWriter(rank_dir(run, 0), roll_steps=10)
    names = tensor_names or [f"layer{i}.weight" for i in range(4)]
    params = [{"name": n, "shape": [8, 8], "dtype": "torch.float32", "numel": 64, "requires_grad": True} for n in names]
    writer.write("manifest", bare_manifest("recorded", params, "Tiny") | {"config": {"max_steps": steps}})
    for s in range(1, steps + 1):
        broken = nan_step is not None and s >= nan_step
        norms = [math.nan if broken else 1.0 + 0.01 * ((s * (i + 3)) % 7) for i in range(4)]
        writer.write("batches", bare_batch(0, s))
        writer.write(
            "steps",
            {
                "seg": 0,
                "step": s,
                "time": float(s),
                "dt": 0.1,
                "loss": math.nan if broken else 2.0 - s / (2 * steps) + 0.01 * (s % 3),
                "lr": 1e-4,
                "grad_norm": math.sqrt(sum(n * n for n in norms)),
                "grad_norms": norms,
                "nonfinite_grads": {names[0]: 64} if broken else {},
                "micro_batches": 1,
                "tokens": 14,
            },
        )
    writer.close()
    return run
