"""The columnar copy carried from one audit to the next (`gradient_columns.CarriedCopy`): a run audited, cut at a
random point, then grown (the same segment going on, or a restart from an earlier step), and audited again reads
exactly what a fresh audit of the whole run reads, and finds the same; only the open ranges are read again."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sftaudit.fixtures.live_run import TENSORS, next_segment, write_live_run

from sftaudit.checks import gradient_columns
from sftaudit.store.ingest import ingest
from sftaudit.store.rundb import connect, database_dir
from sftaudit.verdict.audit import audit

RANGE_STEPS, PART_STEPS, TOTAL = 7, 5, 60  # small ranges and parts: many of each, parts straddling ranges


@pytest.fixture(autouse=True)
def small_ranges(monkeypatch):
    monkeypatch.setattr(gradient_columns, "STEP_VALUES", TENSORS * RANGE_STEPS)


def read_columns(run):
    """The matrix the checks read (tensors x steps, ABSENT kept) and the per-step flags."""
    ingest(run)
    con = connect(run)
    try:
        columns = gradient_columns.GradientColumns(con, run)
        try:
            matrix = np.concatenate([b for _, b in columns.blocks(absent=gradient_columns.ABSENT)])
            return matrix, columns.graded.copy(), columns.nonfinite.copy(), columns.steps.copy()
        finally:
            columns.close()
    finally:
        con.close()


def grow(run, cut: int, resume_at: int | None, nan_at: int | None) -> None:
    """Steps cut+1..TOTAL of the same segment, or (resume_at) a restart from step resume_at's checkpoint."""
    if resume_at is None:
        write_live_run(run, TOTAL - cut, first_step=cut + 1, nan_at=nan_at, header=False, roll_steps=PART_STEPS)
    else:
        write_live_run(
            run,
            TOTAL - resume_at,
            first_step=resume_at + 1,
            seg=next_segment(run),
            nan_at=nan_at,
            roll_steps=PART_STEPS,
        )


def comparable(verdict: dict) -> list:
    return sorted(json.dumps(f, sort_keys=True) for f in verdict["findings"])


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cut=st.integers(1, TOTAL - 1),
    resume_back=st.one_of(st.none(), st.integers(0, 30)),
    nan_at=st.one_of(st.none(), st.integers(1, TOTAL)),
)
def test_a_grown_run_reads_what_a_fresh_audit_reads(tmp_path_factory, cut, resume_back, nan_at):
    run = tmp_path_factory.mktemp("carried") / "run"
    write_live_run(run, cut, close=False, nan_at=nan_at if nan_at and nan_at <= cut else None, roll_steps=PART_STEPS)
    read_columns(run)  # the first audit's copy, carried
    resume_at = None if resume_back is None else max(0, cut - resume_back)
    grow(run, cut, resume_at, nan_at if nan_at and nan_at > (cut if resume_at is None else resume_at) else None)
    again = read_columns(run)
    fresh_run = run.parent / "fresh"
    shutil.copytree(run, fresh_run)  # another folder: another database and copy, built from nothing
    fresh = read_columns(fresh_run)
    for a, b in zip(again, fresh):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("resume", [False, True], ids=["grown", "resumed"])
def test_the_findings_of_a_grown_run_equal_a_fresh_audits(tmp_path, resume):
    run = tmp_path / "run"
    write_live_run(run, 30, close=False, roll_steps=PART_STEPS)
    audit(run)
    grow(run, 30, 20 if resume else None, nan_at=45)
    again = audit(run)
    shutil.copytree(run, tmp_path / "fresh")
    fresh = audit(tmp_path / "fresh")
    assert any(f["code"] == "LOOP-05" and f["severity"] == "fail" and f["step"] == 45 for f in again["findings"])
    assert comparable(again) == comparable(fresh)


def test_only_the_open_ranges_are_read_again(tmp_path, monkeypatch):
    run = tmp_path / "run"
    write_live_run(run, 40, close=False, roll_steps=PART_STEPS)
    read_columns(run)
    state = json.loads((database_dir(run) / gradient_columns.CarriedCopy.STATE).read_text())
    assert state["rows"] == 35 and len(state["closed"]) == 7  # 5 ranges of 7 steps; parts 1-35 inside them
    write_live_run(run, 10, first_step=41, header=False, roll_steps=PART_STEPS)
    read = []
    original = gradient_columns._parts

    def parts(*args, **kwargs):
        for next_row, file, part in original(*args, **kwargs):
            read.append(file)
            yield next_row, file, part

    monkeypatch.setattr(gradient_columns, "_parts", parts)
    read_columns(run)
    assert [f.rsplit("/", 1)[1] for f in read] == [
        "part-000000036.parquet",
        "part-000000041.parquet",
        "part-000000046.parquet",
    ]


def test_a_part_rewritten_in_a_closed_range_builds_the_copy_again(tmp_path):
    run = tmp_path / "run"
    write_live_run(run, 40, close=False, roll_steps=PART_STEPS)
    read_columns(run)
    part = next((run / "sftaudit" / "series" / "grad_norms" / "rank=0" / "seg=0").glob("part-000000006.parquet"))
    import pyarrow.parquet as pq

    table = pq.read_table(part)
    norms = table.column("norm").to_numpy().copy()
    norms[0] *= 3
    pq.write_table(table.set_column(table.schema.get_field_index("norm"), "norm", [norms]), part)
    again = read_columns(run)
    shutil.copytree(run, tmp_path / "fresh")
    fresh = read_columns(tmp_path / "fresh")
    for a, b in zip(again, fresh):
        np.testing.assert_array_equal(a, b)


def test_a_run_of_few_tensors_closes_ranges_of_at_most_range_steps(tmp_path, monkeypatch):
    """Ranges are sized by norms (STEP_VALUES) but capped in steps: a run of few tensors still closes, and carries,
    a range every RANGE_STEPS steps instead of one range of hundreds of thousands."""
    monkeypatch.setattr(gradient_columns, "STEP_VALUES", 1 << 20)
    monkeypatch.setattr(gradient_columns, "RANGE_STEPS", RANGE_STEPS)
    run = tmp_path / "run"
    write_live_run(run, 40, close=False, roll_steps=PART_STEPS)
    read_columns(run)
    state = json.loads((database_dir(run) / gradient_columns.CarriedCopy.STATE).read_text())
    assert state["rows"] == 35  # 5 ranges of 7 steps closed, not one open range of every step
