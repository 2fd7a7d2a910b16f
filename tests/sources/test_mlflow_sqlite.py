"""The MLflow database source: ``mlflow.db`` read with sqlite3, read-only and immutable; the real runs are databases
mlflow 3.17 wrote (``fixtures/trackers/data/mlflow_sqlite/``, gzipped)."""

from __future__ import annotations

import math
import sqlite3
import sys
from pathlib import Path

import pytest

from sftaudit.imports.sources import source_files
from sftaudit.imports.sources.mlflow_sqlite import MlflowDatabase

from . import EXAMPLE_STEPS, FIRST_NAN_STEP, assert_variants_judged, audited, example_loss, tracker_run


def write_example(folder: Path) -> list[Path]:
    """The registry's contract run in a database mlflow made (the committed clean run's, its values replaced), as
    the Trainer's MLflowCallback logs it."""
    real = tracker_run("mlflow_sqlite", "clean", folder.parent / f"{folder.name}-source") / "mlflow.db"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "mlflow.db"
    real.rename(path)
    db = sqlite3.connect(path)
    (run,) = db.execute("SELECT run_uuid FROM runs").fetchone()
    db.execute("DELETE FROM metrics")
    db.execute("DELETE FROM params")
    rows = [("loss", example_loss(s), 1000 + s, run, s, False) for s in EXAMPLE_STEPS]
    rows += [("learning_rate", 1e-4, 1000 + s, run, s, False) for s in EXAMPLE_STEPS]
    rows += [("eval_loss", 1.5, 1005, run, 5, False)]
    db.executemany("INSERT INTO metrics (key, value, timestamp, run_uuid, step, is_nan) VALUES (?,?,?,?,?,?)", rows)
    db.executemany("INSERT INTO params (key, value, run_uuid) VALUES (?,?,?)", [("max_steps", "10", run)])
    db.commit()
    db.close()
    return [path]


def test_nan_and_inf_come_back_as_logged(tmp_path):
    (path,) = write_example(tmp_path)
    db = sqlite3.connect(path)
    (run,) = db.execute("SELECT run_uuid FROM runs").fetchone()
    db.execute("UPDATE metrics SET value = 0.0, is_nan = 1 WHERE key = 'loss' AND step = 3")
    db.execute("UPDATE metrics SET value = ? WHERE key = 'loss' AND step = 4", (sys.float_info.max,))
    db.execute("UPDATE metrics SET value = ? WHERE key = 'loss' AND step = 5", (-sys.float_info.max,))
    db.commit()
    db.close()
    log = MlflowDatabase().read([path], tmp_path)
    losses = {e["step"]: e["loss"] for e in log.segments[0] if "loss" in e}
    assert math.isnan(losses[3]) and losses[4] == math.inf and losses[5] == -math.inf and losses[6] == 1.25
    assert log.plan == {"max_steps": 10} and log.records == 21


def test_the_database_is_never_written_and_other_databases_are_not_mlflows(tmp_path):
    (path,) = write_example(tmp_path)
    before = path.read_bytes()
    MlflowDatabase().read([path], tmp_path)
    assert path.read_bytes() == before and not list(tmp_path.glob("mlflow.db-*"))  # no journal either
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE metrics (x)").connection.close()
    (tmp_path / "text.db").write_text("SQLite format 3\0 but not really", encoding="utf-8")
    assert not MlflowDatabase().detect(other) and not MlflowDatabase().detect(tmp_path / "text.db")


def test_the_real_runs_read_as_mlflow_wrote_them(tmp_path):
    run = tracker_run("mlflow_sqlite", "nan_loss", tmp_path)
    log = MlflowDatabase().read(source_files(MlflowDatabase(), run), run)
    train = [e for e in log.segments[0] if "loss" in e]
    assert [e["step"] for e in train] == list(range(1, 61)) and len(log.segments[0]) == 63
    assert [e["step"] for e in train if math.isnan(e["loss"])][0] == FIRST_NAN_STEP
    assert log.plan["max_steps"] == 60 and log.plan["learning_rate"] == 2e-5 and not log.lacks


@pytest.mark.slow
def test_the_real_runs_are_judged(tmp_path):
    verdicts = {v: audited(tracker_run("mlflow_sqlite", v, tmp_path)) for v in ("clean", "nan_loss", "lr_x100")}
    assert_variants_judged(verdicts)
