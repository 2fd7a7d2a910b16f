"""Import time of per-step logs as they grow, to show it stays linear (goal: time per logged entry flat within its
spread from 10^4 to 10^6 entries), for the shapes that could make it quadratic:

* ``state``: one trainer_state.json of N per-step entries, with 10 checkpoints' states of the same run beside it;
* ``two-runs``: the same, and a second run's 10 checkpoints in the folder (told apart, named, left out);
* ``backward``: LLaMA-Factory's trainer_log.jsonl whose step goes back at every 100th line (N/100 restarts);
* ``every-line``: a trainer_log.jsonl whose step goes back at every line (N writers).

    .venv/bin/python benchmarks/import_scale.py [--sizes 10000 100000 1000000] [--repeats 3] [--shapes ...]

Prints, per shape and size, the median seconds of `import_run` over the repeats with their range, microseconds per
entry, and the ratio of that per-entry time to the smallest size's.

With ``--cli``, the ``trl`` shapes instead, as users meet them: a TRL SFT run's trainer_state.json of N per-step
entries (eight keys each, written as the Trainer writes it: indented, keys sorted), alone (``trl``) or with three
checkpoints' states beside it (``trl-3ckpt``: at N/3, 2N/3 and N); each timed as `sftaudit import` and as
`sftaudit audit --no-report` (which imports, ingests and judges), each in its own process and with a cache of its
own (nothing imported or ingested before), then as a ``re-audit``: the audit again with the log unchanged (the
import skipped, nothing new to ingest); its CPU seconds (user + system), wall seconds and peak resident memory (the
child's own, from wait4), median over the repeats.

    .venv/bin/python benchmarks/import_scale.py --cli [--sizes 1000000] [--repeats 1]

With ``--cli --phases``, each audit is also split into its stages, in one process: the import (`ensure_artifacts`),
the ingest into the run database and the judging (the checks and the verdict), CPU seconds each, so the share of
each in the total is seen.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sftaudit.imports import import_run

SHAPES = ("state", "two-runs", "backward", "every-line")
CLI_SHAPES = ("trl", "trl-3ckpt")
REPO = Path(__file__).resolve().parents[1]


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


def trl_history(n: int) -> list[dict]:
    """The log of a TRL SFT run of `n` steps, logged at each: its eight keys, as TRL names them."""
    return [
        {
            "entropy": 1.2 + (s % 13) * 1e-3,
            "epoch": 3 * s / n,
            "grad_norm": 0.8 + (s % 7) * 0.01,
            "learning_rate": 2e-5 * (1 - s / n),
            "loss": 2.0 / (1 + s / n) + (s % 5) * 1e-3,
            "mean_token_accuracy": 0.6 + (s % 11) * 1e-3,
            "num_tokens": 4096.0 * s,
            "step": s,
        }
        for s in range(1, n + 1)
    ]


def write_trl(shape: str, n: int, run_dir: Path) -> int:
    """A TRL SFT run's output_dir as the Trainer saves it; returns the bytes of its trainer_state.json."""
    run_dir.mkdir(parents=True)
    history = trl_history(n)

    def save(folder: Path, upto: int) -> int:
        state = {
            "best_global_step": None,
            "best_metric": None,
            "best_model_checkpoint": None,
            "epoch": 3 * upto / n,
            "eval_steps": 500,
            "global_step": upto,
            "is_hyper_param_search": False,
            "is_local_process_zero": True,
            "is_world_process_zero": True,
            "log_history": history[:upto],
            "logging_steps": 1,
            "max_steps": n,
            "num_input_tokens_seen": 0,
            "num_train_epochs": 3,
            "save_steps": max(n // 3, 1),
            "total_flos": 1.0,
            "train_batch_size": 8,
            "trial_name": None,
            "trial_params": None,
        }
        folder.mkdir(parents=True, exist_ok=True)
        text = json.dumps(state, indent=2, sort_keys=True) + "\n"
        (folder / "trainer_state.json").write_text(text)
        return len(text)

    size = save(run_dir, n)
    if shape == "trl-3ckpt":
        for k in (1, 2, 3):
            save(run_dir / f"checkpoint-{n * k // 3}", n * k // 3)
    return size


def written_apart(shape: str, n: int, run_dir: Path) -> int:
    """`write_trl` in a process of its own: a child started from this one would count the memory the state's
    writing took here in its own peak (Linux keeps the high-water mark of the memory an exec replaces)."""
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from import_scale import write_trl; "
    code += f"print(write_trl({shape!r}, {n}, __import__('pathlib').Path({str(run_dir)!r})))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


def measured(args: list[str], cache: Path | None = None) -> tuple[float, float, float, int]:
    """A `sftaudit` command in its own process (`cache`: sftaudit's cache folder for it): (CPU seconds, wall
    seconds, peak resident MB, exit code)."""
    env = {**os.environ, "SFTAUDIT_CACHE_DIR": str(cache)} if cache else None
    start = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-m", "sftaudit.cli", *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    return usage.ru_utime + usage.ru_stime, wall, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status)


# The stages of an audit timed one after the other in a child process (CPU seconds of each, the peak memory).
PHASES = """
import json, resource, sys, time
from pathlib import Path
from sftaudit.imports import ensure_artifacts
from sftaudit.store.ingest import ingest
from sftaudit.store.rundb import connect
from sftaudit.verdict.audit import judge_database
from sftaudit.verdict.config import AuditConfig
run, out = Path(sys.argv[1]), {}
for name, stage in [("import", lambda: ensure_artifacts(run)), ("ingest", lambda: ingest(run)),
                    ("judge", lambda: judge_database(connect(run), run, AuditConfig()))]:
    start = time.process_time()
    stage()
    out[name] = time.process_time() - start
out["peak MB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


def phases(shape: str, n: int, run_dir: Path) -> dict[str, float]:
    """The stages of a first audit of a fresh run of `shape` (its database not made yet)."""
    written_apart(shape, n, run_dir)
    done = subprocess.run(
        [sys.executable, "-c", PHASES, str(run_dir)], cwd=REPO, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def cli(sizes: list[int], repeats: int, split: bool = False) -> None:
    print(
        f"{'shape':<10} {'entries':>9} {'state MB':>9} {'command':<8} {'CPU s':>7} {'wall s':>7} {'peak MB':>8} {'exit':>4}"
    )
    for shape in CLI_SHAPES:
        for n in sizes:
            with tempfile.TemporaryDirectory(prefix="sftaudit-import-scale-") as tmp:
                run_dir = Path(tmp) / "run"
                size = written_apart(shape, n, run_dir)
                for command in ("import", "audit", "re-audit"):
                    runs = []
                    for k in range(repeats):
                        # each import and first audit with a cache of its own (nothing imported or ingested
                        # before); the re-audit with the last audit's, the log unchanged since
                        cache = Path(tmp) / f"cache-{command if command != 're-audit' else 'audit'}-{k}"
                        name = "audit" if command == "re-audit" else command
                        extra = ["--no-report", "--out", str(Path(tmp) / "out")] if name == "audit" else []
                        runs.append(measured([name, str(run_dir), *extra], cache))
                    cpu, wall, peak = (statistics.median(r[i] for r in runs) for i in range(3))
                    print(
                        f"{shape:<10} {n:>9,} {size / 2**20:>9.0f} {command:<8} {cpu:>7.2f} {wall:>7.2f} {peak:>8.0f} "
                        f"{runs[-1][3]:>4}",
                        flush=True,
                    )
                if split:
                    stages = phases(shape, n, Path(tmp) / "staged")
                    print(
                        f"{shape:<10} {n:>9,} stages: "
                        + ", ".join(f"{k} {v:.2f} s" for k, v in stages.items() if k != "peak MB")
                        + f" (CPU); peak {stages['peak MB']:.0f} MB",
                        flush=True,
                    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--cli", action="store_true", help="time `sftaudit import` and `audit` on TRL-shaped states")
    parser.add_argument(
        "--phases", action="store_true", help="with --cli: the audit's import, ingest and judging apart"
    )
    args = parser.parse_args()
    if args.cli:
        cli(args.sizes, args.repeats, args.phases)
        return 0
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
