"""What the report reads from the audited DuckDB file, shaped for display.

Only reads and display shaping happen here: long series are thinned to a min/max
envelope per step bucket (so every spike stays visible) plus every step a finding
points at, and the gradient-norm matrix is bucketed the same way (max per bucket).
No check statistic is computed here; checks store those in the ``series`` table.
"""

from __future__ import annotations

from typing import Any

import duckdb
import numpy as np
import polars as pl

from ...store.rundb import first_row, has_rows, has_table

# Below this many points a series is drawn as recorded; above, as an envelope of this many buckets
# (about one per pixel of a chart as wide as the page: more are invisible and slow the page down).
ENVELOPE_BUCKETS = 1000
HEATMAP_BUCKETS = 250


def has_column(con: duckdb.DuckDBPyConnection, table: str, column: str) -> bool:
    """Whether a stored table has a column (a file audited by an older sftaudit may lack it)."""
    return bool(
        first_row(
            con,
            "SELECT count(*) FROM information_schema.columns WHERE table_name = ? AND column_name = ?",
            [table, column],
        )[0]
    )


def row_count(con: duckdb.DuckDBPyConnection, table: str) -> int:
    return first_row(con, f'SELECT count(*) FROM "{table}"')[0] if has_table(con, table) else 0


def envelope(
    con: duckdb.DuckDBPyConnection,
    source: str,
    params: list[Any],
    keep_steps: list[int],
    buckets: int = ENVELOPE_BUCKETS,
    by: str | None = None,
) -> pl.DataFrame:
    """(seg, step, value) of `source` for drawing: all finite points if few, else each bucket's
    lowest and highest point, plus the points at `keep_steps`; ordered by segment and step. With
    `by` (a column of `source`), the same for each of its groups in one query, the column first."""
    group = f"{by}, " if by else ""
    sql = f"""
        WITH s AS (SELECT {group}seg, step, value FROM ({source}) WHERE value IS NOT NULL AND isfinite(value)),
        span AS (SELECT {group}min(step) AS lo, max(step) - min(step) + 1 AS width, count(*) AS n
                 FROM s {f"GROUP BY {by}" if by else ""}),
        b AS (SELECT s.*, span.n, (s.step - span.lo) * {int(buckets)} // span.width AS bucket
              FROM s {f"JOIN span USING ({by})" if by else ", span"}),
        ranked AS (SELECT *, row_number() OVER (PARTITION BY {group}seg, bucket ORDER BY value, step) AS low,
                             row_number() OVER (PARTITION BY {group}seg, bucket ORDER BY value DESC, step) AS high
                   FROM b)
        SELECT {group}seg, step, value FROM ranked
        WHERE n <= {2 * int(buckets)} OR low = 1 OR high = 1 OR list_contains(?::BIGINT[], step)
        ORDER BY {group}seg, step
    """
    return con.sql(sql, params=[*params, keep_steps]).pl()


def gradient_matrix(con: duckdb.DuckDBPyConnection, buckets: int = HEATMAP_BUCKETS) -> dict[str, Any] | None:
    """Per tensor and step bucket: the largest finite gradient norm and whether any was non-finite."""
    # One pass over rank 0's norms (grad_cells: no tensor-name join), the step range from the steps ingest
    # listed and the names from the manifest: three passes over a billion norms took minutes.
    if not has_rows(con, "grad_cells"):
        return None
    lo, hi = first_row(con, "SELECT min(step), max(step) FROM grad_piece_steps WHERE rank = 0")
    if lo is None:
        return None
    width = max(1, -(-(hi - lo + 1) // buckets))  # steps per bucket, rounded up
    cells = con.sql(
        """
        SELECT idx, (step - ?) // ? AS bucket,
               max(norm) FILTER (WHERE isfinite(norm)) AS norm,
               count(*) FILTER (WHERE NOT isfinite(norm)) AS nonfinite
        FROM grad_cells WHERE rank = 0 AND step BETWEEN ? AND ? GROUP BY idx, bucket
        """,
        params=[lo, width, lo, hi],
    ).pl()
    names = con.sql(
        "SELECT idx, arg_max(name, seg) AS tensor FROM params WHERE rank = 0 AND idx IN (SELECT unnest(?::INTEGER[])) "
        "GROUP BY idx ORDER BY idx",
        params=[sorted(set(cells["idx"].to_list()))],
    ).pl()
    row_of = {idx: i for i, idx in enumerate(names["idx"].to_list())}
    n_buckets = (hi - lo) // width + 1
    norm = np.full((len(row_of), n_buckets), np.nan, dtype=np.float64)
    rows = np.array([row_of[i] for i in cells["idx"].to_list()], dtype=np.int64)
    cols = cells["bucket"].to_numpy().astype(np.int64)
    norm[rows, cols] = cells["norm"].fill_null(np.nan).to_numpy()
    bad = cells["nonfinite"].to_numpy() > 0
    return {
        "tensors": names["tensor"].to_list(),
        "bucket_steps": lo + np.arange(n_buckets) * width,
        "width": width,
        "norm": norm,
        "nonfinite_cells": (rows[bad], cols[bad]),
    }


def histogram_steps(con: duckdb.DuckDBPyConnection, finding_steps: list[int], limit: int = 4) -> list[dict[str, Any]]:
    """Gradient histograms taken at anomalous steps (non-finite or spike triggers, or a finding's step)."""
    if not row_count(con, "grad_hists"):
        return []
    # The first histogram of each trigger (a non-finite run triggers one at every later step),
    # and those at steps a finding points at.
    picked = con.execute(
        """
        WITH hist_steps AS (SELECT DISTINCT step, reason FROM grad_hists WHERE rank = 0),
        firsts AS (SELECT min(step) AS step FROM hist_steps WHERE reason <> 'scheduled' GROUP BY reason)
        SELECT step, string_agg(DISTINCT reason, ', ') FROM hist_steps
        WHERE step IN (SELECT step FROM firsts) OR list_contains(?::BIGINT[], step)
        GROUP BY step ORDER BY step LIMIT ?
        """,
        [finding_steps, limit],
    ).fetchall()
    out = []
    for step, reason in picked:
        frame = (
            con.sql(
                """
            SELECT h.tensor, h.zeros, h.nonfinite, h.counts FROM grad_hists h
            LEFT JOIN params p ON p.rank = h.rank AND p.seg = h.seg AND p.name = h.tensor
            WHERE h.rank = 0 AND h.step = ? ORDER BY h.seg DESC, p.idx
            """,
                params=[step],
            )
            .pl()
            .unique("tensor", keep="first", maintain_order=True)
        )
        out.append({"step": step, "reason": reason, "frame": frame})
    return out


def run_summary(con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    """Steps, segments, ranks, artifact sizes, shim errors, switched-off probes and the suspicious steps
    whose histograms could not be taken."""
    steps = first_row(con, "SELECT count(*), min(step), max(step), count(DISTINCT seg) FROM steps WHERE rank = 0")
    ranks = first_row(con, "SELECT count(DISTINCT rank) FROM manifest")[0]
    span = first_row(con, "SELECT min(time), max(time) FROM events WHERE kind IN ('start', 'close')")
    artifacts = con.execute('SELECT file, "offset", records, bad_lines FROM ingest_state ORDER BY file').fetchall()
    events = (
        con.sql(
            """SELECT rank, seg, step, kind, probe, error FROM events
           WHERE kind IN ('shim_error', 'probe_disabled', 'grad_hists_not_recorded') ORDER BY time NULLS LAST"""
        )
        .pl()
        .to_dicts()
    )
    return {
        "steps_recorded": steps[0],
        "first_step": steps[1],
        "last_step": steps[2],
        "segments": steps[3],
        "ranks_recorded": ranks,
        "wall_seconds": (span[1] - span[0]) if span and span[0] is not None and span[1] is not None else None,
        "artifacts": [{"file": f, "bytes": b, "records": r, "bad_lines": bad} for f, b, r, bad in artifacts],
        "artifact_bytes": sum(b or 0 for _, b, _, _ in artifacts),
        "shim_errors": [e for e in events if e["kind"] == "shim_error"],
        "disabled_probes": [e for e in events if e["kind"] == "probe_disabled"],
        "hists_not_taken": [e for e in events if e["kind"] == "grad_hists_not_recorded"],
    }


def per_sample_histogram(con: duckdb.DuckDBPyConnection, column: str, bins: int = 40) -> pl.DataFrame:
    """(low, high, samples) of a per-row list column of `batches` (lengths, label_tokens), in at most
    `bins` equal-width integer bins: the counts a histogram draws."""
    source = f"(SELECT unnest({column}) AS v FROM batches WHERE rank = 0)"
    lo, hi = first_row(con, f"SELECT min(v), max(v) FROM {source}")
    if lo is None:
        return pl.DataFrame({"low": [], "high": [], "samples": []})
    width = max(1, -(-(hi - lo + 1) // bins))
    return con.sql(
        f"""SELECT ? + b * ? AS low, ? + (b + 1) * ? - 1 AS high, count(*) AS samples
            FROM (SELECT (v - ?) // ? AS b FROM {source}) GROUP BY b ORDER BY b""",
        params=[lo, width, lo, width, lo, width],
    ).pl()


def dataset_summary(con: duckdb.DuckDBPyConnection) -> dict[str, Any]:
    """Rows collated, batches, tokens and the rows the template refused or rendered without a message."""
    batches, rows, real, trained, padded = first_row(
        con,
        """SELECT count(*), sum(rows), sum(list_sum(lengths)), sum(list_sum(label_tokens)), sum(rows * seq_len)
                FROM batches WHERE rank = 0""",
    )
    failures = con.execute(
        "SELECT kind, count(*) FROM events WHERE kind IN ('render_failed', 'content_dropped') GROUP BY kind"
    ).fetchall()
    return {
        "batches": batches,
        "rows": rows or 0,
        "real_tokens": real or 0,
        "trained_tokens": trained or 0,
        "padded_tokens": padded or 0,
        "failures": dict(failures),
    }


# Per-rank lanes of a distributed run: (title, table, source of rank, seg, step, value).
RANK_METRICS = (
    ("loss", "steps", "SELECT rank, seg, step, loss AS value FROM steps"),
    (
        "trained tokens",
        "batches",
        "SELECT rank, seg, step, sum(list_sum(label_tokens)) AS value FROM batches GROUP BY ALL",
    ),
    ("step time (s)", "steps", "SELECT rank, seg, step, dt AS value FROM steps"),
)


def rank_lanes(con: duckdb.DuckDBPyConnection, keep_steps: list[int]) -> list[dict[str, Any]]:
    """Each per-rank metric of a run recorded on two or more ranks: one (seg, step, value) frame per
    rank where the ranks' values differ at some step (or a rank lacks the step), else one frame for
    all ranks (the reduced view); plus the (rank, step, value) points that are not finite."""
    ranks = [r for (r,) in con.execute("SELECT DISTINCT rank FROM steps ORDER BY rank").fetchall()]
    if len(ranks) < 2:
        return []
    lanes = []
    for title, table, source in RANK_METRICS:
        if not has_table(con, table):
            continue
        recorded, differing = first_row(
            con,
            f"""
            SELECT count(*) FILTER (WHERE n_values > 0),
                   count(*) FILTER (WHERE n_values > 0 AND (n_distinct > 1 OR n_values < n_rows OR n_rows < ?))
            FROM (SELECT seg, step, count(*) AS n_rows, count(value) AS n_values, count(DISTINCT value) AS n_distinct
                  FROM ({source}) GROUP BY seg, step)""",
            [len(ranks)],
        )
        if not recorded:
            continue
        shown = ranks if differing else ranks[:1]
        every = envelope(
            con,
            f"SELECT rank, seg, step, value FROM ({source}) WHERE list_contains(?, rank)",
            [shown],
            keep_steps,
            by="rank",
        )
        frames = {r: every.filter(every["rank"] == r).drop("rank") for r in shown}
        nonfinite = con.sql(
            f"SELECT rank, step, value FROM ({source}) WHERE NOT isfinite(value) ORDER BY step, rank"
        ).pl()
        lanes.append(
            {"title": title, "per_rank": bool(differing), "ranks": ranks, "frames": frames, "nonfinite": nonfinite}
        )
    return lanes
