"""The TensorBoard source: event files framed and read record by record, a damaged record skipped and counted."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest

from . import EXAMPLE_STEPS, example_loss

pytest.importorskip("tensorboard")

from sftaudit.imports.sources.tensorboard import TensorBoardLog  # noqa: E402


def write_events(folder: Path, logs: list[tuple[int, dict[str, float]]]) -> Path:
    """An event file written by tensorboard's own writer: one event per (step, {tag: value}), as the Trainer's
    TensorBoardCallback logs them (legacy simple values, as torch's SummaryWriter writes)."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    writer = EventFileWriter(str(folder))
    for step, values in logs:
        summary = Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in values.items()])
        writer.add_event(Event(step=step, wall_time=time.time(), summary=summary))
    writer.close()
    return next(folder.glob("events.out.tfevents.*"))


def write_example(folder: Path) -> list[Path]:
    """The registry's contract run, as the callback writes it under runs/<time>_<host>/."""
    logs = [(s, {"train/loss": example_loss(s), "train/learning_rate": 1e-4}) for s in EXAMPLE_STEPS]
    return [write_events(folder / "runs" / "Jan01_00-00-00_host", logs)]


def record_offsets(path: Path) -> list[int]:
    """Where each record of an event file starts (its length field)."""
    data, out, pos = path.read_bytes(), [], 0
    while pos < len(data):
        out.append(pos)
        pos += 12 + struct.unpack_from("<Q", data, pos)[0] + 4
    return out


def test_event_files_give_the_scalars_per_step(tmp_path):
    files = write_example(tmp_path)
    log = TensorBoardLog().read(files, tmp_path)
    assert [(e["step"], e["loss"]) for e in log.segments[0]] == [(s, example_loss(s)) for s in EXAMPLE_STEPS]
    assert log.records == 11 and not log.skipped  # the file-version event, then one per step


def test_a_record_whose_crc_fails_is_skipped_and_reading_goes_on(tmp_path):
    (path,) = write_example(tmp_path)
    data = bytearray(path.read_bytes())
    fifth = record_offsets(path)[5]  # the record of step 5
    data[fifth + 12] ^= 0xFF  # its data, no longer matching its CRC
    path.write_bytes(bytes(data))
    log = TensorBoardLog().read([path], tmp_path)
    assert [e["step"] for e in log.segments[0]] == [1, 2, 3, 4, 6, 7, 8, 9, 10]
    assert log.skipped == [{"file": str(path.relative_to(tmp_path)), "lines": 1, "of": 11}]


def test_a_damaged_length_is_passed_over_to_the_next_record(tmp_path):
    (path,) = write_example(tmp_path)
    data = bytearray(path.read_bytes())
    third = record_offsets(path)[3]
    data[third : third + 8] = struct.pack("<Q", 2**40)  # a length past the file, its CRC now failing
    path.write_bytes(bytes(data))
    log = TensorBoardLog().read([path], tmp_path)
    assert [e["step"] for e in log.segments[0]] == [1, 2, 4, 5, 6, 7, 8, 9, 10] and log.skipped[0]["lines"] == 1


def test_a_last_record_cut_short_ends_the_file_without_a_skip(tmp_path):
    (path,) = write_example(tmp_path)
    path.write_bytes(path.read_bytes()[:-7])
    log = TensorBoardLog().read([path], tmp_path)
    assert [e["step"] for e in log.segments[0]] == list(range(1, 10)) and not log.skipped


def test_detected_by_its_framing(tmp_path):
    (path,) = write_example(tmp_path)
    other = tmp_path / "events.out.tfevents.fake"
    other.write_bytes(b"not an event file at all")
    assert TensorBoardLog().detect(path) and not TensorBoardLog().detect(other)
