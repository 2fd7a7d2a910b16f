"""The gradient checks read the norms a block of tensors at a time (sftaudit/checks/gradient_columns.py):
the block statistics equal numpy's own medians, and how the matrix is cut into ranges of steps and
blocks of tensors changes no finding. The synthetic run is the scale benchmark's (benchmarks/synthetic_run.py:
the shim's own writer, planted anomalies), small."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sftaudit.checks import gradient_columns
from sftaudit.checks.stats.rolling import MAD_TO_SIGMA, block_stats
from sftaudit.store.ingest import ingest
from sftaudit.store.rundb import connect
from sftaudit.verdict.audit import audit

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
_spec = importlib.util.spec_from_file_location("synthetic_run", _BENCHMARKS / "synthetic_run.py")
synthetic_run = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("synthetic_run", synthetic_run)
_spec.loader.exec_module(synthetic_run)


def _reference(series: np.ndarray, window: int, sigma_blocks: int, min_share: float):
    """block_stats by np.nanmedian, one block at a time."""
    k, n = series.shape
    blocks = n // window
    med = np.full((k, blocks), np.nan)
    sig = np.full((k, blocks), np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for b in range(blocks):
            x = series[:, b * window : (b + 1) * window].astype(float)
            x = np.where(np.isfinite(x), x, np.nan)
            med[:, b] = np.nanmedian(x, axis=1)
            sig[:, b] = MAD_TO_SIGMA * np.nanmedian(np.abs(x - med[:, b, None]), axis=1)
            few = np.isfinite(x).sum(axis=1) < min_share * window
            med[few, b] = sig[few, b] = np.nan
        if sigma_blocks > 1:
            sig = np.array(
                [[np.nanmedian(row[max(0, b - sigma_blocks + 1) : b + 1]) for b in range(blocks)] for row in sig]
            ).reshape(k, blocks)
    return med, sig


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    shape=st.tuples(st.integers(1, 4), st.integers(0, 90)),
    window=st.integers(1, 12),
    holes=st.floats(0, 1),
    sigma_blocks=st.sampled_from([1, 4]),
    min_share=st.sampled_from([0.0, 0.5]),
)
def test_block_stats_equal_numpys_medians(seed, shape, window, holes, sigma_blocks, min_share):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x[rng.random(shape) < holes] = np.nan
    x[rng.random(shape) < holes / 4] = np.inf
    med, sig = block_stats(x, window, sigma_blocks, min_share)
    ref_med, ref_sig = _reference(x, window, sigma_blocks, min_share)
    np.testing.assert_allclose(med, ref_med, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(sig, ref_sig, rtol=1e-5, atol=1e-6)


def _findings(verdict: dict) -> list[tuple]:
    return sorted(
        (f["code"], f["severity"], f["step"], f["message"])
        for f in verdict["findings"]
        if f["code"] in ("LOOP-05", "LOOP-10", "LOOP-15")
    )


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("streamed") / "run"
    planted = synthetic_run.write_synthetic_run(run, steps=6_000, tensors=70, block=1_000)
    return run, planted


def test_cutting_the_matrix_differently_changes_no_finding(planted_run, monkeypatch):
    run, planted = planted_run
    whole = audit(run)
    monkeypatch.setattr(gradient_columns, "STEP_VALUES", 70 * 333)  # ranges of 333 steps, the last one short
    monkeypatch.setattr(gradient_columns, "BLOCK_VALUES", 6_000 * 3)  # blocks of 3 tensors, the last one of 1
    cut = audit(run)
    assert _findings(cut) == _findings(whole)
    found = {(f["code"], f["severity"], f["step"]) for f in whole["findings"]}
    assert ("LOOP-05", "fail", planted["grad_scale"]["step"]) in found
    assert ("LOOP-05", "warn", planted["periodic_spike"]["start"]) in found
    assert ("LOOP-15", "fail", planted["stale"]["step"]) in found
    stale = next(f for f in whole["findings"] if f["code"] == "LOOP-15")
    assert [t["tensor"] for t in stale["evidence"]["tensors"]] == [
        f"model.layers.{i // 8}.block.{i % 8}.weight" for i in planted["stale"]["tensors"]
    ]


def test_the_temporary_file_is_gone_after_the_audit(planted_run, tmp_path, monkeypatch):
    run, _ = planted_run
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    audit(run)
    assert list(tmp_path.iterdir()) == []


def test_a_part_named_out_of_step_order_still_reads_whole(tmp_path):
    """A part renamed by hand (its name's first step far after its rows) is read after the ranges its rows
    fall in were written: they are written again, and the checks' reader still equals the view."""
    run = tmp_path / "run"
    synthetic_run.write_synthetic_run(run, steps=12_000, tensors=10, block=1_000)  # parts roll every 10,000 steps
    folder = next((run / "sftaudit" / "series" / "grad_norms" / "rank=0").glob("seg=*"))
    parts = sorted(folder.glob("part-*.parquet"))
    assert len(parts) == 2, parts
    parts[0].rename(folder / "part-000011990.parquet")  # steps 1-10,000, read after steps 10,001-12,000
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(gradient_columns, "STEP_VALUES", 10 * 500)  # ranges of 500 steps: 23 written before
    try:
        ingest(run)
        con = connect(run, read_only=True)
        try:
            columns = gradient_columns.GradientColumns(con, run)
            view = np.full((len(columns.names), columns.steps.size), gradient_columns.ABSENT, dtype=np.float32)
            cells = con.sql("SELECT step, idx, norm FROM grad_cells WHERE rank = 0").fetchnumpy()
            view[cells["idx"], np.searchsorted(columns.steps, cells["step"])] = cells["norm"]
            read = np.concatenate([block for _, block in columns.blocks(absent=gradient_columns.ABSENT)])
            columns.close()
        finally:
            con.close()
    finally:
        monkeypatch.undo()
    assert (view[:, :10] != gradient_columns.ABSENT).all()  # the renamed part's steps are there
    np.testing.assert_array_equal(read, view)
