"""How far `sftaudit watch` lags a run that logs 10 steps a second: the time from a step's write to the watch
printing the finding it plants.

    .venv/bin/python benchmarks/watch_lag.py [--reps 5] [--rate 10] [--interval 0.5] [--history 0]

Each repetition starts `sftaudit watch RUN --exit-on fail` (a process of its own, as a user runs it) before its
run exists, then a writer process (`python -m sftaudit.fixtures.live_run`: the shim's own writer, step by step
at `--rate` steps a second, after `--history` steps written at once) that plants a non-finite loss a few seconds
into the live steps (later in each repetition: 2, 4, 6 ... s), and times the write of that step (the writer's
clock) to the watch's line for it (the same machine's clock). Prints the lag per repetition, its median and
spread, and the watch's CPU time per second of watching (what following a run costs the machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def one(run: Path, nan_at: int, args) -> tuple[float, float, float]:
    """(lag in s, watch's CPU s, watch's wall s) of one repetition."""
    printed: dict[str, float] = {}
    watch = subprocess.Popen(
        [sys.executable, "-m", "sftaudit.cli", "watch", str(run), "--interval", str(args.interval)]
        + ["--exit-on", "fail", "--idle-timeout", "120"],
        stdout=subprocess.PIPE,
        text=True,
    )
    started = time.time()

    def read() -> None:
        for line in watch.stdout:
            if line.startswith("LOOP-05 fail") and "fail" not in printed:
                printed["fail"] = time.time()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    writer = subprocess.Popen(
        [sys.executable, "-m", "sftaudit.fixtures.live_run", str(run), "--steps", str(nan_at + 600)]
        + ["--rate", str(args.rate), "--nan-at", str(nan_at), "--history", str(args.history)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        _, status, usage = os.wait4(watch.pid, 0)
        watch.returncode = os.waitstatus_to_exitcode(status)
        wall = time.time() - started
    finally:
        writer.kill()
        written = writer.communicate()[0]
        reader.join(5)
    at = {int(s): float(t) for s, t in (line.split() for line in written.splitlines())}
    if watch.returncode != 1 or "fail" not in printed or nan_at not in at:
        raise SystemExit(f"the watch did not report the planted fail (exit {watch.returncode})")
    return printed["fail"] - at[nan_at], usage.ru_utime + usage.ru_stime, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rate", type=float, default=10.0, help="steps a second")
    parser.add_argument("--interval", type=float, default=0.5, help="the watch's --interval")
    parser.add_argument("--history", type=int, default=0, help="steps written at once before the live ones")
    args = parser.parse_args()
    lags, cpu, wall = [], 0.0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("SFTAUDIT_CACHE_DIR", str(Path(tmp) / "cache"))
        for rep in range(args.reps):
            nan_at = args.history + int(args.rate * 2 * (rep + 1))
            lag, c, w = one(Path(tmp) / f"run-{rep}", nan_at, args)
            lags.append(lag)
            cpu, wall = cpu + c, wall + w
            print(
                f"rep {rep + 1}: fail planted at step {nan_at:,} ({2 * (rep + 1)} s in): printed {lag:.2f} s after its write"
            )
    print(
        f"watch at {args.rate:g} steps/s (--interval {args.interval:g}, {args.history:,} steps of history): lag median "
        f"{statistics.median(lags):.2f} s, min {min(lags):.2f}, max {max(lags):.2f} over {len(lags)} runs; "
        f"the watch used {cpu / wall:.2f} CPU s per second watched (start-up included)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
