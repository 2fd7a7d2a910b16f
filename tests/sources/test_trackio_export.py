"""The Trackio Parquet export source: ``<project>.parquet`` and its ``_configs.parquet``; the real exports are
trackio 0.43's (``fixtures/trackers/data/trackio_db/``)."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sftaudit.imports.sources import source_files
from sftaudit.imports.sources.trackio_export import TrackioExport

from . import EXAMPLE_STEPS, FIRST_NAN_STEP, assert_variants_judged, audited, example_loss, tracker_run


def write_example(folder: Path) -> list[Path]:
    """The registry's contract run as trackio exports it: the table's own columns, one column per logged key."""
    logs = [{"train/loss": example_loss(s), "train/learning_rate": 1e-4, "train/global_step": s} for s in EXAMPLE_STEPS]
    logs.insert(5, {"eval/loss": 1.5, "train/global_step": 5})
    n = len(logs)
    columns = {
        "id": pa.array(range(1, n + 1), pa.int64()),
        "run_id": ["r1"] * n,
        "timestamp": ["2024-01-01T00:00:00+00:00"] * n,
        "run_name": ["demo"] * n,
        "step": pa.array(range(n), pa.int64()),
        "log_id": [f"l{i}" for i in range(n)],
        "space_id": pa.nulls(n),
    }
    for key in ("train/loss", "train/learning_rate", "eval/loss"):
        columns[key] = pa.array([log.get(key) for log in logs], pa.float64())
    columns["train/global_step"] = pa.array([log["train/global_step"] for log in logs], pa.int64())
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), folder / "demo-project.parquet")
    config = {
        "id": [1],
        "run_id": ["r1"],
        "run_name": ["demo"],
        "created_at": ["t"],
        "max_steps": [10],
        "_Created": ["t"],
    }
    pq.write_table(pa.table(config), folder / "demo-project_configs.parquet")
    return [folder / "demo-project.parquet"]


def test_the_export_is_keyed_on_the_global_step_with_its_configs_as_the_plan(tmp_path):
    (path,) = write_example(tmp_path)
    log = TrackioExport().read([path], tmp_path)
    (entries,) = log.segments
    assert [e["step"] for e in entries if "loss" in e] == list(EXAMPLE_STEPS) and {
        "step": 5,
        "eval_loss": 1.5,
    } in entries
    assert log.plan == {"max_steps": 10} and log.records == 11 and "grad_norm" in log.lacks
    assert not TrackioExport().detect(tmp_path / "demo-project_configs.parquet")


def test_the_real_exports_read_as_trackio_wrote_them(tmp_path):
    run = tracker_run("trackio_db", "nan_loss", tmp_path)
    log = TrackioExport().read(source_files(TrackioExport(), run), run)
    train = [e for e in log.segments[0] if "loss" in e]
    assert [e["step"] for e in train] == list(range(1, 61)) and len(log.segments[0]) == 63
    assert [e["step"] for e in train if math.isnan(e["loss"])][0] == FIRST_NAN_STEP
    assert log.plan["max_steps"] == 60 and log.plan["learning_rate"] == 2e-5 and not log.lacks


@pytest.mark.slow
def test_the_real_exports_are_judged(tmp_path):
    verdicts = {}
    for variant in ("clean", "nan_loss", "lr_x100"):
        run = tracker_run("trackio_db", variant, tmp_path)
        (run / "trackio" / "sftaudit-fixtures.db").unlink()  # the export alone
        verdicts[variant] = audited(run)
    assert_variants_judged(verdicts)
