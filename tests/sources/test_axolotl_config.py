"""The axolotl source: the run's config (or the copy in its model card) as the plan, the Trainer states of the
output_dir it names as the log; the real runs are configs axolotl 0.19's schema validates, beside the Trainer states
of their output_dir (``fixtures/trackers/data/axolotl_config/``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from sftaudit.imports.sources import source_files
from sftaudit.imports.sources.axolotl_config import AxolotlConfig

from . import EXAMPLE_STEPS, FIRST_NAN_STEP, assert_variants_judged, audited, example_loss, tracker_run

CONFIG = """base_model: HuggingFaceTB/SmolLM2-135M
datasets:
  - path: ./data/sft.jsonl
    type: chat_template
output_dir: ./outputs
micro_batch_size: 2
num_epochs: 1
max_steps: {max_steps}
learning_rate: 1e-4
save_steps: 5
"""


def write_state(folder: Path, steps: range) -> Path:
    """A checkpoint's trainer_state.json as the Trainer writes it."""
    history = [{"epoch": s / 10, "learning_rate": 1e-4, "loss": example_loss(s), "step": s} for s in steps]
    state = {"global_step": steps[-1], "log_history": history, "max_steps": 10, "logging_steps": 1}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trainer_state.json").write_text(json.dumps(state), encoding="utf-8")
    return folder / "trainer_state.json"


def write_example(folder: Path, max_steps: int = 10) -> list[Path]:
    """The registry's contract run: the config beside its output_dir, whose checkpoints hold the Trainer's states."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yml").write_text(CONFIG.format(max_steps=max_steps), encoding="utf-8")
    write_state(folder / "outputs" / "checkpoint-5", range(1, 6))
    write_state(folder / "outputs" / "checkpoint-10", EXAMPLE_STEPS)
    return [folder / "config.yml"]


def test_the_config_is_the_plan_and_the_newest_checkpoint_the_log(tmp_path):
    (path,) = write_example(tmp_path)
    log = AxolotlConfig().read([path], tmp_path)
    assert [e["step"] for e in log.segments[0]] == list(EXAMPLE_STEPS)
    # learning_rate 1e-4 is text to PyYAML (no dot): read as the number axolotl makes of it.
    assert log.plan == {
        "max_steps": 10,
        "num_train_epochs": 1,
        "learning_rate": 1e-4,
        "save_steps": 5,
        "train_batch_size": 2,
    }
    assert not log.lacks  # the last checkpoint is at the planned end


def test_a_run_planned_past_its_last_checkpoint_says_its_end_is_unknown(tmp_path):
    (path,) = write_example(tmp_path, max_steps=12)
    assert "after the last checkpoint (step 10)" in AxolotlConfig().read([path], tmp_path).lacks["log_end"]


def test_the_model_card_holds_the_config_and_other_yaml_is_not_axolotls(tmp_path):
    run = tracker_run("axolotl_config", "clean", tmp_path)
    card = run / "outputs" / "README.md"
    assert AxolotlConfig().detect(card) and AxolotlConfig().read([card], run).plan["max_steps"] == 60
    (tmp_path / "other.yaml").write_text("base_model: x\nlr: 1\n", encoding="utf-8")
    assert not AxolotlConfig().detect(tmp_path / "other.yaml")


def test_an_output_dir_outside_the_run_is_not_read(tmp_path):
    (path,) = write_example(tmp_path / "run")
    path.write_text(path.read_text(encoding="utf-8").replace("./outputs", "../../etc"), encoding="utf-8")
    log = AxolotlConfig().read([path], tmp_path / "run")
    assert log.segments == [] and log.plan["max_steps"] == 10


def test_the_real_runs_read_as_written(tmp_path):
    run = tracker_run("axolotl_config", "nan_loss", tmp_path)
    log = AxolotlConfig().read(source_files(AxolotlConfig(), run), run)
    train = [e for e in log.segments[0] if "loss" in e]
    assert [e["step"] for e in train] == list(range(1, 61))
    assert [e["step"] for e in train if math.isnan(e["loss"])][0] == FIRST_NAN_STEP


@pytest.mark.slow
def test_the_real_runs_are_judged(tmp_path):
    verdicts = {v: audited(tracker_run("axolotl_config", v, tmp_path)) for v in ("clean", "nan_loss", "lr_x100")}
    assert_variants_judged(verdicts)
