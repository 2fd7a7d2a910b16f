"""The Lightning CSVLogger source: ``metrics.csv`` read at the Trainer's step (Lightning's + 1), ``hparams.yaml`` as
the plan; the real runs are real ``Trainer.fit`` runs of lightning 2.6 (``fixtures/trackers/data/lightning_csv/``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from sftaudit.imports.sources import source_files
from sftaudit.imports.sources.lightning_csv import LightningCsvLog

from . import EXAMPLE_STEPS, FIRST_NAN_STEP, assert_variants_judged, audited, example_loss, tracker_run


def write_version(folder: Path, rows: list[dict], hparams: str = "", version: int = 0) -> Path:
    """A version folder as CSVLogger writes it: a sorted header of every key with epoch and step, empty cells."""
    out = folder / "lightning_logs" / f"version_{version}"
    out.mkdir(parents=True)
    keys = sorted({k for r in rows for k in r} | {"epoch", "step"})
    lines = [",".join(keys)] + [",".join(str(r.get(k, "")) for k in keys) for r in rows]
    (out / "metrics.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "hparams.yaml").write_text(hparams, encoding="utf-8")
    return out / "metrics.csv"


def write_example(folder: Path) -> list[Path]:
    """The registry's contract run: per update, LearningRateMonitor's row then the module's, at Lightning's step
    (the updates done before the batch); a validation after update 5."""
    rows = []
    for s in EXAMPLE_STEPS:
        rows += [{"lr-AdamW": 1e-4, "step": s - 1}, {"train_loss": example_loss(s), "epoch": 0, "step": s - 1}]
        if s == 5:
            rows.append({"val_loss": 1.5, "epoch": 0, "step": s - 1})
    return [write_version(folder, rows, "lr: 0.0001\nmax_steps: 10\nbatch_size: 4\n")]


def test_rows_are_read_at_the_trainers_step_with_the_plan_from_hparams(tmp_path):
    (path,) = write_example(tmp_path)
    log = LightningCsvLog().read([path], tmp_path)
    (entries,) = log.segments
    assert entries[0] == {"step": 1, "learning_rate": 1e-4, "loss": example_loss(1)}
    assert entries[5] == {"step": 5, "eval_loss": 1.5} and len(entries) == 11
    assert log.plan == {"learning_rate": 1e-4, "max_steps": 10, "train_batch_size": 4} and "grad_norm" in log.lacks


def test_bad_rows_are_counted_and_versions_are_starts_in_order(tmp_path):
    write_version(tmp_path, [{"loss": 1.0, "step": 5}, {"loss": 0.9, "step": 6}], version=10)
    path = write_version(tmp_path, [{"loss": 2.0, "step": 0}, {"loss": 1.9, "step": 1}], version=2)
    path.write_text(path.read_text(encoding="utf-8") + "x,1\n0,nan,7\n0,1.8,", encoding="utf-8")
    log = LightningCsvLog().read(source_files(LightningCsvLog(), tmp_path), tmp_path)
    assert [[e["step"] for e in seg] for seg in log.segments] == [[1, 2, 8], [6, 7]]  # version 2, then 10
    assert log.skipped == [{"file": str(path.relative_to(tmp_path)), "lines": 1, "of": 5}]  # torn last row: no skip
    assert math.isnan(log.segments[0][2]["loss"])


def test_a_csv_of_another_tool_is_not_lightnings(tmp_path):
    (tmp_path / "metrics.csv").write_text("epoch,loss,accuracy\n0,1.0,0.5\n", encoding="utf-8")
    assert not LightningCsvLog().detect(tmp_path / "metrics.csv")


def test_the_real_runs_read_as_lightning_wrote_them(tmp_path):
    run = tracker_run("lightning_csv", "nan_loss", tmp_path)
    log = LightningCsvLog().read(source_files(LightningCsvLog(), run), run)
    train = [e for e in log.segments[0] if "loss" in e]
    assert [e["step"] for e in train] == list(range(1, 61)) and len(log.segments[0]) == 63
    assert [e["step"] for e in train if math.isnan(e["loss"])][0] == FIRST_NAN_STEP
    assert train[0]["learning_rate"] == pytest.approx(2e-5 / 6) and "grad_norm" in train[0]
    assert log.plan == {"max_steps": 60, "num_train_epochs": 1, "warmup_steps": 6, "learning_rate": 2e-5}


@pytest.mark.slow
def test_the_real_runs_are_judged(tmp_path):
    verdicts = {v: audited(tracker_run("lightning_csv", v, tmp_path)) for v in ("clean", "nan_loss", "lr_x100")}
    assert_variants_judged(verdicts)
