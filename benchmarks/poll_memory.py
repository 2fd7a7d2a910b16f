"""What a watch holds in memory over many polls of a long run, with glibc's default allocator settings and with
the watch's own (`sftaudit.commands.watch.steady_heap`), beside what a new process that audits the same run once
holds (as `sftaudit audit` does after the run grew), and which part of a poll holds it.

    .venv/bin/python benchmarks/poll_memory.py [--steps 100000[,400000]] [--polls 60] [--new 600]

For each history length N: three copies of a run of N steps (16 tensors, the shim's own writer:
`sftaudit.fixtures.live_run`, not closed) are written and judged once, as a watch's first poll judges it. Then
two fresh processes, each holding what a watch holds (sftaudit's imports, nothing more), one with glibc's defaults
and one set up as the watch sets itself up, poll their copy `--polls` times through the watch's own entry point
(`audited`, judged again when the database changed), each poll after `--new` more steps were written to all three
copies; the third copy is polled each time by a new process that polls once and exits (its audit carried over
from the one before on disk, as a watch's is, nothing in memory). The three alternate. Before each poll the
kernel's high-water mark is reset (``/proc/self/clear_refs``), so each poll's peak resident memory is its own.
Prints, per N and process, the RSS before the polls, the first, median and last poll's peak, the RSS left after
the first and the last poll and its slope over the polls (what a watch holds more after each poll: the run's
growth, and what the allocator keeps); for the last poll, each phase's peak above the RSS when it began (ingest,
each check of the per-step log, the evidence coverage, the series store) and what it left held; with two sizes,
the first poll's growth per step of history between them.

Peak RSS counts what the allocators (numpy's, DuckDB's, polars', Arrow's) hold, not only live objects: the
figure a machine's memory limit sees.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

PROCESSES = {
    "default": "one process, glibc's defaults",
    "steady": "one process, the watch's (steady_heap)",
    "audit": "a new process each poll (`sftaudit audit`)",
}
WATCHES = ("default", "steady")  # the processes that poll many times
# The checks whose phases are listed (beside ingest, the evidence coverage and the series store): those that read
# the per-step log whole, and LOOP-05 and LOOP-15 that read the gradient norms.
PHASES = ("LOOP-03", "LOOP-05", "LOOP-10", "LOOP-13", "LOOP-15", "LOOP-19", "LOOP-21", "LOOP-27")


def _poll_process(run: Path, polls: int, heap: str) -> None:
    """The watch's stand-in (`--child`): polls `run` each time the parent writes a line, one JSON line back each;
    `heap` "steady": glibc's allocator set up as the watch sets it."""
    import contextlib
    import time

    from sftaudit.checks import registered_checks
    from sftaudit.commands.watch import steady_heap
    from sftaudit.verdict import audit as pipeline
    from sftaudit.verdict.config import AuditConfig

    phases: list[tuple[str, int, int, int]] = []  # (phase, RSS MB when it began, its peak MB, RSS MB after)

    @contextlib.contextmanager
    def phase(name):
        before = _memory()["VmRSS"]
        _reset_peak()
        try:
            yield
        finally:
            now = _memory()
            phases.append((name, before, now["VmHWM"], now["VmRSS"]))

    def measured(name, fn):
        def run_phase(*args, **kwargs):
            with phase(name):
                return fn(*args, **kwargs)

        return run_phase

    for check in registered_checks():
        if check.code in PHASES:
            check.run = measured(check.code, check.run)
    pipeline.evidence_coverage = measured("evidence coverage", pipeline.evidence_coverage)
    pipeline._store_series = measured("series store", pipeline._store_series)
    ingested = pipeline.ingested

    @contextlib.contextmanager
    def measured_ingest(*args, **kwargs):
        """Ingest's phase ends when the database is ready to judge on, not when the audit closes it."""
        with contextlib.ExitStack() as opened:
            with phase("ingest"):
                connection = opened.enter_context(ingested(*args, **kwargs))
            yield connection

    pipeline.ingested = measured_ingest
    if heap == "steady" and not steady_heap():
        raise SystemExit("glibc's allocator could not be set up (not glibc?)")
    config = AuditConfig()
    print(json.dumps({"ready": _memory()["VmRSS"]}), flush=True)
    for _ in range(polls):
        sys.stdin.readline()
        phases.clear()
        before = _memory()["VmRSS"]
        _reset_peak()
        started = time.process_time()
        with pipeline.audited(run, config, judge="if_stale") as done:
            assert done.verdict is not None
        now = _memory()
        poll = {"before": before, "peak": now["VmHWM"], "after": now["VmRSS"], "cpu": time.process_time() - started}
        print(json.dumps({**poll, "phases": phases}), flush=True)


def _memory() -> dict[str, int]:
    """VmRSS and VmHWM (the peak since the last reset), MB."""
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) // 1024 for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")}


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(folder: Path, steps: int, args) -> dict:
    """Three copies of an N-step run: one polled by a process with glibc's default allocator settings, one by a
    process with the watch's (`steady_heap`), one by a new process at each poll; the polls alternated, each poll
    of any of them after the same new steps."""
    from sftaudit.fixtures.live_run import write_live_run

    from sftaudit.verdict.audit import audit

    def poller(kind: str, polls: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", str(runs[kind]), "--polls", str(polls)]
            + ["--heap", "default" if kind == "audit" else kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def poll(child: subprocess.Popen) -> dict:
        child.stdin.write("poll\n")
        child.stdin.flush()
        return json.loads(child.stdout.readline())

    def ended(child: subprocess.Popen, kind: str) -> None:
        child.stdin.close()
        if child.wait() != 0:
            raise SystemExit(f"the polling process ({kind}) failed at {steps:,} steps")

    runs, watches = {}, {}
    for kind in PROCESSES:
        runs[kind] = folder / f"run-{steps}-{kind}"
        write_live_run(runs[kind], steps, close=False)
        audit(runs[kind])  # the watch's first poll: the history judged whole
    watches = {kind: poller(kind, args.polls) for kind in WATCHES}
    ready = {kind: json.loads(child.stdout.readline())["ready"] for kind, child in watches.items()}
    polls: dict[str, list[dict]] = {kind: [] for kind in PROCESSES}
    written = steps
    for _ in range(args.polls):
        for kind in PROCESSES:
            write_live_run(runs[kind], args.new, first_step=written + 1, header=False, close=False, seed=written)
            if kind in watches:
                polls[kind].append(poll(watches[kind]))
                continue
            once = poller(kind, 1)
            ready.setdefault(kind, json.loads(once.stdout.readline())["ready"])
            polls[kind].append(poll(once))
            ended(once, kind)
        written += args.new
    for kind, child in watches.items():
        ended(child, kind)
    return {"steps": steps, "ready": ready, "polls": polls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="100000", help="history lengths, comma-separated")
    parser.add_argument("--polls", type=int, default=60)
    parser.add_argument("--new", type=int, default=600, help="steps written before each poll (a minute at 10/s)")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--heap", choices=WATCHES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _poll_process(args.child, args.polls, args.heap)
        return
    sizes = [int(s) for s in args.steps.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["SFTAUDIT_CACHE_DIR"] = str(Path(tmp) / "cache")
        results = [measure(Path(tmp), n, args) for n in sizes]
    print(f"{args.polls} polls of a watch, {args.new:,} new steps before each (MB; peak: the kernel's high-water mark")
    print("of the poll; held more a poll: the slope of the RSS left after each poll, over the polls)")
    print(
        "| steps of history | process | RSS before the polls | peak: first / median / last poll | "
        "RSS after: first / last poll | held more a poll | CPU s a poll (median) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        for kind in PROCESSES:
            polls = r["polls"][kind]
            peaks, after = [p["peak"] for p in polls], [p["after"] for p in polls]
            slope = np.polyfit(np.arange(len(after)), after, 1)[0] if len(after) > 1 else float("nan")
            print(
                f"| {r['steps']:,} | {PROCESSES[kind]} | {r['ready'][kind]} | "
                f"{peaks[0]} / {statistics.median(peaks):g} / {peaks[-1]} | {after[0]} / {after[-1]} | "
                f"{slope:+.2f} | {statistics.median(p['cpu'] for p in polls):.2f} |"
            )
    for r in results:
        watch, once = (statistics.median(p["peak"] for p in r["polls"][kind]) for kind in ("steady", "audit"))
        print(
            f"\nat {r['steps']:,} steps the watch's median poll peaks at {watch:g} MB, a new process's audit of the "
            f"same run at {once:g} MB ({watch - once:+g} MB, {watch / once:.2f}x)"
        )
    print(
        "\nthe last poll's phases (the watch's allocator): peak above the RSS the phase began with / RSS it left (MB)"
    )
    print("| phase | " + " | ".join(f"{r['steps']:,} steps" for r in results) + " |")
    print("| --- |" + " --- |" * len(results))
    last = {r["steps"]: r["polls"]["steady"][-1]["phases"] for r in results}
    for name in dict.fromkeys(name for phases in last.values() for name, *_ in phases):
        cells = []
        for phases in last.values():
            row = next((p for p in phases if p[0] == name), None)
            cells.append("-" if row is None else f"+{row[2] - row[1]} / {row[3]}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if len(results) > 1:
        first, last_size = results[0], results[-1]
        grown = first_peak(last_size) - first_peak(first)
        per_step = grown * 2**20 / (last_size["steps"] - first["steps"])
        print(
            f"\nthe first poll's peak (the watch's allocator) grows {per_step:,.0f} bytes a step of history "
            f"({first['steps']:,} -> {last_size['steps']:,})"
        )


def first_peak(result: dict) -> int:
    return result["polls"]["steady"][0]["peak"]


if __name__ == "__main__":
    main()
