"""The LLaMA-Factory source: ``trainer_log.jsonl`` read line by line into one segment per (re)start."""

from __future__ import annotations

import json
from pathlib import Path

from sftaudit.imports import import_run
from sftaudit.imports.sources.llamafactory import LlamaFactoryLog

from . import EXAMPLE_STEPS, example_loss


def _line(step: int, loss: float, total: int = 10) -> dict:
    return {"current_steps": step, "total_steps": total, "loss": loss, "lr": 1e-4, "epoch": step / 10}


def write_example(folder: Path) -> list[Path]:
    """The registry's contract run, as LogCallback appends it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "trainer_log.jsonl"
    path.write_text("".join(json.dumps(_line(s, example_loss(s))) + "\n" for s in EXAMPLE_STEPS), encoding="utf-8")
    return [path]


def test_a_log_gives_its_entries_and_planned_length(tmp_path):
    (path,) = write_example(tmp_path)
    log = LlamaFactoryLog().read([path], tmp_path)
    assert log.plan == {"max_steps": 10} and log.records == 10 and not log.skipped
    assert log.segments[0][0] == {"step": 1, "loss": example_loss(1), "learning_rate": 1e-4, "epoch": 0.1}
    assert "grad_norm" in log.lacks  # LogCallback logs no grad_norm


def test_unreadable_lines_are_counted_but_a_torn_last_line_is_not(tmp_path):
    lines = [json.dumps(_line(s, 1.0)) for s in range(1, 6)]
    path = tmp_path / "trainer_log.jsonl"
    path.write_text("\n".join(lines[:2] + ["{not json", "[1, 2]"] + lines[2:]) + '\n{"current_st', encoding="utf-8")
    log = LlamaFactoryLog().read([path], tmp_path)
    assert [e["step"] for e in log.segments[0]] == [1, 2, 3, 4, 5]
    assert log.skipped == [{"file": "trainer_log.jsonl", "lines": 2, "of": 8}]


def test_an_overlong_line_is_skipped_unread(tmp_path):
    path = tmp_path / "trainer_log.jsonl"
    huge = '{"current_steps": 2, "loss": 1.0, "pad": "' + "x" * (2 << 20) + '"}'
    path.write_text("\n".join([json.dumps(_line(1, 1.0)), huge, json.dumps(_line(3, 1.0))]) + "\n", encoding="utf-8")
    log = LlamaFactoryLog().read([path], tmp_path)
    assert [e["step"] for e in log.segments[0]] == [1, 3] and log.skipped[0]["lines"] == 1


def test_the_log_named_by_its_own_path_is_imported_from_its_folder(tmp_path):
    (path,) = write_example(tmp_path / "run")
    renamed = path.with_name("run3.log")  # a name no pattern finds: the file given, read as the source it holds
    path.rename(renamed)
    done = import_run(tmp_path / "run", file=renamed)
    assert done["steps"] == 10 and (tmp_path / "run" / "sftaudit" / "rank-0" / "steps.parquet").is_file()


def test_detected_by_its_first_line(tmp_path):
    (path,) = write_example(tmp_path)
    other = tmp_path / "other.jsonl"
    other.write_text('{"step": 1, "loss": 1.0}\n', encoding="utf-8")
    assert LlamaFactoryLog().detect(path) and not LlamaFactoryLog().detect(other)
