"""How far `sftaudit watch` lags a run that logs 10 steps a second: the time from a step's write to the watch
printing the finding it plants.

    .venv/bin/python benchmarks/watch_lag.py [--reps 5] [--rate 10] [--interval 0.5] [--history 0] [--after 0]

Each repetition starts `sftaudit watch RUN --exit-on fail` (a process of its own, as a user runs it) before its
run exists, then a writer process (`python -m sftaudit.fixtures.live_run`: the shim's own writer, step by step
at `--rate` steps a second, after `--history` steps written at once) that plants a non-finite loss a few seconds
into the live steps (`--after` seconds, then later in each repetition: 2, 4, 6 ... s), and times the write of
that step (the writer's clock) to the watch's line for it (the same machine's clock). Prints the lag per repetition, its median and
spread, and the watch's CPU time per second of watching (what following a run costs the machine).

With ``--soak SECONDS``, one long clean run instead: the writer records `--rate` steps a second for SECONDS (a
high rate stands in for a longer run: 200 steps a second for 600 s is 120,000 steps, a day and a half of a run
that logs a step a second), and the watch is sampled every second from /proc: its resident memory and its CPU
time. Prints, per tenth of the soak, the steps written by then, the watch's RSS and its peak so far (the
kernel's high-water mark: a poll's peak, which a once-a-second sample can miss) and the CPU seconds it used per
second in that tenth (flat: bounded over a long run; growing: each poll costs more as the run grows), then the
time from the run's close record to the watch's exit.

    .venv/bin/python benchmarks/watch_lag.py --soak 600 --rate 200 --interval 2 [--keep DIR]

``--keep DIR`` keeps the soak's run and cache in DIR (to profile a late poll: ``SFTAUDIT_CACHE_DIR=DIR/cache
sftaudit audit DIR/run --no-report``).
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
    # The writer's step times go to a file, not a pipe: a pipe read only at the end fills with a long history's
    # lines and stalls the writer, and the watch then sees a run that stopped.
    times = run.parent / f"{run.name}-written.txt"
    with times.open("w") as out:
        writer = subprocess.Popen(
            [sys.executable, "-m", "sftaudit.fixtures.live_run", str(run), "--steps", str(nan_at + 600)]
            + ["--rate", str(args.rate), "--nan-at", str(nan_at), "--history", str(args.history)],
            stdout=out,
        )
    try:
        _, status, usage = os.wait4(watch.pid, 0)
        watch.returncode = os.waitstatus_to_exitcode(status)
        wall = time.time() - started
    finally:
        writer.kill()
        writer.wait()
        reader.join(5)
    # The writer is killed once the watch has exited: its last line may be cut short.
    at = {int(f[0]): float(f[1]) for f in (line.split() for line in times.read_text().splitlines()) if len(f) == 2}
    if watch.returncode != 1 or "fail" not in printed or nan_at not in at:
        raise SystemExit(f"the watch did not report the planted fail (exit {watch.returncode})")
    return printed["fail"] - at[nan_at], usage.ru_utime + usage.ru_stime, wall


def _proc_sample(pid: int) -> tuple[float, float, float] | None:
    """(resident MB, its peak so far in MB, user + system CPU s) of a live process, from /proc; None once it has
    gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    kb = {
        line.split(":")[0]: int(line.split()[1]) for line in status.splitlines() if line.startswith(("VmRSS", "VmHWM"))
    }
    ticks = os.sysconf("SC_CLK_TCK")
    return kb["VmRSS"] / 1024, kb["VmHWM"] / 1024, (int(stat[11]) + int(stat[12])) / ticks  # utime, stime: 14, 15


def soak(run: Path, args) -> None:
    """One long clean run followed by the watch, its memory and CPU sampled every second (`--soak`)."""
    steps = int(args.rate * args.soak)
    watch = subprocess.Popen(
        [sys.executable, "-m", "sftaudit.cli", "watch", str(run), "--interval", str(args.interval)]
        + ["--exit-on", "fail", "--idle-timeout", "120"],
        stdout=subprocess.DEVNULL,
    )
    writer = subprocess.Popen(
        [sys.executable, "-m", "sftaudit.fixtures.live_run", str(run), "--steps", str(steps), "--rate", str(args.rate)],
        stdout=subprocess.PIPE,
        text=True,
    )
    samples: list[tuple[float, int, float, float, float]] = []  # (seconds in, steps, RSS MB, peak MB, CPU s)
    written = 0
    started = time.time()

    def count_steps() -> None:
        nonlocal written
        for _ in writer.stdout:
            written += 1

    counter = threading.Thread(target=count_steps, daemon=True)
    counter.start()
    closed_at = None
    while watch.poll() is None:
        sample = _proc_sample(watch.pid)
        if sample is not None:
            samples.append((time.time() - started, written, *sample))
        if closed_at is None and writer.poll() is not None:
            closed_at = time.time()
        time.sleep(1.0)
    closed_at = closed_at or time.time()
    counter.join(5)
    if watch.returncode != 0 or not samples:
        raise SystemExit(f"the watch did not end clean at the run's close (exit {watch.returncode})")
    print(f"soak: {written:,} steps at {args.rate:g} steps/s, watch --interval {args.interval:g}")
    print("| share of the soak | steps written | watch RSS MB | watch peak RSS MB so far | watch CPU s per s |")
    print("| --- | --- | --- | --- | --- |")
    tenth = max(1, len(samples) // 10)
    for i in range(0, len(samples) - tenth + 1, tenth):
        first, last = samples[i], samples[min(i + tenth, len(samples) - 1)]
        cpu_rate = (last[4] - first[4]) / max(last[0] - first[0], 1e-9)
        print(f"| {last[0] / samples[-1][0]:.0%} | {last[1]:,} | {last[2]:.0f} | {last[3]:.0f} | {cpu_rate:.2f} |")
    print(f"the watch exited {time.time() - closed_at:.1f} s after the writer closed the run (exit 0, clean)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rate", type=float, default=10.0, help="steps a second")
    parser.add_argument("--interval", type=float, default=0.5, help="the watch's --interval")
    parser.add_argument("--history", type=int, default=0, help="steps written at once before the live ones")
    parser.add_argument(
        "--after",
        type=float,
        default=0.0,
        help="seconds of live steps before the planted ones (the watch's CPU budget spent on a long history by then)",
    )
    parser.add_argument("--soak", type=float, help="seconds of one long clean run, the watch's memory and CPU sampled")
    parser.add_argument("--keep", type=Path, help="with --soak: the run and its cache kept in this new folder")
    args = parser.parse_args()
    if args.soak:
        with tempfile.TemporaryDirectory() as tmp:
            folder = args.keep or Path(tmp)
            folder.mkdir(parents=True, exist_ok=True)
            os.environ.setdefault("SFTAUDIT_CACHE_DIR", str(folder / "cache"))
            soak(folder / "run", args)
        return 0
    lags, cpu, wall = [], 0.0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("SFTAUDIT_CACHE_DIR", str(Path(tmp) / "cache"))
        for rep in range(args.reps):
            nan_at = args.history + int(args.rate * (args.after + 2 * (rep + 1)))
            lag, c, w = one(Path(tmp) / f"run-{rep}", nan_at, args)
            lags.append(lag)
            cpu, wall = cpu + c, wall + w
            print(
                f"rep {rep + 1}: fail planted at step {nan_at:,} ({args.after + 2 * (rep + 1):g} s in): printed "
                f"{lag:.2f} s after its write"
            )
    print(
        f"watch at {args.rate:g} steps/s (--interval {args.interval:g}, {args.history:,} steps of history): lag median "
        f"{statistics.median(lags):.2f} s, min {min(lags):.2f}, max {max(lags):.2f} over {len(lags)} runs; "
        f"the watch used {cpu / wall:.2f} CPU s per second watched (start-up included)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
