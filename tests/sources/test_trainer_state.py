"""The Trainer state source: a ``trainer_state.json`` read into its history, plan and other fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sftaudit.errors import InputError
from sftaudit.imports.sources.trainer_state import TrainerState

from . import EXAMPLE_STEPS, example_loss


def write_example(folder: Path) -> list[Path]:
    """The registry's contract run: steps 1..10 logged with their loss and learning rate, as the Trainer saves it."""
    folder.mkdir(parents=True, exist_ok=True)
    history = [{"epoch": s / 10, "learning_rate": 1e-4, "loss": example_loss(s), "step": s} for s in EXAMPLE_STEPS]
    state = {"global_step": 10, "max_steps": 10, "logging_steps": 1, "save_steps": 5, "log_history": history}
    path = folder / "trainer_state.json"
    path.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return [path]


def test_a_state_gives_its_history_plan_and_other_fields(tmp_path):
    (path,) = write_example(tmp_path)
    log = TrainerState().read([path], tmp_path)
    assert [e["step"] for e in log.segments[0]] == list(EXAMPLE_STEPS)
    assert log.plan == {"max_steps": 10, "logging_steps": 1, "save_steps": 5}
    assert log.fields["global_step"] == 10 and "log_history" not in log.fields
    assert log.files == ["trainer_state.json"] and log.records == 10


def test_entries_whose_step_is_no_integer_are_left_out(tmp_path):
    path = tmp_path / "trainer_state.json"
    history = [{"loss": 1.0, "step": s} for s in (1, 2.5, "3", None, True)] + [{"loss": 1.0}, 7]
    path.write_text(json.dumps({"global_step": 1, "log_history": history}), encoding="utf-8")
    assert [e["step"] for e in TrainerState().read([path], tmp_path).segments[0]] == [1]


@pytest.mark.parametrize(
    "text",
    ['{"global_step": 3, "log_history": {"step": 1}}', '{"global_step": 3, "log_his', "[1, 2]", "\x00\x01"],
)
def test_what_is_no_state_is_refused_in_one_line(tmp_path, text):
    path = tmp_path / "trainer_state.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(InputError, match="trainer_state.json: not a"):
        TrainerState().read([path], tmp_path)


def test_detected_by_its_own_keys(tmp_path):
    (path,) = write_example(tmp_path / "run")
    other = tmp_path / "config.json"
    other.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 100}), encoding="utf-8")
    assert TrainerState().detect(path) and not TrainerState().detect(other)
