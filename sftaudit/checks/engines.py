"""LOOP-05's per-tensor spike statistic over the columnar gradient-norm series, by any engine.

The series lies under ``RUN_DIR/sftaudit/series/grad_norms/`` hive-partitioned by rank and segment
(``rank=<r>/seg=<s>/part-<first step>.parquet``; columns ``step`` INT64, ``idx`` INT32, the tensor's
index in that rank's manifest ``params``, and ``norm`` FLOAT32). Any engine that reads Parquet reads it
unchanged: the statistic is written once as SQL (`SPIKE_SQL`, which DuckDB and Spark SQL both run) and
once as Polars expressions (`polars_statistic`, an independent second implementation), so a run too
large for one box is audited on a cluster with the same numbers as on a laptop.

The statistic is LOOP-05's own-history spike rule (sftaudit/checks/loop05_gradient_norm.py with
sftaudit/checks/stats/rolling.py), per rank and tensor: y = ln(norm) of the finite positive norms; each
step's baseline is the median of y over the previous block of `window` steps (1/16 of the rank's steps,
8 to 128) and the median of the robust sigmas (1.4826 x MAD) of the previous 4 blocks; a block less
than half finite is no baseline. z = (y - median) / max(sigma, ln 1.2). A spike: z >= 6 and
norm >= 10x the median; flagged when also 3 standard deviations above the other tensors' log-ratios at
that step. A step a later segment ran again (a resume from an earlier checkpoint) counts once, from
the later segment, as ingest does. What the check adds and this leaves out: the warmup (read from the
learning rate, here `first_judged`), periodicity, the global norm.

Analyzer side: no torch; Polars and pyspark are imported only by the functions that use them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..core.artifacts import GRAD_SERIES as GRAD_NORMS
from ..core.artifacts import SERIES_DIR, artifact_root
from ..core.safe_io import read_bytes, regular_file
from ..errors import InputError
from .loop05_gradient_norm import LOG_SIGMA_FLOOR, SIGMA_BLOCKS, GradientNormAnomaly
from .stats.rolling import MAD_TO_SIGMA, WINDOW_MAX, WINDOW_MIN, WINDOW_SHARE

# LOOP-05's rule, taken from the check itself: the same window, blocks, floor and default thresholds.
SIGMA_OWN, MIN_RATIO, SIGMA_ACROSS = (
    GradientNormAnomaly.defaults[k] for k in ("sigma_own", "min_ratio", "sigma_across")
)

# One row per (rank, idx) in every engine, in this order and of these types.
COLUMNS = {
    "rank": "Int32",
    "idx": "Int32",
    "steps": "Int64",
    "nonfinite": "Int64",
    "max_z": "Float64",
    "max_z_step": "Int64",
    "spikes": "Int64",
    "flagged": "Int64",
    "first_flagged_step": "Int64",
}


def _double(x: float) -> str:
    # An exponent makes a literal DOUBLE in Spark SQL too (a plain 1.4826 there is a DECIMAL).
    return f"{x:.17e}"


# The statistic over a table or view named `grad_norms` (rank, seg, step, idx, norm). Portable between
# DuckDB and Spark SQL: no QUALIFY, `//`, isfinite or arg_max; NaN sorts above +inf in both, so
# `norm < +inf` is false for NaN; median is exact (interpolated) in both. Window functions rather than
# self-joins: Spark plans a CTE once per reference, so each self-join would double the plan below it;
# the median of the last 4 blocks' sigmas spreads each block over the 4 it serves (Spark has no
# median over a window frame).
SPIKE_SQL = f"""
WITH src AS (
  SELECT CAST(rank AS INT) AS rank, CAST(seg AS INT) AS seg, CAST(step AS BIGINT) AS step,
         CAST(idx AS INT) AS idx, CAST(norm AS DOUBLE) AS norm
  FROM grad_norms
),
cutoff AS (
  SELECT rank, seg, min(first_step) OVER (PARTITION BY rank ORDER BY seg
                                          ROWS BETWEEN 1 FOLLOWING AND UNBOUNDED FOLLOWING) AS cut
  FROM (SELECT rank, seg, min(step) AS first_step FROM src GROUP BY rank, seg) starts
),
kept AS (
  SELECT s.rank, s.step, s.idx, s.norm
  FROM src s JOIN cutoff c ON c.rank = s.rank AND c.seg = s.seg
  WHERE c.cut IS NULL OR s.step < c.cut
),
positions AS (
  SELECT rank, step, pos, least({WINDOW_MAX}, greatest({WINDOW_MIN}, CAST(floor(n / {WINDOW_SHARE}) AS BIGINT))) AS width
  FROM (SELECT rank, step, row_number() OVER (PARTITION BY rank ORDER BY step) - 1 AS pos,
               count(*) OVER (PARTITION BY rank) AS n
        FROM (SELECT DISTINCT rank, step FROM kept) d) numbered
),
y AS (
  SELECT k.rank, k.idx, k.step, CAST(floor(p.pos / p.width) AS BIGINT) AS blk, p.width,
         CASE WHEN k.norm > 0 AND k.norm < CAST('Infinity' AS DOUBLE) AND k.step >= {{first_judged}}
              THEN ln(k.norm) END AS y,
         CASE WHEN k.norm IS NOT NULL AND NOT (k.norm > CAST('-Infinity' AS DOUBLE)
                                                AND k.norm < CAST('Infinity' AS DOUBLE)) THEN 1 END AS bad
  FROM kept k JOIN positions p ON p.rank = k.rank AND p.step = k.step
),
in_block AS (
  SELECT rank, idx, step, blk, width, y, bad, median(y) OVER (PARTITION BY rank, idx, blk) AS med FROM y
),
blocks AS (
  SELECT rank, idx, blk, CASE WHEN 2 * count(y) >= min(width) THEN min(med) END AS med,
         CASE WHEN 2 * count(y) >= min(width) THEN {_double(MAD_TO_SIGMA)} * median(abs(y - med)) END AS sig
  FROM in_block GROUP BY rank, idx, blk
),
baseline AS (
  SELECT rank, idx, target + 1 AS blk, max(CASE WHEN k = 0 THEN med END) AS med, median(sig) AS sigma
  FROM (SELECT rank, idx, blk + k AS target, k, med, sig
        FROM blocks CROSS JOIN ({" UNION ALL ".join(f"SELECT {k} AS k" for k in range(SIGMA_BLOCKS))}) o) fanned
  GROUP BY rank, idx, target
),
scored AS (
  SELECT r.rank, r.idx, r.step, r.y, r.bad, r.y - b.med AS log_ratio,
         (r.y - b.med) / greatest(b.sigma, {_double(LOG_SIGMA_FLOOR)}) AS z
  FROM in_block r LEFT JOIN baseline b ON b.rank = r.rank AND b.idx = r.idx AND b.blk = r.blk
),
judged AS (
  SELECT rank, idx, step, y, bad, z, max(z) OVER (PARTITION BY rank, idx) AS max_z,
         CASE WHEN z >= {{sigma_own}} AND log_ratio >= {{log_min_ratio}} THEN 1 END AS spike,
         CASE WHEN z >= {{sigma_own}} AND log_ratio >= {{log_min_ratio}}
                   AND (log_ratio - avg(log_ratio) OVER (PARTITION BY rank, step))
                       / nullif(stddev_pop(log_ratio) OVER (PARTITION BY rank, step), 0) >= {{sigma_across}}
              THEN 1 END AS flag
  FROM scored
)
SELECT rank, idx, count(y) AS steps, count(bad) AS nonfinite, max(max_z) AS max_z,
       min(CASE WHEN z = max_z THEN step END) AS max_z_step, count(spike) AS spikes, count(flag) AS flagged,
       min(CASE WHEN flag = 1 THEN step END) AS first_flagged_step
FROM judged GROUP BY rank, idx
ORDER BY rank, idx
"""


def spike_sql(
    first_judged: int | None = None,
    sigma_own: float = SIGMA_OWN,
    min_ratio: float = MIN_RATIO,
    sigma_across: float = SIGMA_ACROSS,
) -> str:
    """`SPIKE_SQL` with the check's thresholds (a config may override them) and the first judged step
    (LOOP-05's end of warmup; None: every step)."""
    return SPIKE_SQL.format(
        first_judged=int(first_judged or -(2**62)),
        sigma_own=_double(float(sigma_own)),
        log_min_ratio=_double(math.log(float(min_ratio))),
        sigma_across=_double(float(sigma_across)),
    )


def series_root(run_dir: str | Path, name: str = GRAD_NORMS) -> Path:
    return artifact_root(run_dir) / SERIES_DIR / name


def series_files(run_dir: str | Path, name: str = GRAD_NORMS) -> list[str]:
    """The closed parts of a series, each a regular file inside the run folder (a symlink out of it is
    refused). A part being written (hidden ``.part-*.tmp``) and the journal of the steps since the last
    part (``journal-*.bin``) are not parts: the statistic covers the steps up to the last closed part."""
    root = series_root(run_dir, name)
    parts = sorted(root.glob("rank=*/seg=*/part-*.parquet"))
    if not parts:
        raise InputError(f"{root}: no parts (rank=<r>/seg=<s>/part-*.parquet); the shim writes them while it records")
    return [str(regular_file(p, root=run_dir)) for p in parts]


def _normalise(frame):
    import polars as pl

    return frame.select([pl.col(c).cast(getattr(pl, t)) for c, t in COLUMNS.items()]).sort("rank", "idx")


def duckdb_statistic(run_dir: str | Path, con=None, **thresholds):
    """The statistic by DuckDB over the run's Parquet parts, read in place (out of core)."""
    import duckdb

    con = con or duckdb.connect()
    parts = con.read_parquet(series_files(run_dir), hive_partitioning=True)
    return _normalise(parts.query(GRAD_NORMS, spike_sql(**thresholds)).pl())


def spark_statistic(source: str, spark, **thresholds):
    """The statistic by Spark SQL over a folder Spark can read (a local path, s3a://, hdfs://) holding
    ``rank=<r>/seg=<s>/`` parts: the same SQL text DuckDB runs."""
    import polars as pl

    # Only closed parts: the journal of the steps since (journal-*.bin) is no Parquet file.
    spark.read.option("pathGlobFilter", "part-*.parquet").parquet(str(source)).createOrReplaceTempView(GRAD_NORMS)
    rows = spark.sql(spike_sql(**thresholds)).collect()
    return _normalise(
        pl.DataFrame([tuple(r) for r in rows], schema={c: getattr(pl, t) for c, t in COLUMNS.items()}, orient="row")
    )


def polars_statistic(
    run_dir: str | Path,
    first_judged: int | None = None,
    sigma_own: float = SIGMA_OWN,
    min_ratio: float = MIN_RATIO,
    sigma_across: float = SIGMA_ACROSS,
):
    """The statistic by Polars' lazy scan, written as expressions (not the SQL): a second implementation."""
    import polars as pl

    src = pl.scan_parquet(series_files(run_dir), hive_partitioning=True).select(
        pl.col("rank").cast(pl.Int32),
        pl.col("seg").cast(pl.Int32),
        pl.col("step").cast(pl.Int64),
        pl.col("idx").cast(pl.Int32),
        pl.col("norm").cast(pl.Float64),
    )
    starts = src.group_by("rank", "seg").agg(first_step=pl.col("step").min())
    cutoff = (
        starts.join(starts, on="rank", suffix="_later")
        .filter(pl.col("seg_later") > pl.col("seg"))
        .group_by("rank", "seg")
        .agg(cut=pl.col("first_step_later").min())
    )
    kept = (
        src.join(cutoff, on=["rank", "seg"], how="left")
        .filter(pl.col("cut").is_null() | (pl.col("step") < pl.col("cut")))
        .drop("seg", "cut")
    )
    positions = (
        kept.select("rank", "step")
        .unique()
        .with_columns(pos=pl.col("step").rank("ordinal").over("rank").cast(pl.Int64) - 1)
    )
    widths = positions.group_by("rank").agg(
        width=(pl.len().cast(pl.Int64) // WINDOW_SHARE).clip(WINDOW_MIN, WINDOW_MAX)
    )
    norm = pl.col("norm")
    finite = norm.is_finite()
    y = (
        kept.join(positions, on=["rank", "step"])
        .join(widths, on="rank")
        .with_columns(
            blk=pl.col("pos") // pl.col("width"),
            y=pl.when(finite & (norm > 0) & (pl.col("step") >= (first_judged or -(2**62)))).then(norm.log()),
            bad=norm.is_not_null() & ~finite,
        )
    )
    block_median = (
        y.group_by("rank", "idx", "blk")
        .agg(med=pl.col("y").median(), finite=pl.col("y").count(), width=pl.col("width").first())
        .filter(2 * pl.col("finite") >= pl.col("width"))
        .select("rank", "idx", "blk", "med")
    )
    block_sigma = (
        y.join(block_median, on=["rank", "idx", "blk"])
        .group_by("rank", "idx", "blk")
        .agg(pl.col("med").first(), sig=MAD_TO_SIGMA * (pl.col("y") - pl.col("med")).abs().median())
    )
    history = block_sigma.join(block_sigma.select("rank", "idx", h_blk="blk", h_sig="sig"), on=["rank", "idx"]).filter(
        pl.col("h_blk").is_between(pl.col("blk") - (SIGMA_BLOCKS - 1), pl.col("blk"))
    )
    baseline = (
        history.group_by("rank", "idx", "blk")
        .agg(pl.col("med").first(), sigma=pl.col("h_sig").median())
        .with_columns(blk=pl.col("blk") + 1)
    )
    scored = (
        y.filter(pl.col("y").is_not_null())
        .join(baseline, on=["rank", "idx", "blk"])
        .with_columns(log_ratio=pl.col("y") - pl.col("med"))
        .with_columns(z=pl.col("log_ratio") / pl.max_horizontal(pl.col("sigma"), pl.lit(LOG_SIGMA_FLOOR)))
    )
    spike = (pl.col("z") >= sigma_own) & (pl.col("log_ratio") >= math.log(min_ratio))
    across = (
        scored.filter(spike)
        .select("rank", "step")
        .unique()
        .join(scored, on=["rank", "step"])
        .group_by("rank", "step")
        .agg(centre=pl.col("log_ratio").mean(), spread=pl.col("log_ratio").std(ddof=0))
    )
    judged = scored.join(across, on=["rank", "step"], how="left").with_columns(
        spike=spike,
        flag=spike
        & (
            pl.when(pl.col("spread") > 0).then((pl.col("log_ratio") - pl.col("centre")) / pl.col("spread"))
            >= sigma_across
        ).fill_null(False),
    )
    per_tensor = judged.group_by("rank", "idx").agg(
        max_z=pl.col("z").max(),
        max_z_step=pl.col("step").filter(pl.col("z") == pl.col("z").max()).min(),
        spikes=pl.col("spike").sum(),
        flagged=pl.col("flag").sum(),
        first_flagged_step=pl.col("step").filter(pl.col("flag")).min(),
    )
    counts = y.group_by("rank", "idx").agg(steps=pl.col("y").count(), nonfinite=pl.col("bad").sum())
    out = counts.join(per_tensor, on=["rank", "idx"], how="left").with_columns(pl.col("spikes", "flagged").fill_null(0))
    return _normalise(out.collect())


def tensor_names(run_dir: str | Path):
    """(rank, idx, tensor) from each rank's latest manifest record: the names LOOP-05 reports."""
    import polars as pl

    rows = []
    for folder in sorted(artifact_root(run_dir).glob("rank-*")):
        rank = folder.name.removeprefix("rank-")
        if not rank.isdigit() or not (folder / "manifest.jsonl").exists():
            continue
        latest: dict = {}
        for line in read_bytes(folder / "manifest.jsonl", root=run_dir).splitlines():
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # a torn last line: the record in flight at a crash
                continue
            if (
                isinstance(record, dict)
                and isinstance(record.get("seg", 0), int)
                and record.get("seg", 0) >= latest.get("seg", 0)
            ):
                latest = record
        params = latest.get("params") if isinstance(latest.get("params"), list) else []
        rows += [
            (int(rank), i, p["name"])
            for i, p in enumerate(params)
            if isinstance(p, dict) and isinstance(p.get("name"), str)
        ]
    return pl.DataFrame(rows, schema={"rank": pl.Int32, "idx": pl.Int32, "tensor": pl.String}, orient="row")


def with_names(statistic, run_dir: str | Path):
    """The statistic with each tensor's name beside its index."""
    return statistic.join(tensor_names(run_dir), on=["rank", "idx"], how="left").select(
        "rank", "idx", "tensor", *[c for c in COLUMNS if c not in ("rank", "idx")]
    )


def disagreement(a, b, rel: float = 1e-9) -> list[str]:
    """Where two engines' statistics differ: integer columns exactly, max_z within `rel` relative."""
    import numpy as np

    if a.select("rank", "idx").rows() != b.select("rank", "idx").rows():
        return [f"different (rank, idx) rows: {a.height} vs {b.height}"]
    problems = []
    for column in COLUMNS:
        x, y = (f[column].cast(float).fill_null(np.nan).to_numpy() for f in (a, b))
        both_null = np.isnan(x) & np.isnan(y)
        if column == "max_z":
            with np.errstate(invalid="ignore"):
                wrong = ~(both_null | (np.abs(x - y) <= rel * np.maximum(np.abs(x), np.abs(y))))
        else:
            wrong = ~(both_null | (x == y))
        if wrong.any():
            i = int(np.argmax(wrong))
            problems.append(
                f"{column}: {int(wrong.sum())} row(s) differ, first rank {a['rank'][i]} idx {a['idx'][i]}: "
                f"{a[column][i]} vs {b[column][i]}"
            )
    return problems
