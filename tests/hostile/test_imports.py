"""Logs of runs trained without the shim that are not what they say, or far larger than a test's: what the importers
read stays bounded in time and memory, and inside the run.

Each case is built in the test and audited by `sftaudit` in a subprocess under a time bound; each checks the outcome
(one line and exit 2, or a verdict that says what it skipped) and that nothing outside the run was read: a sentinel
file beside the run, whose access time is older than its change time (so a read moves it, on a file system that
records reads: relatime, Linux's default), which the run's config.json and adapter_config.json link to."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .builders import AUDIT_BOUND_S, trainer_run, verdict

SECRET = "sentinel-content-outside-the-run"


class Outside:
    """A sentinel beside a run folder, linked from it, that nothing may read."""

    def __init__(self, root: Path):
        self.sentinel = root / "outside" / "secret.json"
        self.sentinel.parent.mkdir(parents=True, exist_ok=True)
        self.sentinel.write_text(json.dumps({"secret": SECRET, "vocab_size": 7}))
        st = self.sentinel.stat()
        os.utime(self.sentinel, ns=(st.st_mtime_ns - 3600 * 10**9, st.st_mtime_ns))
        self.atime = self.sentinel.stat().st_atime_ns

    def bait(self, run: Path) -> Path:
        for name in ("config.json", "adapter_config.json"):
            (run / name).symlink_to(self.sentinel)
        return run

    def audit(self, run: Path, *args: str, bound: float = AUDIT_BOUND_S) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [sys.executable, "-m", "sftaudit.cli", "audit", str(run), *args],
            cwd=run.parent,
            capture_output=True,
            text=True,
            timeout=bound,
            stdin=subprocess.DEVNULL,
        )
        assert self.sentinel.stat().st_atime_ns == self.atime, "a file outside the run was read"
        assert "Traceback" not in done.stderr and "bug in sftaudit" not in done.stderr, done.stderr
        return done


@pytest.fixture
def outside(tmp_path) -> Outside:
    return Outside(tmp_path)


def _one_line(done: subprocess.CompletedProcess, *said: str) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stdout + done.stderr
    assert all(s in lines[0] for s in said), lines[0]
    return lines[0]


def _notes(run: Path) -> list[str]:
    return verdict(run)["resolution"]["notes"]


@pytest.mark.parametrize("name", ["trainer_state.json", "trainer_log.jsonl"])
def test_a_fifo_named_as_the_log_is_never_opened(tmp_path, outside, name):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / name)
    _one_line(outside.audit(outside.bait(run), bound=120), f"{name}: a FIFO, not a regular file; not read")


def test_a_fifo_log_beside_a_readable_state_is_left_unread(tmp_path, outside):
    run = outside.bait(trainer_run(tmp_path))
    os.mkfifo(run / "trainer_log.jsonl")
    done = outside.audit(run, bound=120)
    assert done.returncode == 0 and verdict(run)["verdict"] in ("pass", "warn"), done.stdout + done.stderr
    (run / "checkpoint-20" / "trainer_state.json").unlink()  # and a checkpoint's state: that checkpoint fails
    os.mkfifo(run / "checkpoint-20" / "trainer_state.json")
    done = outside.audit(run, bound=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert [f for f in verdict(run)["findings"] if "trainer_state.json is a FIFO" in f["message"]]


def test_a_state_linked_to_dev_zero_is_refused_before_reading(tmp_path, outside):
    run = tmp_path / "run"
    run.mkdir()
    (run / "trainer_state.json").symlink_to("/dev/zero")
    start = time.monotonic()
    _one_line(outside.audit(outside.bait(run), bound=120), "resolves to /dev/zero, outside", "not read")
    assert time.monotonic() - start < 120


def test_a_state_over_the_size_limit_is_refused_before_reading(tmp_path, outside):
    """A sparse file of 17 GiB: refused by its size, without reading a byte of it."""
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "trainer_state.json", "wb") as f:
        f.truncate(17 * 2**30)
    _one_line(outside.audit(outside.bait(run), bound=120), "over the", "-byte limit for this file; not read")


@pytest.mark.slow  # 10^5 lines audited in a subprocess
def test_a_log_whose_steps_go_back_at_every_line_is_read_in_linear_time(tmp_path, outside):
    """10^5 LLaMA-Factory lines, each one step before the last (a writer per line): a bounded set of writers stays
    open, so the log is read in one pass (it took over 600 s when every writer stayed open)."""
    run = tmp_path / "run"
    run.mkdir()
    n = 100_000
    lines = (json.dumps({"current_steps": n - i, "total_steps": n, "loss": 1.5 + (i % 7) / 100}) for i in range(n))
    (run / "trainer_log.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    start = time.monotonic()
    done = outside.audit(outside.bait(run), "--no-report", bound=300)
    assert done.returncode in (0, 1, 2) and time.monotonic() - start < 300
    assert done.returncode != 2 or len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # a state of 10^5 entries in four files, audited in a subprocess
def test_a_long_per_step_log_saved_with_every_checkpoint_is_audited_in_bounded_time(tmp_path, outside):
    """A TRL run's per-step trainer_state.json (eight numbers an entry, indented and sorted as the Trainer writes
    it) at the top and in three checkpoints: the older states are their newer one's beginning byte for byte, so
    they are compared, not parsed again; the run is one run of every step, judged within the bound."""
    n = 100_000
    run = tmp_path / "run"
    history = [
        {
            "entropy": 1.2,
            "epoch": 3 * s / n,
            "grad_norm": 0.8 + (s % 7) * 0.01,
            "learning_rate": 2e-5 * (1 - s / n),
            "loss": 2.0 / (1 + s / n) + (s % 5) * 1e-3,
            "mean_token_accuracy": 0.6,
            "num_tokens": 4096.0 * s,
            "step": s,
        }
        for s in range(1, n + 1)
    ]
    for folder, upto in [(run, n)] + [(run / f"checkpoint-{n * k // 3}", n * k // 3) for k in (1, 2, 3)]:
        folder.mkdir(parents=True)
        state = {"global_step": upto, "log_history": history[:upto], "logging_steps": 1, "max_steps": n}
        (folder / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    start = time.monotonic()
    done = outside.audit(outside.bait(run), "--no-report", bound=300)
    assert done.returncode == 0 and time.monotonic() - start < 300, done.stdout + done.stderr
    judged = verdict(run)
    assert judged["verdict"] in ("pass", "warn"), judged["findings"]  # (warn: the checkpoints hold no weights)
    assert judged["evidence"]["ranks"] == [{"first_step": 1, "last_step": n, "rank": 0, "steps": n}]
    assert not [n for n in _notes(run) if "other run" in n], _notes(run)


def _tensorboard_run(run: Path, steps: int, nan_from: int) -> Path:
    from tests.sources.test_tensorboard import write_events

    run.mkdir(exist_ok=True)
    logs = [
        (s, {"train/loss": math.nan if s >= nan_from else 2.0 - s / (2 * steps), "train/learning_rate": 1e-4})
        for s in range(1, steps + 1)
    ]
    return write_events(run / "runs" / "Jan01_00-00-00_host", logs)


def test_a_tensorboard_record_failing_its_crc_is_skipped_not_the_rest_of_the_file(tmp_path, outside):
    """One damaged record at step 5 of 200, the loss NaN from step 9: tensorboard's own loader stops at the damaged
    record (and the run passed on steps 1-4); here reading goes on, the NaN fails the run, and the skipped record
    is said (1 of 201: within the 1% of missing evidence a run is judged with)."""
    pytest.importorskip("tensorboard")
    from tests.sources.test_tensorboard import record_offsets

    events = _tensorboard_run(tmp_path / "run", steps=200, nan_from=9)
    run = outside.bait(events.parents[2])
    data = bytearray(events.read_bytes())
    data[record_offsets(events)[5] + 12 + 3] ^= 0x55  # step 5's record: its data no longer matches its CRC
    events.write_bytes(bytes(data))
    done = outside.audit(run, "--no-report")
    assert done.returncode == 1, done.stdout + done.stderr
    judged = verdict(run)
    assert judged["verdict"] == "fail" and judged["first_anomalous_step"] == 9, judged["first_anomalous_step"]
    assert any("1 of the 201 records of runs/" in n and "skipped" in n for n in _notes(run)), _notes(run)


def test_too_many_damaged_tensorboard_records_leave_the_run_unjudged(tmp_path, outside):
    pytest.importorskip("tensorboard")
    from tests.sources.test_tensorboard import record_offsets

    events = _tensorboard_run(tmp_path / "run", steps=40, nan_from=10**6)
    run = outside.bait(events.parents[2])
    data = bytearray(events.read_bytes())
    for k in (5, 12, 20):
        data[record_offsets(events)[k] + 12 + 3] ^= 0x55
    events.write_bytes(bytes(data))
    done = outside.audit(run, "--no-report")
    assert verdict(run)["verdict"] == "unjudged", done.stdout
    assert "3 of the 41 lines of runs/" in verdict(run)["cannot_judge"]


def test_a_tensorboard_record_claiming_a_terabyte_is_skipped_in_one_line(tmp_path, outside):
    """A record header whose length (2^40 bytes) has a valid CRC: never allocated nor read to the end; the reader
    goes on at the next record, and the note says one record was skipped."""
    pytest.importorskip("tensorboard")
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    from tests.sources.test_tensorboard import record_offsets

    events = _tensorboard_run(tmp_path / "run", steps=200, nan_from=10**6)
    run = outside.bait(events.parents[2])
    data = bytearray(events.read_bytes())
    at = record_offsets(events)[100]
    length = struct.pack("<Q", 2**40)
    data[at : at + 12] = length + struct.pack("<I", masked_crc32c(length))
    events.write_bytes(bytes(data))
    done = outside.audit(run, "--no-report", bound=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert [n for n in _notes(run) if "1 of the 201 records" in n and "skipped" in n], _notes(run)


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"global_step": math.nan}, "global_step = nan"),
        ({"max_steps": math.inf}, "max_steps = inf"),
        ({"logging_steps": -math.inf, "max_steps": math.nan}, "logging_steps = -inf, max_steps = nan"),
        ({"max_steps": "40"}, "max_steps = '40'"),
        ({"logging_steps": None, "save_steps": [5]}, "save_steps = [5]"),
        ({"global_step": True, "train_batch_size": {"a": 1}}, "global_step = True, train_batch_size = {'a': 1}"),
        ({"max_steps": 10**30}, "max_steps = 1000000000000000000000000000000"),
    ],
)
def test_a_plan_value_that_is_no_number_is_ignored_with_a_note(tmp_path, outside, fields, said):
    run = outside.bait(trainer_run(tmp_path))
    for state in [run / "trainer_state.json", run / "checkpoint-20" / "trainer_state.json"]:
        state.write_text(json.dumps({**json.loads(state.read_text()), **fields}))
    done = outside.audit(run, "--no-report")
    assert done.returncode in (0, 1), done.stdout + done.stderr
    assert any(f"trainer_state.json holds no number where one belongs ({said})" in n for n in _notes(run)), _notes(run)


def test_log_values_that_are_null_or_text_are_read_as_no_number(tmp_path, outside):
    run = outside.bait(trainer_run(tmp_path, checkpoints=()))
    state = json.loads((run / "trainer_state.json").read_text())
    state["log_history"][3].update(loss=None, grad_norm="high", learning_rate=[1])
    state["log_history"][4]["step"] = math.nan
    state["log_history"][5]["step"] = 10**30
    (run / "trainer_state.json").write_text(json.dumps(state))
    done = outside.audit(run, "--no-report")
    assert done.returncode in (0, 1), done.stdout + done.stderr


@pytest.mark.parametrize(
    ("name", "text", "said"),
    [
        ("trainer_state.json", '{"log_history": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
        ("trainer_state.json", '{"global_step": 3, "log_history": [{"step": 1, "loss": 1.0}', "cut short"),
        ("trainer_state.json", "\xff\xfe not utf-8", "not a readable trainer state"),
        ("trainer_log.jsonl", '{"current_steps": 1, "loss": ' + "[" * 100_000 + "]" * 100_000 + "}\n", "no readable"),
    ],
)
def test_a_log_that_cannot_be_read_is_refused_in_one_line(tmp_path, outside, name, text, said):
    run = tmp_path / "run"
    run.mkdir()
    (run / name).write_bytes(text.encode("latin-1") if "\xff" in text else text.encode())
    _one_line(outside.audit(outside.bait(run), bound=120), said)
