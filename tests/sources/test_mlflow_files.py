"""The MLflow file store source: ``mlruns/<experiment>/<run>/`` read as plain text; the real runs are stores
mlflow 3.17 wrote (``fixtures/trackers/data/mlflow_file/``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from sftaudit.imports.sources import source_files
from sftaudit.imports.sources.mlflow_files import MlflowFileStore

from . import EXAMPLE_STEPS, FIRST_NAN_STEP, assert_variants_judged, audited, example_loss, tracker_run


def write_run(folder: Path, run_id: str, metrics: dict[str, list[tuple[float, int]]], params: dict, start=1000) -> Path:
    """A run of a file store as MLflow lays it out: meta.yaml, one file per metric key and per param."""
    run = folder / "mlruns" / "1" / run_id
    (run / "metrics").mkdir(parents=True)
    (run / "params").mkdir()
    (folder / "mlruns" / "1" / "meta.yaml").write_text("experiment_id: '1'\nname: demo\n", encoding="utf-8")
    (run / "meta.yaml").write_text(
        f"run_id: {run_id}\nrun_name: demo\nexperiment_id: '1'\nstatus: 3\nstart_time: {start}\n"
        "lifecycle_stage: active\n",
        encoding="utf-8",
    )
    for key, values in metrics.items():
        path = run / "metrics" / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{start + step} {value} {step}\n" for value, step in values), encoding="utf-8")
    for key, value in params.items():
        (run / "params" / key).write_text(str(value), encoding="utf-8")
    return run / "meta.yaml"


def write_example(folder: Path) -> list[Path]:
    """The registry's contract run, as the Trainer's MLflowCallback logs it."""
    metrics = {
        "loss": [(example_loss(s), s) for s in EXAMPLE_STEPS],
        "learning_rate": [(1e-4, s) for s in EXAMPLE_STEPS],
        "eval_loss": [(1.5, 5)],
    }
    return [write_run(folder, "abc", metrics, {"max_steps": 10, "learning_rate": "0.0001", "report_to": "['mlflow']"})]


def test_the_mlflow_step_is_the_global_step_and_params_are_the_plan(tmp_path):
    (path,) = write_example(tmp_path)
    log = MlflowFileStore().read([path], tmp_path)
    (entries,) = log.segments
    assert [e["step"] for e in entries] == [1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10]
    assert entries[5] == {"step": 5, "eval_loss": 1.5}
    assert log.plan == {"max_steps": 10, "learning_rate": 1e-4} and log.records == 21 and "grad_norm" in log.lacks


def test_unreadable_lines_are_counted_and_a_torn_last_line_is_not(tmp_path):
    (path,) = write_example(tmp_path)
    loss = path.parent / "metrics" / "loss"
    lines = loss.read_text(encoding="utf-8").splitlines()
    loss.write_text("\n".join(lines[:3] + ["garbage", "1 2"] + lines[3:]) + "\n1005 0.5", encoding="utf-8")
    log = MlflowFileStore().read([path], tmp_path)
    assert log.skipped == [{"file": str(loss.relative_to(tmp_path)), "lines": 2, "of": 13}]
    assert len([e for e in log.segments[0] if "loss" in e]) == 10


def test_runs_are_starts_in_start_order_and_a_deleted_run_is_passed_over(tmp_path):
    write_run(tmp_path, "later", {"loss": [(1.0, 6), (0.9, 7)]}, {}, start=2000)
    write_run(tmp_path, "first", {"loss": [(2.0, 1), (1.5, 2)]}, {}, start=1000)
    gone = write_run(tmp_path, "gone", {"loss": [(9.0, 1)]}, {}, start=3000)
    gone.write_text(gone.read_text(encoding="utf-8").replace("active", "deleted"), encoding="utf-8")
    log = MlflowFileStore().read(source_files(MlflowFileStore(), tmp_path), tmp_path)
    assert [[e["step"] for e in seg] for seg in log.segments] == [[1, 2], [6, 7]]


def test_the_real_runs_read_as_mlflow_wrote_them(tmp_path):
    run = tracker_run("mlflow_file", "nan_loss", tmp_path)
    log = MlflowFileStore().read(source_files(MlflowFileStore(), run), run)
    train = [e for e in log.segments[0] if "loss" in e]
    assert [e["step"] for e in train] == list(range(1, 61)) and len(log.segments[0]) == 63
    assert [e["step"] for e in train if math.isnan(e["loss"])][0] == FIRST_NAN_STEP
    assert log.plan["max_steps"] == 60 and log.plan["learning_rate"] == 2e-5 and not log.lacks
    assert log.identity["runs"][0]["status"] == "FINISHED"


@pytest.mark.slow
def test_the_real_runs_are_judged(tmp_path):
    assert_variants_judged(
        {v: audited(tracker_run("mlflow_file", v, tmp_path)) for v in ("clean", "nan_loss", "lr_x100")}
    )
