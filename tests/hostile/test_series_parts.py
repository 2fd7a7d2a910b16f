"""Hostile gradient-norm parts (the columnar series is read in place, so each new part is checked
first): not Parquet, Parquet of another schema, a torn footer, a FIFO, a link out of the run.
Each is refused with one line naming the file, exit 2, before DuckDB scans it."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sftaudit.core.artifacts import SCHEMA_VERSION, rank_dir, series_dir
from sftaudit.shim.writer import JsonlWriter
from sftaudit.store.ingest import ingest

from .builders import audit


def _run(tmp_path: Path) -> tuple[Path, Path]:
    run = tmp_path / "run"
    w = JsonlWriter(rank_dir(run, 0), roll_steps=5)
    params = [
        {"name": f"w{i}", "shape": [4], "dtype": "torch.float32", "numel": 4, "requires_grad": True} for i in range(3)
    ]
    w.write(
        "manifest",
        {"seg": 0, "schema_version": SCHEMA_VERSION, "rank": 0, "world_size": 1, "params": params, "tied": {}},
    )
    for s in range(1, 11):
        w.write("steps", {"seg": 0, "step": s, "loss": 1.0, "grad_norm": 1.0, "grad_norms": [1.0 + s, 2.0, 3.0]})
    w.close()
    return run, series_dir(run, 0, 0) / "part-000000006.parquet"


def _refused(run: Path, text: str) -> None:
    done = audit(run)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "part-000000006.parquet" in lines[0] and text in lines[0], done.stderr


def _wrong_schema(path: Path) -> None:
    pq.write_table(
        pa.table(
            {"step": pa.array([6], pa.int64()), "idx": pa.array([0], pa.int32()), "norm": pa.array(["x"], pa.string())}
        ),
        path,
    )


@pytest.mark.parametrize(
    "plant, text",
    [
        (lambda p: p.write_bytes(b"not parquet at all\n" * 10), "not a Parquet file"),
        (lambda p: p.write_bytes(b"PAR1" + b"\x00" * 64 + b"PAR1"), "not a readable Parquet part"),
        (_wrong_schema, "not a gradient-norm part"),
        (lambda p: os.mkfifo(p), "not a regular file"),
        (lambda p: os.symlink("/etc/passwd", p), "outside the run folder"),
    ],
    ids=["garbage", "torn-footer", "other-schema", "fifo", "link-out"],
)
def test_a_hostile_part_is_refused_with_one_line(tmp_path, plant, text):
    run, part = _run(tmp_path)
    part.unlink()
    plant(part)
    _refused(run, text)


def test_a_part_replaced_after_an_audit_is_checked_again(tmp_path):
    run, part = _run(tmp_path)
    ingest(run)  # the part was read once (this minimal run has no batches: an audit would be unjudged anyway)
    part.unlink()
    part.write_bytes(b"PAR1" + b"\xff" * 64 + b"PAR1")
    _refused(run, "not a readable Parquet part")
