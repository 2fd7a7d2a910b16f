"""The Trackio source: a project's ``<project>.db`` read with sqlite3 (read-only), one JSON object per log call; the
real runs are databases trackio 0.43 wrote (``fixtures/trackers/data/trackio_db/``, gzipped)."""

from __future__ import annotations

import json
import math
import shutil
import sqlite3
from pathlib import Path

import pytest

from sftaudit.imports.sources import source_files
from sftaudit.imports.sources.trackio_db import TrackioDatabase

from . import EXAMPLE_STEPS, FIRST_NAN_STEP, assert_variants_judged, audited, example_loss, tracker_run


def write_example(folder: Path) -> list[Path]:
    """The registry's contract run in a database trackio made (the committed clean run's, its rows replaced), as the
    Trainer's TrackioCallback logs it: no step given, so trackio's step counts log calls."""
    real = tracker_run("trackio_db", "clean", folder.parent / f"{folder.name}-source") / "trackio"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sftaudit-fixtures.db"
    shutil.move(real / "sftaudit-fixtures.db", path)
    db = sqlite3.connect(path)
    run_id, name = db.execute("SELECT run_id, run_name FROM configs").fetchone()
    db.execute("DELETE FROM metrics")
    logs = [{"train/loss": example_loss(s), "train/learning_rate": 1e-4, "train/global_step": s} for s in EXAMPLE_STEPS]
    logs.insert(5, {"eval/loss": 1.5, "train/global_step": 5})
    db.executemany(
        "INSERT INTO metrics (run_id, timestamp, run_name, step, metrics) VALUES (?, '2024-01-01T00:00:00', ?, ?, ?)",
        [(run_id, name, n, json.dumps(m).encode()) for n, m in enumerate(logs)],  # trackio stores bytes
    )
    db.commit()
    db.close()
    return [path]


def test_the_series_is_keyed_on_the_global_step_and_nan_strings_are_nan(tmp_path):
    (path,) = write_example(tmp_path)
    db = sqlite3.connect(path)
    db.execute("""UPDATE metrics SET metrics = '{"train/loss": "NaN", "train/global_step": 3}' WHERE step = 2""")
    db.commit()
    db.close()
    log = TrackioDatabase().read([path], tmp_path)
    (entries,) = log.segments
    assert [e["step"] for e in entries if "loss" in e] == list(EXAMPLE_STEPS) and {
        "step": 5,
        "eval_loss": 1.5,
    } in entries
    assert math.isnan(entries[2]["loss"]) and log.plan["max_steps"] == 60 and log.records == 11


def test_rows_still_in_the_write_ahead_log_are_read_and_nothing_is_written(tmp_path):
    (path,) = write_example(tmp_path)
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("PRAGMA wal_autocheckpoint = 0")
    run_id, name = db.execute("SELECT run_id, run_name FROM configs").fetchone()
    db.execute(
        "INSERT INTO metrics (run_id, timestamp, run_name, step, metrics) VALUES (?, 't', ?, 11, ?)",
        (run_id, name, b'{"train/loss": 0.5, "train/global_step": 11}'),
    )
    db.commit()  # in the -wal file, not yet in the database (the connection stays open, as a running tracker's)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    log = TrackioDatabase().read([path], tmp_path)
    assert log.segments[0][-1] == {"step": 11, "loss": 0.5}
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    db.close()


def test_a_row_that_is_not_json_is_skipped_and_counted(tmp_path):
    (path,) = write_example(tmp_path)
    db = sqlite3.connect(path)
    db.execute("UPDATE metrics SET metrics = 'not json' WHERE step = 0")
    db.commit()
    db.close()
    log = TrackioDatabase().read([path], tmp_path)
    assert log.skipped == [{"file": "sftaudit-fixtures.db", "lines": 1, "of": 11}] and len(log.segments[0]) == 10


def test_the_real_runs_read_as_trackio_wrote_them(tmp_path):
    run = tracker_run("trackio_db", "nan_loss", tmp_path)
    log = TrackioDatabase().read(source_files(TrackioDatabase(), run), run)
    train = [e for e in log.segments[0] if "loss" in e]
    assert [e["step"] for e in train] == list(range(1, 61)) and len(log.segments[0]) == 63
    assert [e["step"] for e in train if math.isnan(e["loss"])][0] == FIRST_NAN_STEP
    assert log.plan["max_steps"] == 60 and log.plan["learning_rate"] == 2e-5 and not log.lacks


@pytest.mark.slow
def test_the_real_runs_are_judged(tmp_path):
    verdicts = {v: audited(tracker_run("trackio_db", v, tmp_path)) for v in ("clean", "nan_loss", "lr_x100")}
    assert_variants_judged(verdicts)
