"""What thousands of empty gradient-norm parts cost an audit: a hostile (or merely odd) run folder may hold them.

Writes a small synthetic run twice, the second with N valid but empty Parquet parts beside its real ones, and
times, interleaved, a first audit of each (every part validated) and re-audits (the parts read back from the
database; an empty part is never listed for a query). Prints each arm's median and the ratio's median with its
bootstrap interval over the repetitions.

    .venv/bin/python benchmarks/empty_parts.py [--parts 10000] [--reps 5]

Before the run database listed parts once, resolved their folder once and left empty ones out of its views,
`sftaudit audit` of a 30-step recorded run with 10,000 empty parts took 4 min 17 s on the shared 2-core box; it
now takes 12 s (8 s again), the run without them 7-10 s. This benchmark on that box: first audit x2.45 (95%
interval 1.94-5.76), re-audit x1.64 (1.60-1.67), 2,000 steps x 50 tensors, 3 repetitions.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab_stats import median_ci  # noqa: E402  (benchmarks/ab_stats.py)
from synthetic_run import write_synthetic_run  # noqa: E402  (benchmarks/synthetic_run.py)

from sftaudit.core.artifacts import series_dir  # noqa: E402
from sftaudit.store.rundb import CACHE_ENV, remove_database  # noqa: E402
from sftaudit.verdict.audit import audit  # noqa: E402


def with_empty_parts(run: Path, parts: int) -> None:
    empty = pa.table(
        {"step": pa.array([], pa.int64()), "idx": pa.array([], pa.int32()), "norm": pa.array([], pa.float32())}
    )
    first = series_dir(run, 0, 0) / "part-900000000.parquet"
    pq.write_table(empty, first)
    for i in range(1, parts):
        shutil.copy(first, first.with_name(f"part-{900000000 + i:09d}.parquet"))


def timed(run: Path, fresh: bool) -> float:
    if fresh:
        remove_database(run)
    t0 = time.perf_counter()
    audit(run)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[CACHE_ENV] = str(Path(tmp) / "cache")
        plain, padded = Path(tmp) / "plain", Path(tmp) / "padded"
        for run in (plain, padded):
            write_synthetic_run(run, steps=args.steps, tensors=50, seed=0)
        with_empty_parts(padded, args.parts)
        times = {(arm, fresh): [] for arm in ("plain", "padded") for fresh in (True, False)}
        for _ in range(args.reps):
            for fresh in (True, False):
                for arm, run in (("plain", plain), ("padded", padded)):
                    times[arm, fresh].append(timed(run, fresh))
    print(f"{args.steps} steps x 50 tensors; {args.parts} empty parts beside the real ones; {args.reps} repetitions")
    for fresh, what in ((True, "first audit (parts validated)"), (False, "re-audit")):
        a, b = np.array(times["plain", fresh]), np.array(times["padded", fresh])
        ratio, low, high = median_ci(b / a)
        print(
            f"{what}: {np.median(a):.2f} s without, {np.median(b):.2f} s with them: "
            f"x{ratio:.2f} (95% interval {low:.2f}-{high:.2f})"
        )


if __name__ == "__main__":
    main()
