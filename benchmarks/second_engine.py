"""One statistic, three engines: LOOP-05's per-tensor spike statistic over a run's Parquet gradient-norm
series by DuckDB, Polars' lazy scan and Apache Spark (local mode), with the time of each and whether
they agree (integers exactly, z within 1e-9 relative).

    .venv/bin/python benchmarks/second_engine.py [--steps 100000] [--tensors 100] [--ranks 2]
    .venv/bin/python benchmarks/second_engine.py --run RUN_DIR      # a recorded run's series

Without --run it writes a test run (tests/series_data.py: pyarrow parts in the shim's layout) with rank 0
resumed from an earlier checkpoint (500 abandoned steps) and one planted spike, which every engine must
find at its step and tensor. Spark needs `pip install pyspark` and a Java runtime (17+); without pyspark
that part is skipped with a message. Spark runs the same SQL text as DuckDB (sftaudit/checks/engines.py).
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sftaudit.checks import engines  # noqa: E402
from tests.series_data import noisy_norms, write_manifest, write_parts  # noqa: E402


def build(run: Path, steps: int, tensors: int, ranks: int) -> tuple[int, int, int]:
    """The test run; returns the planted spike (rank, idx, step)."""
    rng = np.random.default_rng(0)
    names = [
        f"model.layers.{i // 7}.{['q', 'k', 'v', 'o', 'gate', 'up', 'down'][i % 7]}_proj.weight" for i in range(tensors)
    ]
    spike = (ranks - 1, tensors * 3 // 8, steps * 61 // 100 + 7)
    resume = steps * 6 // 10  # rank 0: segment 0 ran 500 steps past its last checkpoint at `resume`
    for rank in range(ranks):
        segments = [(0, 0, resume + 500), (1, resume, steps)] if rank == 0 else [(0, 0, steps)]
        for seg, first, stop in segments:
            write_manifest(run, rank, seg, names)
            norms = noisy_norms(rng, stop - first, tensors)
            if rank == spike[0] and first <= spike[2] < stop:
                norms[spike[2] - first, spike[1]] *= 50
            write_parts(run, rank, seg, first, norms, steps_per_part=10_000)
    return spike


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def spark_session(master: str):
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        return None
    warnings.filterwarnings("ignore", module="pyspark")
    spark = (
        SparkSession.builder.master(master)
        .appName("sftaudit-second-engine")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "3g")
        .config("spark.sql.shuffle.partitions", "8")  # the default 200 is for clusters
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, help="a run folder with sftaudit/series/grad_norms/ (default: write one)")
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--spark-master", default="local[2]")
    parser.add_argument(
        "--engines",
        default="duckdb,polars,spark",
        help="comma-separated; DuckDB always runs (the others are compared with it)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run, spike = args.run, None
        if run is None:
            run = Path(tmp) / "run"
            t0 = time.perf_counter()
            spike = build(run, args.steps, args.tensors, args.ranks)
            print(
                f"wrote {args.steps:,} steps x {args.tensors} tensors x {args.ranks} ranks in "
                f"{time.perf_counter() - t0:.1f} s"
            )
        parts = engines.series_files(run)
        size = sum(Path(p).stat().st_size for p in parts)
        values = pl.scan_parquet(parts).select(pl.len()).collect().item()
        print(f"series: {len(parts)} parts, {values:,} values, {size / 1e6:.1f} MB ({size / values:.2f} bytes/value)")

        results, times = {}, {}
        t0 = time.perf_counter()
        results["duckdb"] = engines.duckdb_statistic(run)
        times["duckdb"] = time.perf_counter() - t0
        print(f"duckdb: {times['duckdb']:.1f} s (peak RSS of this process so far {peak_rss_gb():.1f} GB)")
        wanted = args.engines.split(",")
        if "polars" in wanted:
            t0 = time.perf_counter()
            results["polars"] = engines.polars_statistic(run)
            times["polars"] = time.perf_counter() - t0
            print(f"polars: {times['polars']:.1f} s (peak RSS of this process so far {peak_rss_gb():.1f} GB)")
        t0 = time.perf_counter()
        spark = spark_session(args.spark_master) if "spark" in wanted else None
        if spark is None:
            print(
                "spark: skipped ("
                + ("not in --engines" if "spark" not in wanted else "pyspark is not installed: pip install pyspark")
                + ")"
            )
        else:
            started = time.perf_counter() - t0
            t0 = time.perf_counter()
            results["spark"] = engines.spark_statistic(str(engines.series_root(run)), spark)
            times["spark"] = time.perf_counter() - t0
            print(
                f"spark {spark.version} {args.spark_master}: {times['spark']:.1f} s "
                f"(+ {started:.1f} s to start the session; JVM memory not in the RSS above)"
            )
            spark.stop()

        ok = True
        for name, frame in results.items():
            if name == "duckdb":
                continue
            problems = engines.disagreement(results["duckdb"], frame)
            ok &= not problems
            print(
                f"duckdb vs {name}: "
                + (
                    "equal (integers exactly, max_z within 1e-9 relative; largest relative "
                    f"difference {max_relative(results['duckdb'], frame):.1e})"
                    if not problems
                    else "DIFFER: " + "; ".join(problems)
                )
            )
        flagged = engines.with_names(results["duckdb"], run).filter(pl.col("flagged") > 0)
        print(f"flagged tensors: {flagged.height}")
        for row in flagged.head(10).iter_rows(named=True):
            print(
                f"  rank {row['rank']} {row['tensor']}: first flagged step {row['first_flagged_step']}, "
                f"max z {row['max_z']:.1f} at step {row['max_z_step']}"
            )
        if spike is not None:
            found = [(r["rank"], r["idx"], r["first_flagged_step"]) for r in flagged.iter_rows(named=True)]
            print(f"planted spike {spike}: {'found' if found == [spike] else 'MISSED'} (flagged: {found[:5]})")
            ok &= found == [spike]
        return 0 if ok else 1


def max_relative(a: pl.DataFrame, b: pl.DataFrame) -> float:
    x, y = a["max_z"].fill_null(np.nan).to_numpy(), b["max_z"].fill_null(np.nan).to_numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.abs(x - y) / np.maximum(np.abs(x), np.abs(y))
    return float(np.nanmax(rel, initial=0.0))


if __name__ == "__main__":
    sys.exit(main())
