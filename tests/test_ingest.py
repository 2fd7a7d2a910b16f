"""Incremental ingest, torn and corrupt lines."""

import shutil

from sftaudit.core.artifacts import rank_dir
from sftaudit.store.ingest import ingest
from sftaudit.store.rundb import connect


def copy_run(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("audit.duckdb*", "checkpoint-*"))
    return dst


def test_second_ingest_adds_only_new_records(clean_run, tmp_path):
    run = copy_run(clean_run, tmp_path / "run")
    steps = rank_dir(run, 0) / "steps.jsonl"
    lines = steps.read_bytes().splitlines(keepends=True)
    steps.write_bytes(b"".join(lines[:10]) + lines[10][:25])  # ten steps and a torn eleventh
    added = ingest(run)
    assert added["steps"] == 10
    steps.write_bytes(b"".join(lines))  # the run went on: the torn line completed, more appended
    added = ingest(run)
    assert added["steps"] == 20 and added["batches"] == 0
    assert ingest(run)["steps"] == 0
    con = connect(run, read_only=True)
    assert con.execute("SELECT count(*), count(DISTINCT step) FROM steps").fetchall() == [(30, 30)]
    assert con.execute("SELECT count(DISTINCT step) FROM grad_norms").fetchall() == [(30,)]


def test_corrupt_line_is_skipped_and_counted(clean_run, tmp_path):
    run = copy_run(clean_run, tmp_path / "run")
    steps = rank_dir(run, 0) / "steps.jsonl"
    lines = steps.read_bytes().splitlines(keepends=True)
    lines[5] = b'{"seg": 0, "step": 6, "loss": \x00garbage\n'
    steps.write_bytes(b"".join(lines))
    assert ingest(run)["steps"] == 29
    con = connect(run, read_only=True)
    assert con.execute("SELECT bad_lines FROM ingest_state WHERE file LIKE '%steps.jsonl'").fetchall() == [(1,)]


def test_a_database_ingested_by_an_older_sftaudit_gains_the_newer_fields(resumed_run, tmp_path):
    """Re-auditing a resumed run whose audit.duckdb predates a new record field (here LOOP-16's mask and
    cache fields): the superseded copies of the timeline tables gain it too, instead of a binder error."""
    run = tmp_path / "run"
    shutil.copytree(resumed_run, run, ignore=shutil.ignore_patterns("checkpoint-*"))
    ingest(run)
    con = connect(run)
    for table in ("batches", "superseded_batches"):
        con.execute(f"ALTER TABLE {table} DROP COLUMN cache_built")
    con.close()
    ingest(run)
    con = connect(run, read_only=True)
    assert con.execute("SELECT count(*) FROM superseded_batches WHERE cache_built IS NOT NULL").fetchone()[0] == 0
    assert "cache_built" in {
        c
        for (c,) in con.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'superseded_batches'"
        ).fetchall()
    }
