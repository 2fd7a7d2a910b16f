"""The incremental audit: a run audited at random points as it grows (the same segment going on, a restart from an
earlier step, a part rewritten in place) and then audited once more finds exactly what a fresh audit of the whole
run finds, though LOOP-05, LOOP-10 and LOOP-15 judge again only the steps past what they carried."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sftaudit.fixtures.recording import bare_manifest

from sftaudit.checks import gradient_columns
from sftaudit.core.artifacts import rank_dir
from sftaudit.shim.writer import JsonlWriter
from sftaudit.store.rundb import connect, database_dir
from sftaudit.verdict.audit import audit

TENSORS, RANGE_STEPS, PART_STEPS = 24, 7, 5  # small ranges and parts: many of each, parts straddling ranges
TOTAL = 140  # under 144 steps the adaptive window stays 8: what a check carries stays valid as the run grows
NAMES = [f"model.layers.{i}.weight" for i in range(TENSORS - 1)] + ["lm_head.weight"]


@pytest.fixture(autouse=True)
def small_ranges(monkeypatch):
    monkeypatch.setattr(gradient_columns, "STEP_VALUES", TENSORS * RANGE_STEPS)


def planted_norms(seed: int, faults: dict) -> np.ndarray:
    """Steps 1..TOTAL x tensors of float32 norms (row i: step i + 1) with the faults planted at their steps: a
    spike (LOOP-05), a collapse (LOOP-05), a stale buffer (LOOP-15), a tensor turning volatile (LOOP-10)."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(-3, 1.0, TENSORS))
    noise = np.full(TENSORS, 0.1)
    norms = scale * np.exp(noise * rng.standard_normal((TOTAL, TENSORS)))
    if "volatile" in faults:
        at = faults["volatile"] - 1
        norms[at:, 5] = scale[5] * np.exp(1.5 * rng.standard_normal(TOTAL - at))
    if "spike" in faults:
        norms[faults["spike"] - 1, 2] *= 300.0
    if "collapse" in faults:
        at = faults["collapse"] - 1
        norms[at : at + 5, 7] *= 1e-5
    norms = norms.astype(np.float32)
    if "stale" in faults:
        at = faults["stale"] - 1
        for row in range(at, min(TOTAL, at + 3)):
            norms[row, 11:14] = norms[row - 1, 11:14]
    return norms


def write_steps(run: Path, norms: np.ndarray, first: int, last: int, seg: int = 0, header: bool = False) -> None:
    """Steps `first`..`last` of segment `seg` through the shim's writer (`header`: the segment starts here)."""
    writer = JsonlWriter(rank_dir(run, 0), roll_steps=PART_STEPS)
    now = time.time()
    if header:
        params = [
            {"name": n, "shape": [64, 64], "dtype": "torch.float32", "numel": 4096, "requires_grad": True}
            for n in NAMES
        ]
        writer.write("manifest", {**bare_manifest(run.name, params, "Incremental", started=now), "seg": seg})
        writer.write("events", {"seg": seg, "kind": "start", "time": now})
    for step in range(first, last + 1):
        row = norms[step - 1]
        writer.write(
            "steps",
            {
                "seg": seg,
                "step": step,
                "time": now,
                "dt": 0.1,
                "loss": float(2.0 + np.exp(-step / 50) + 0.02 * np.sin(step * 1.7)),
                "lr": 1e-4,
                "grad_norm": float(np.sqrt((row.astype(np.float64) ** 2).sum())),
                "grad_norms": row,
                "nonfinite_grads": {},
                "micro_batches": 1,
                "tokens": 14,
            },
        )
    writer.close()


def rewrite_a_part(run: Path, seg: int = 0) -> None:
    """The second part of the segment written again in place with one norm changed (a rewritten part)."""
    parts = sorted((run / "sftaudit" / "series" / "grad_norms" / "rank=0" / f"seg={seg}").glob("part-*.parquet"))
    if len(parts) < 2:
        return
    table = pq.read_table(parts[1])
    norms = table.column("norm").to_numpy().copy()
    norms[len(norms) // 2] *= 50.0  # a part may hold one step only
    pq.write_table(table.set_column(table.schema.get_field_index("norm"), "norm", [norms]), parts[1])


def comparable(verdict: dict) -> list:
    return sorted(json.dumps(f, sort_keys=True) for f in verdict["findings"])


def stored_series(run: Path) -> tuple[list, list]:
    """The series the audit stored for the report: the series in the order the report draws them, and every
    point (NaN compared as a string)."""
    con = connect(run, read_only=True)
    try:
        order = con.execute("SELECT code, name FROM series GROUP BY code, name ORDER BY min(rowid)").fetchall()
        points = con.execute(
            "SELECT code, name, step, value::VARCHAR, threshold, sole_condition FROM series ORDER BY code, name, step"
        ).fetchall()
    finally:
        con.close()
    return order, points


def grown_and_fresh(run: Path, seed: int, faults: dict, cuts: list[int], how: str, back: int) -> tuple[dict, dict]:
    """Audit the run at each cut as it is written, then grow it to TOTAL as `how` says, audit it again, and audit
    a copy of it from nothing (another folder: another database and carried state)."""
    norms = planted_norms(seed, faults)
    written = 0
    for cut in cuts:
        write_steps(run, norms, written + 1, cut, header=written == 0)
        written = cut
        audit(run)
    if how == "resumed":  # a restart from an earlier checkpoint: steps after it written again, otherwise
        resume_at = max(1, written - back)
        again = planted_norms(seed + 1, faults)
        write_steps(run, again, resume_at + 1, TOTAL, seg=1, header=True)
    else:
        if how == "rewritten":
            rewrite_a_part(run)
        write_steps(run, norms, written + 1, TOTAL)
    final = audit(run)
    shutil.copytree(run, run.parent / "fresh")
    return final, audit(run.parent / "fresh")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    faults=st.fixed_dictionaries(
        {},
        optional={
            "spike": st.integers(30, TOTAL),
            "collapse": st.integers(30, TOTAL - 5),
            "stale": st.integers(30, TOTAL - 3),
            "volatile": st.integers(40, TOTAL - 20),
        },
    ),
    cuts=st.lists(st.integers(2, TOTAL - 1), min_size=1, max_size=3, unique=True).map(sorted),
    how=st.sampled_from(["grown", "resumed", "rewritten"]),
    back=st.integers(0, 40),
)
# Audited before any step could be judged: the cells carried were none, and must not turn the later ones float64.
@example(seed=0, faults={"spike": 30}, cuts=[2, 8], how="grown", back=0)
# The part rewritten holds one step only.
@example(seed=0, faults={}, cuts=[6], how="rewritten", back=0)
def test_an_audit_carried_through_random_cuts_equals_a_fresh_one(tmp_path_factory, seed, faults, cuts, how, back):
    run = tmp_path_factory.mktemp("incremental") / "run"
    final, fresh = grown_and_fresh(run, seed, faults, cuts, how, back)
    assert comparable(final) == comparable(fresh)
    assert stored_series(run) == stored_series(run.parent / "fresh")


@pytest.mark.parametrize("how", ["grown", "resumed", "rewritten"])
def test_the_planted_faults_are_found_after_an_incremental_audit(tmp_path, how):
    faults = {"spike": 100, "collapse": 110, "stale": 120, "volatile": 90}
    final, fresh = grown_and_fresh(tmp_path / "run", 3, faults, [40, 85], how, back=10)
    found = {(f["code"], f["severity"], f["step"]) for f in final["findings"]}
    assert {("LOOP-05", "fail", 100), ("LOOP-05", "fail", 110)} <= found
    assert any(code == "LOOP-15" and step in (120, 121) for code, _, step in found)
    assert comparable(final) == comparable(fresh)
    assert stored_series(tmp_path / "run") == stored_series(tmp_path / "fresh")


def test_only_the_steps_past_what_was_carried_are_judged_again(tmp_path, monkeypatch):
    run = tmp_path / "run"
    norms = planted_norms(5, {"spike": 60})
    write_steps(run, norms, 1, 100, header=True)
    audit(run)
    write_steps(run, norms, 101, TOTAL)
    read_from: dict[str, list[int]] = {}
    original = gradient_columns.GradientColumns.map

    def map_recorded(self, judge, absent=np.nan, first_row=0):
        caller = sys._getframe(1).f_globals["__name__"].rsplit(".", 1)[1]
        read_from.setdefault(caller, []).append(first_row)
        return original(self, judge, absent, first_row)

    monkeypatch.setattr(gradient_columns.GradientColumns, "map", map_recorded)
    final = audit(run)
    # 98 rows closed (14 ranges of 7) were carried; a collapse may start at row 96: LOOP-05 reads from 4 windows
    # of 8 before the window of row 96.
    assert read_from["loop05_gradient_norm"] == [(96 // 8 - 4) * 8]
    # LOOP-15 from 2 rows before: a starved run of 3 ending past row 98 starts at row 96 at most.
    assert read_from["loop15_trainable_set"] == [96]
    # LOOP-10 from the last of the 11 windows of 8 (from step row 8, after warmup) wholly in the 98 rows.
    assert read_from["loop10_drift"] == [8 + 10 * 8]
    assert ("LOOP-05", "fail", 60) in {(f["code"], f["severity"], f["step"]) for f in final["findings"]}


@pytest.mark.parametrize(
    "faults",
    [{"collapse": 96}, {"collapse": 97}, {"stale": 98}, {"stale": 99}, {"spike": 99, "volatile": 60}],
    ids=["collapse-96", "collapse-97", "stale-98", "stale-99", "spike-99"],
)
def test_a_fault_straddling_the_carried_end_is_found_as_fresh(tmp_path, faults):
    # Audited at step 100: 98 rows closed. A collapse or stale run starting just before them and ending after.
    final, fresh = grown_and_fresh(tmp_path / "run", 7, faults, [100], "grown", back=0)
    assert comparable(final) == comparable(fresh)
    found = {(f["code"], f["step"]) for f in final["findings"]}
    if "collapse" in faults:
        assert ("LOOP-05", faults["collapse"]) in found


def test_what_a_check_carried_is_judged_again_when_unreadable(tmp_path):
    run = tmp_path / "run"
    norms = planted_norms(11, {"spike": 120, "stale": 70})
    write_steps(run, norms, 1, 100, header=True)
    audit(run)
    carried = sorted(database_dir(run).glob("carried-LOOP-*.arrays"))
    assert [p.name for p in carried] == ["carried-LOOP-05.arrays", "carried-LOOP-10.arrays", "carried-LOOP-15.arrays"]
    carried[0].write_bytes(b"PK\x03\x04 torn")
    carried[2].write_bytes(b"")
    write_steps(run, norms, 101, TOTAL)
    final = audit(run)
    shutil.copytree(run, tmp_path / "fresh")
    assert comparable(final) == comparable(audit(tmp_path / "fresh"))
    assert ("LOOP-05", "fail", 120) in {(f["code"], f["severity"], f["step"]) for f in final["findings"]}


def test_series_stored_again_from_their_index_or_without_one_equal_those_stored_anew():
    """A grown series is stored from its first changed point, its moved threshold updated, the series listed by
    `series_index`; a database from before that index (or whose index no longer counts the table's rows) is listed
    from the points themselves: either way the table holds what storing the series anew does."""
    import duckdb
    import polars as pl

    from sftaudit.verdict.audit import _store_series

    def series(n: int, threshold: float) -> list[dict]:
        steps = pl.Series(np.arange(1, n + 1), dtype=pl.Int64)
        return [
            {
                "code": c,
                "name": "x",
                "steps": steps,
                "values": pl.Series(np.sqrt(steps.to_numpy() * k)),
                "threshold": threshold * k,
                "sole_condition": k == 2,
            }
            for k, c in ((1, "LOOP-05"), (2, "LOOP-10"))
        ]

    def table(con) -> list:
        return con.execute("SELECT * FROM series ORDER BY rowid").fetchall()

    none = duckdb.connect()
    _store_series(none, [])  # a run no check drew a series for
    assert none.execute("SELECT count(*) FROM series_index").fetchone() == (0,)
    fresh = duckdb.connect()
    _store_series(fresh, series(9, 2.0))
    for drop in (None, "DROP TABLE series_index", "UPDATE series_index SET points = 1"):
        con = duckdb.connect()
        _store_series(con, series(6, 1.0))
        if drop:
            con.execute(drop)
        _store_series(con, series(9, 2.0))
        assert sorted(table(con)) == sorted(table(fresh))
        assert con.execute("SELECT code, threshold FROM series_index ORDER BY position").fetchall() == [
            ("LOOP-05", 2.0),
            ("LOOP-10", 4.0),
        ]
