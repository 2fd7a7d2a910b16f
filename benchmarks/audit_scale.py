"""Write, ingest and audit time of a synthetic run (goals on 2 cores: 100,000 steps x 1,000 tensors
in <= 30 s; 1,000,000 x 1,000, a billion norms, in <= 180 s and <= 4 GB).

    .venv/bin/python benchmarks/audit_scale.py [--steps 100000] [--tensors 1000] [--schema 2] [--keep DIR]

Writes a synthetic run (benchmarks/synthetic_run.py) with planted anomalies through the shim's own
writer (the per-tensor norms into the columnar series), then times `ingest` and the checks + verdict
separately, each check on its own (top 5 printed), and prints bytes per recorded value, the peak
RSS of this process and whether every planted anomaly is found at its step; then, `--reaudits` times,
appends 1,000 clean steps and times the re-ingest and the re-audit (median and spread; the slowest checks; with
`--profile`, the re-audits' calls that open the run database and ingest, sftaudit's calls by cumulative time and
every call by its own time). `--schema 1` writes
the older layout (the norms inside steps.jsonl, copied into DuckDB) for comparison. `--keep DIR --reuse` times only
more re-audits of a run an earlier `--keep DIR` wrote and audited (its database and carried state in the cache beside
it, DIR-cache, unless SFTAUDIT_CACHE_DIR says where): a 10^6-step run is written and first audited once.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from synthetic_run import append_steps, write_synthetic_run  # noqa: E402

from sftaudit.checks import registered_checks  # noqa: E402
from sftaudit.store.ingest import ingest  # noqa: E402
from sftaudit.store.rundb import CACHE_ENV, connect  # noqa: E402
from sftaudit.verdict.audit import audit  # noqa: E402


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


CHECK_CPU: dict[str, float] = {}  # each check's CPU seconds (all threads: the checks run one after another)


def _timed_checks() -> dict[str, float]:
    """Each check's `run` wrapped to add its wall time to the returned dict (code -> seconds), its CPU time to
    `CHECK_CPU`."""
    spent: dict[str, float] = {}
    for cls in registered_checks():

        def timed(self, ctx, _run=cls.run, _code=cls.code):
            t, c = time.perf_counter(), time.process_time()
            try:
                return _run(self, ctx)
            finally:
                spent[_code] = spent.get(_code, 0.0) + time.perf_counter() - t
                CHECK_CPU[_code] = CHECK_CPU.get(_code, 0.0) + time.process_time() - c

        cls.run = timed
    return spent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--tensors", type=int, default=1_000)
    parser.add_argument("--schema", type=int, default=2, choices=(1, 2))
    parser.add_argument("--reaudits", type=int, default=3, help="rounds of 1,000 more steps and a re-audit")
    parser.add_argument("--keep", type=Path, help="write the run here and keep it (default: a temporary folder)")
    parser.add_argument("--reuse", action="store_true", help="re-audit the run --keep names, written before")
    parser.add_argument("--show", nargs="*", default=["LOOP-15"], help="checks whose re-audit time is always printed")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile the re-audits (cProfile): the database opening and ingest, the slowest calls",
    )
    args = parser.parse_args()
    if args.reuse and not (args.keep and (args.keep / "sftaudit").is_dir()):
        parser.error("--reuse needs --keep DIR naming a run an earlier --keep wrote")
    with tempfile.TemporaryDirectory() as tmp:
        # The run's database and columnar copy (4 bytes a norm) go with the temporary folder unless a cache is set,
        # or beside a run kept.
        cache = args.keep.with_name(args.keep.name + "-cache") if args.keep else Path(tmp) / "cache"
        os.environ.setdefault(CACHE_ENV, str(cache))
        run = args.keep or Path(tmp) / "synthetic"
        if args.reuse:
            spent = _timed_checks()
            return _reaudits(args, run, audit(run), spent, None)
        t0 = time.perf_counter()
        planted = write_synthetic_run(run, steps=args.steps, tensors=args.tensors, schema_version=args.schema)
        t1, c1 = time.perf_counter(), time.process_time()
        rss_write = _peak_rss_mb()
        ingest(run)
        t2, c2 = time.perf_counter(), time.process_time()
        spent = _timed_checks()
        verdict = audit(run)  # ingest again is a no-op: nothing was appended
        t3, c3 = time.perf_counter(), time.process_time()
        values = args.steps * args.tensors
        files = [p for p in (run / "sftaudit").rglob("*") if p.is_file() and p.name != "audit.duckdb"]
        series = sum(p.stat().st_size for p in files if "series" in p.parts)
        jsonl = sum(p.stat().st_size for p in files if p.suffix == ".jsonl")
        print(
            f"run: {args.steps:,} steps x {args.tensors} tensors = {values:,} norms, schema {args.schema}; "
            f"written in {t1 - t0:.1f} s ({(t1 - t0) / args.steps * 1e6:.0f} us a step through the writer)"
        )
        print(
            f"on disk: series {series / 1e6:.0f} MB, JSONL {jsonl / 1e6:.0f} MB; "
            f"{(series + jsonl) / values:.2f} bytes per recorded value in all ({series / values:.2f} the series)"
        )
        print(f"ingest: {t2 - t1:.1f} s (CPU {c2 - c1:.1f} s, all threads)")
        print(
            f"audit (checks + verdict): {t3 - t2:.1f} s (CPU {c3 - c2:.1f} s), of which checks {sum(spent.values()):.1f} s"
        )
        for code, s in sorted(spent.items(), key=lambda kv: -kv[1])[:5]:
            print(f"  {code}: {s:.1f} s")
        print(
            f"total ingest + audit: {t3 - t1:.1f} s wall, {c3 - c1:.1f} s CPU (a loaded machine stretches the wall "
            f"time, the CPU time less so); peak RSS {_peak_rss_mb():,.0f} MB (writing: {rss_write:,.0f} MB)"
        )
        found = {(f["code"], f["severity"], f["step"]) for f in verdict["findings"]}
        expected = {
            "grad_scale": ("LOOP-05", "fail", planted["grad_scale"]["step"]),
            "periodic_spike": ("LOOP-05", "warn", planted["periodic_spike"]["start"]),
            "loss_spike": ("LOOP-10", "warn", planted["loss_spike"]["step"]),
            "lr_jump": ("LOOP-10", "warn", planted["lr_jump"]["step"]),
            "stale": ("LOOP-15", "fail", planted["stale"]["step"]),
        }
        for name, key in expected.items():
            print(f"planted {name}: {'found' if key in found else 'MISSED'} {key}")
        first = min(key[2] for key in expected.values())
        print(
            f"first anomalous step: {verdict['first_anomalous_step']} (earliest planted: {first}); "
            f"findings: {len(verdict['findings'])}"
        )
        for f in verdict["findings"]:
            print(f"  {f['code']} {f['severity']} step {f['step']}: {f['message'][:110]}")
        ok = all(key in found for key in expected.values()) and verdict["first_anomalous_step"] == first
        _reaudits(args, run, verdict, spent, (t3 - t2, c3 - c2, t2 - t1))
        return 0 if ok else 1


def _reaudits(args, run: Path, verdict: dict, spent: dict, first: tuple[float, float, float] | None) -> int:
    """`--reaudits` rounds of 1,000 more steps and a re-audit of `run`, last judged as `verdict` (`spent`: the
    checks' times, `_timed_checks`); `first`: the first audit's wall and CPU seconds and the first ingest's wall
    seconds, when this invocation took them."""
    found = {(f["code"], f["severity"], f["step"]) for f in verdict["findings"]}
    # The run goes on: 1,000 more steps at a time, each followed by a re-audit (the carried columnar copy:
    # only the ranges of steps still open are read and written again).
    reaudits, appended = [], []
    profile = cProfile.Profile() if args.profile else None
    con = connect(run, read_only=True)
    after = int(con.execute("SELECT max(step) FROM steps WHERE rank = 0").fetchone()[0])
    con.close()
    for _ in range(args.reaudits):
        t4 = time.perf_counter()
        append_steps(run, after, args.tensors, 1_000)
        after += 1_000
        t5 = time.perf_counter()
        ingest(run)
        t6, c6 = time.perf_counter(), time.process_time()
        spent.clear()
        CHECK_CPU.clear()
        again = profile.runcall(audit, run) if profile else audit(run)
        t7, c7 = time.perf_counter(), time.process_time()
        reaudits.append((t7 - t6, c7 - c6))
        appended.append((t5 - t4, t6 - t5))
        top = ", ".join(f"{code} {s:.1f} s" for code, s in sorted(spent.items(), key=lambda kv: -kv[1])[:3])
        top += "".join(
            f"; {code} {spent.get(code, 0):.2f} s (CPU {CHECK_CPU.get(code, 0):.2f} s)" for code in args.show
        )
        print(
            f"re-audit after 1,000 more steps (step {after:,}): {t7 - t6:.1f} s (CPU {c7 - c6:.1f} s); written in "
            f"{t5 - t4:.1f} s, ingested in {t6 - t5:.2f} s; slowest checks: {top}"
        )
    walls = sorted(w for w, _ in reaudits)
    print(
        f"incremental: re-audit median {statistics.median(walls):.1f} s wall (min {walls[0]:.1f}, max "
        f"{walls[-1]:.1f}; CPU median {statistics.median(c for _, c in reaudits):.1f} s) over {len(walls)} "
        f"re-audits"
        + (
            f", against {first[0]:.1f} s wall (CPU {first[1]:.1f} s) for the first audit"
            if first
            else " (of a run written and first audited before: --reuse)"
        )
        + f"; ingest of the new steps median {statistics.median(i for _, i in appended):.2f} s"
        + (f" (the first ingest took {first[2]:.1f} s)" if first else "")
    )
    if profile:  # per call over the re-audits (cProfile's wall clock; its overhead inflates the times)
        pstats.Stats(profile).sort_stats("cumulative").print_stats(r"store/(rundb|ingest)\.py", 12)
        # Where the rest goes: sftaudit's own calls by cumulative time, and every call by its own time.
        pstats.Stats(profile).sort_stats("cumulative").print_stats(r"sftaudit/", 45)
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    new = {(f["code"], f["severity"], f["step"]) for f in again["findings"]} - found
    print(f"findings the appended clean steps added: {sorted(new) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
