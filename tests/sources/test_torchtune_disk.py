"""The torchtune DiskLogger source: ``log_<time>.txt`` lines ``Step N | k:v ...`` and the recipe's saved config; the
real runs are logs torchtune 0.6.1's own DiskLogger wrote (``fixtures/trackers/data/torchtune_disk/``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from sftaudit.imports.sources import source_files
from sftaudit.imports.sources.torchtune_disk import TorchtuneDiskLog

from . import EXAMPLE_STEPS, FIRST_NAN_STEP, assert_variants_judged, audited, example_loss, tracker_run

CONFIG = """output_dir: /tmp/run
batch_size: 4
epochs: 1
max_steps_per_epoch: 10
optimizer:
  _component_: torch.optim.AdamW
  lr: 1.0e-4
lr_scheduler:
  num_warmup_steps: 2
log_every_n_steps: 1
save_every_n_steps: ${output_dir}
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: ${output_dir}/logs
"""


def write_log(folder: Path, lines: list[str], started: int = 1700000000) -> Path:
    """A log as DiskLogger writes it (``Step <step> | k:v k:v `` per line) under output_dir/logs/."""
    path = folder / "logs" / f"log_{started}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def write_example(folder: Path) -> list[Path]:
    """The registry's contract run, as a recipe logs it, with its saved config and a validation at step 5."""
    lines = []
    for s in EXAMPLE_STEPS:
        lines.append(f"Step {s} | loss:{example_loss(s)} lr:0.0001 tokens_per_second_per_gpu:2048.0 ")
        if s == 5:
            lines.append("Step 5 | val_loss:1.5 ")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "torchtune_config.yaml").write_text(CONFIG, encoding="utf-8")
    return [write_log(folder, lines)]


def test_lines_are_entries_and_the_config_is_the_plan(tmp_path):
    (path,) = write_example(tmp_path)
    log = TorchtuneDiskLog().read([path], tmp_path)
    (entries,) = log.segments
    assert entries[0] == {"step": 1, "loss": 1.875, "learning_rate": 1e-4, "tokens_per_second_per_gpu": 2048.0}
    assert entries[5] == {"step": 5, "eval_loss": 1.5} and log.records == 11
    # The interpolation left as written is no number; max_steps_per_epoch is no planned length.
    plan = {"num_train_epochs": 1, "learning_rate": 1e-4, "warmup_steps": 2, "train_batch_size": 4, "logging_steps": 1}
    assert log.plan == plan and log.ignored == {"save_steps": "'${output_dir}'"}
    assert set(log.lacks) == {"grad_norm", "planned_length"}


def test_bad_lines_are_counted_and_logs_are_starts_in_time_order(tmp_path):
    write_log(tmp_path, ["Step 6 | loss:1.0 ", "Step 7 | loss:0.9 "], started=1700000500)
    path = write_log(
        tmp_path, ["Step 1 | loss:2.0 ", "Traceback (most recent call last):", "Step 2 | loss:nan ", "Step 3 | lo"]
    )
    log = TorchtuneDiskLog().read(source_files(TorchtuneDiskLog(), tmp_path), tmp_path)
    assert [[e["step"] for e in seg] for seg in log.segments] == [[1, 2], [6, 7]]
    assert log.skipped == [{"file": str(path.relative_to(tmp_path)), "lines": 1, "of": 4}]
    assert math.isnan(log.segments[0][1]["loss"])


def test_a_text_log_of_another_kind_is_not_torchtunes(tmp_path):
    (tmp_path / "log_1.txt").write_text("Step 1 of 10: loss=2.0\n", encoding="utf-8")
    assert not TorchtuneDiskLog().detect(tmp_path / "log_1.txt")


def test_the_real_runs_read_as_torchtune_wrote_them(tmp_path):
    run = tracker_run("torchtune_disk", "nan_loss", tmp_path)
    log = TorchtuneDiskLog().read(source_files(TorchtuneDiskLog(), run), run)
    train = [e for e in log.segments[0] if "loss" in e]
    assert [e["step"] for e in train] == list(range(1, 61)) and len(log.segments[0]) == 63
    assert [e["step"] for e in train if math.isnan(e["loss"])][0] == FIRST_NAN_STEP and "grad_norm" in train[0]
    assert log.plan["learning_rate"] == 2e-5 and log.plan["warmup_steps"] == 6 and "max_steps" not in log.plan


@pytest.mark.slow
def test_the_real_runs_are_judged(tmp_path):
    verdicts = {v: audited(tracker_run("torchtune_disk", v, tmp_path)) for v in ("clean", "nan_loss", "lr_x100")}
    assert_variants_judged(verdicts)
