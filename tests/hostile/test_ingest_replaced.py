"""Ingest never trusts stale offsets, and reads only bounded regular files inside the run folder."""

import json
import os
import shutil
import subprocess
import sys
import time

import duckdb
import pytest

from sftaudit.core.artifacts import rank_dir
from sftaudit.errors import InputError
from sftaudit.store.ingest import ingest
from sftaudit.store.rundb import connect, database_path
from sftaudit.verdict.audit import audit
from sftaudit.verdict.config import AuditConfig


def copy_run(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("audit.duckdb*"))
    return dst


def replace_artifacts(src, run):
    """A re-run into the same folder: every artifact file is a new file (new inode) with other content."""
    for f in rank_dir(src, 0).iterdir():
        tmp = rank_dir(run, 0) / (f.name + ".new")
        shutil.copy(f, tmp)
        os.replace(tmp, rank_dir(run, 0) / f.name)


def test_artifacts_replaced_by_a_rerun_are_ingested_from_scratch(clean_run, nan_run, tmp_path):
    run = copy_run(clean_run, tmp_path / "run")
    assert audit(run)["verdict"] in ("pass", "warn")
    replace_artifacts(nan_run, run)  # the NaN run's files: fewer steps, so every old offset is past their ends
    verdict = audit(run)
    assert verdict["verdict"] == "fail" and verdict["first_anomalous_step"] == 13
    con = duckdb.connect(str(database_path(run)), read_only=True)
    assert con.execute("SELECT count(*), max(step) FROM steps").fetchone() == (20, 20)


def test_a_file_rewritten_in_place_is_noticed(nan_run, tmp_path):
    """Same inode, same length or longer: only the first block's hash tells the file changed."""
    run = copy_run(nan_run, tmp_path / "run")
    ingest(run)
    steps = rank_dir(run, 0) / "steps.jsonl"
    data = steps.read_bytes()
    with open(steps, "r+b") as f:  # step 1's record now claims step 0 (same length): stale rows otherwise
        f.write(data.replace(b'"step":1,', b'"step":0,', 1))
    ingest(run)
    con = duckdb.connect(str(database_path(run)), read_only=True)
    assert con.execute("SELECT list(step ORDER BY step)[1:3] FROM steps").fetchone()[0] == [0, 2, 3]


def test_rows_deleted_from_the_database_are_rebuilt(nan_run, tmp_path):
    run = copy_run(nan_run, tmp_path / "run")
    ingest(run)
    con = duckdb.connect(str(database_path(run)))
    for table in ("steps", "grad_rows", "batches"):  # the norms' parts are read in place: only copies can go
        con.execute(f"DELETE FROM {table} WHERE step >= 13")  # the NaN steps gone
    con.close()
    verdict = audit(run)
    assert verdict["verdict"] == "fail" and verdict["first_anomalous_step"] == 13


def test_a_database_that_is_not_duckdb_is_rebuilt(clean_run, tmp_path):
    """The run's database is sftaudit's own, in its cache: one that is no DuckDB file is made again."""
    run = copy_run(clean_run, tmp_path / "run")
    database_path(run).parent.mkdir(parents=True)
    database_path(run).write_bytes(b"not a database" * 100)
    with pytest.raises(InputError, match="is no DuckDB database; run `sftaudit ingest"):
        connect(run, read_only=True)
    assert ingest(run)["steps"] == 30


def run_cli(*args, timeout=300):  # a hang guard: a loaded machine takes a minute to start the CLI
    return subprocess.run(
        [sys.executable, "-m", "sftaudit.cli", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda p: os.mkfifo(p), "not a regular file"),
        (lambda p: os.symlink("/dev/zero", p), "outside the run folder"),
        (lambda p: os.symlink("/etc/passwd", p), "outside the run folder"),
        (lambda p: os.symlink("../../../../..", p), "outside the run folder"),
        (lambda p: p.mkdir(), "not a regular file"),
    ],
)
def test_an_artifact_that_is_not_a_plain_file_inside_the_run_is_refused_fast(clean_run, tmp_path, make, reason):
    run = copy_run(clean_run, tmp_path / "run")
    steps = rank_dir(run, 0) / "steps.jsonl"
    steps.unlink()
    make(steps)
    start = time.monotonic()
    result = run_cli("audit", run, "--no-report", "--out", tmp_path / "out")
    assert time.monotonic() - start < 300
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and reason in result.stderr, result.stderr
    assert "steps.jsonl" in result.stderr and "Traceback" not in result.stderr


def test_a_symlink_inside_the_run_folder_is_followed(clean_run, tmp_path):
    run = copy_run(clean_run, tmp_path / "run")
    steps = rank_dir(run, 0) / "steps.jsonl"
    os.replace(steps, run / "kept-steps.jsonl")
    os.symlink("../../kept-steps.jsonl", steps)
    assert ingest(run)["steps"] == 30


def test_records_and_files_over_the_limits(clean_run, tmp_path):
    run = copy_run(clean_run, tmp_path / "run")
    samples = rank_dir(run, 0) / "samples.jsonl"
    rows = len(samples.read_bytes().splitlines())
    with open(samples, "ab") as f:  # one 3 MB record: over a 1 MB per-record limit, refused as a bad line
        f.write(b'{"seg": 0, "step": 1, "micro": 0, "row": 9, "input_ids": [' + b"1, " * 2**20 + b"1]}\n")
    verdict = audit(run, AuditConfig(max_record_bytes=2**20, max_missing_share=1.0))
    assert {"file": "rank-0/samples.jsonl", "lines": 1, "of": rows + 1} in verdict["evidence"]["bad_lines"]
    with pytest.raises(InputError, match=r"samples.jsonl: \d+ bytes, over the 100000-byte limit per artifact file"):
        ingest(copy_run(clean_run, tmp_path / "run2"), max_file_bytes=100_000)


def test_a_huge_torn_tail_is_read_past_in_bounded_blocks(clean_run, tmp_path):
    """A 256 MB run of NUL bytes without a newline (a sparse file) is one bad line, not a read of it whole."""
    run = copy_run(clean_run, tmp_path / "run")
    events = rank_dir(run, 0) / "events.jsonl"
    with open(events, "ab") as f:
        f.truncate(events.stat().st_size + 256 * 2**20)
    verdict = audit(run, AuditConfig(max_record_bytes=2**20))
    assert verdict["verdict"] == "unjudged"
    assert [b for b in verdict["evidence"]["bad_lines"] if b["file"] == "rank-0/events.jsonl"][0]["lines"] == 1
    assert json.loads(json.dumps(verdict))  # the verdict stays plain JSON
