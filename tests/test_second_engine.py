"""The columnar gradient-norm series read by a second engine: DuckDB (SQL) and Polars' lazy scan
(expressions) compute LOOP-05's per-tensor spike statistic over the same Parquet folder with equal
results, equal to the check's own numpy functions, and find a planted spike at its step and tensor.
Spark runs the same SQL in benchmarks/second_engine.py (not here: it needs a JVM and a minute)."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from sftaudit.checks import engines
from sftaudit.checks import loop05_gradient_norm as loop05
from sftaudit.checks.stats.rolling import (
    adaptive_window,
    previous_block_stats,
    robust_z,
)
from sftaudit.errors import InputError
from tests.series_data import noisy_norms, write_manifest, write_parts

TENSORS = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(16)]  # 16: one outlier can be 3 sd out
STEPS = 700
RESUME_AT = 300  # rank 0's segment 1 restarts from a checkpoint at step 300; seg 0 had run to 399
SPIKE = (1, 3, 437)  # rank, idx, step
ABANDONED_SPIKE = (0, 2, 350)  # in the steps seg 0 ran and seg 1 ran again: not the run's


def build_run(root, spike: bool = True):
    """Two ranks; rank 0 resumed (an abandoned stretch with a spike of its own); one NaN norm."""
    rng = np.random.default_rng(5)
    truth = {rank: noisy_norms(rng, STEPS, len(TENSORS)) for rank in (0, 1)}
    truth[1][500, 0] = np.nan
    if spike:
        rank, idx, step = SPIKE
        truth[rank][step, idx] *= 50
    abandoned = noisy_norms(rng, 400 - RESUME_AT, len(TENSORS))
    abandoned[ABANDONED_SPIKE[2] - RESUME_AT, ABANDONED_SPIKE[1]] *= 1000
    for seg in (0, 1):
        write_manifest(root, 0, seg, TENSORS)
    write_manifest(root, 1, 0, TENSORS)
    write_parts(root, 0, 0, 0, np.concatenate([truth[0][:RESUME_AT], abandoned]), steps_per_part=128)
    write_parts(root, 0, 1, RESUME_AT, truth[0][RESUME_AT:], steps_per_part=128)
    write_parts(root, 1, 0, 0, truth[1], steps_per_part=250)
    return truth


def reference(norms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per tensor: max own-history z and spike count, by the check's own functions (in float64: the
    check's float32 would differ from the engines in the 7th digit)."""
    y = np.log(np.where(np.isfinite(norms) & (norms > 0), norms, np.nan).astype(np.float64))
    median, sigma = previous_block_stats(
        y, adaptive_window(norms.shape[0]), loop05.SIGMA_BLOCKS, loop05.MIN_BASELINE_SHARE
    )
    z = robust_z(y, median, sigma, loop05.LOG_SIGMA_FLOOR)
    with np.errstate(invalid="ignore"):
        spikes = ((z >= engines.SIGMA_OWN) & (y - median >= math.log(engines.MIN_RATIO))).sum(axis=0)
    return np.nanmax(z, axis=0), spikes


def test_duckdb_and_polars_agree_and_find_the_planted_spike(tmp_path):
    truth = build_run(tmp_path)
    by_duckdb = engines.duckdb_statistic(tmp_path)
    by_polars = engines.polars_statistic(tmp_path)
    assert engines.disagreement(by_duckdb, by_polars) == []
    assert by_duckdb.height == 2 * len(TENSORS)

    named = engines.with_names(by_duckdb, tmp_path)
    flagged = named.filter(pl.col("flagged") > 0)
    rank, idx, step = SPIKE
    assert flagged.select("rank", "idx", "tensor", "first_flagged_step", "max_z_step", "flagged").rows() == [
        (rank, idx, TENSORS[idx], step, step, 1)
    ]
    # The resumed rank counts each step once, from the segment that ran it last: the abandoned spike is not the run's.
    rank0 = named.filter(pl.col("rank") == 0)
    assert rank0["steps"].to_list() == [STEPS] * len(TENSORS)
    assert rank0.filter(pl.col("idx") == ABANDONED_SPIKE[1])["spikes"].item() == 0
    assert named.filter((pl.col("rank") == 1) & (pl.col("idx") == 0))[["steps", "nonfinite"]].row(0) == (STEPS - 1, 1)

    for r in (0, 1):
        max_z, spikes = reference(truth[r].astype(np.float64))
        mine = by_polars.filter(pl.col("rank") == r)
        np.testing.assert_allclose(mine["max_z"].to_numpy(), max_z, rtol=1e-9)
        assert mine["spikes"].to_list() == spikes.tolist()


def test_a_clean_twin_flags_nothing_in_either_engine(tmp_path):
    build_run(tmp_path, spike=False)
    for statistic in (engines.duckdb_statistic(tmp_path), engines.polars_statistic(tmp_path)):
        assert statistic["flagged"].sum() == 0
        assert statistic.filter((pl.col("rank") == 1) & (pl.col("idx") == 3))["max_z"].item() < engines.SIGMA_OWN


def test_what_the_sql_spells_out_matches_the_check():
    """The engines take LOOP-05's constants from the check; what their SQL writes as arithmetic is held here."""
    assert loop05.MIN_BASELINE_SHARE == 0.5  # the SQL's `2 * count(y) >= width`
    for n in (5, 16 * 50, 10**6):
        assert adaptive_window(n) == min(engines.WINDOW_MAX, max(engines.WINDOW_MIN, n // engines.WINDOW_SHARE))


def test_a_folder_without_parts_is_one_clear_error(tmp_path):
    with pytest.raises(InputError, match="no parts"):
        engines.duckdb_statistic(tmp_path)
