"""Import time of per-step logs as they grow, to show it stays linear (goal: time per logged entry flat within its
spread from 10^4 to 10^6 entries), for the shapes that could make it quadratic:

* ``state``: one trainer_state.json of N per-step entries, with 10 checkpoints' states of the same run beside it;
* ``two-runs``: the same, and a second run's 10 checkpoints in the folder (told apart, named, left out);
* ``backward``: LLaMA-Factory's trainer_log.jsonl whose step goes back at every 100th line (N/100 restarts);
* ``every-line``: a trainer_log.jsonl whose step goes back at every line (N writers).

    .venv/bin/python benchmarks/import_scale.py [--sizes 10000 100000 1000000] [--repeats 3] [--shapes ...]

Prints, per shape and size, the median seconds of `import_run` over the repeats with their range, microseconds per
entry, and the ratio of that per-entry time to the smallest size's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from sftaudit.imports import import_run

SHAPES = ("state", "two-runs", "backward", "every-line")


def _entry(step: int, run: int = 0) -> dict:
    return {
        "epoch": step / 1e6,
        "grad_norm": 1.0 + run,
        "learning_rate": 1e-4,
        "loss": 1.0 + 1.0 / step + run,
        "step": step,
    }


def _state(history: list[dict], max_steps: int) -> str:
    last = history[-1]["step"] if history else 0
    return json.dumps(
        {
            "global_step": last,
            "max_steps": max_steps,
            "logging_steps": 1,
            "save_steps": max(max_steps // 10, 1),
            "train_batch_size": 4,
            "log_history": history,
        }
    )


def write(shape: str, n: int, run_dir: Path) -> None:
    run_dir.mkdir(parents=True)
    if shape in ("state", "two-runs"):
        history = [_entry(s) for s in range(1, n + 1)]
        (run_dir / "trainer_state.json").write_text(_state(history, n))
        for k in range(1, 11):
            step = n * k // 10
            (run_dir / f"checkpoint-{step}").mkdir()
            (run_dir / f"checkpoint-{step}" / "trainer_state.json").write_text(_state(history[:step], n))
        if shape == "two-runs":
            other = [_entry(s, run=1) for s in range(1, n // 2 + 1)]
            for k in range(1, 11):
                step = n * k // 20 + 1  # off the first run's save grid
                (run_dir / f"checkpoint-{step}").mkdir()
                (run_dir / f"checkpoint-{step}" / "trainer_state.json").write_text(_state(other[:step], n // 2))
        return
    back = 100 if shape == "backward" else 1
    lines, step = [], 1
    for i in range(n):
        step = step - back // 2 if back > 1 and i % back == back - 1 else step + 1
        step = max(step, 1) if back > 1 else (n - i)  # every-line: the step goes back at each line
        lines.append(json.dumps({"current_steps": step, "total_steps": n, "loss": 1.0 + 1.0 / step, "lr": 1e-4}))
    (run_dir / "trainer_log.jsonl").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    args = parser.parse_args()
    print(f"{'shape':<11} {'entries':>9} {'median s':>9} {'range s':>15} {'us/entry':>9} {'ratio':>6}")
    for shape in args.shapes:
        base = None
        for n in args.sizes:
            times = []
            for _ in range(args.repeats):
                with tempfile.TemporaryDirectory(prefix="sftaudit-import-scale-") as tmp:
                    run_dir = Path(tmp) / "run"
                    write(shape, n, run_dir)
                    start = time.perf_counter()
                    import_run(run_dir)
                    times.append(time.perf_counter() - start)
            per = statistics.median(times) / n * 1e6
            base = base or per
            print(
                f"{shape:<11} {n:>9,} {statistics.median(times):>9.2f} {min(times):>7.2f}-{max(times):<7.2f} "
                f"{per:>9.2f} {per / base:>6.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
