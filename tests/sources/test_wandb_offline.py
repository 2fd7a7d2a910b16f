"""The W&B source: ``run-<id>.wandb`` transaction logs, framed here and decoded with wandb's protobuf classes; the
real runs are files wandb 0.31 wrote (``fixtures/trackers/data/wandb_offline/``)."""

from __future__ import annotations

import importlib.util
import math
import shutil
import struct
import sys
import zlib
from pathlib import Path

import pytest

from sftaudit.cli import main
from sftaudit.imports.sources import source_files
from sftaudit.imports.sources.wandb_offline import BLOCK, CHUNK_HEADER, HEADER, WandbOfflineLog

from . import EXAMPLE_STEPS, FIRST_NAN_STEP, assert_variants_judged, audited, example_loss, tracker_run

needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")


def frame(records: list[bytes]) -> bytes:
    """Records framed as wandb-core writes a ``.wandb`` file: the header, then 32 KiB blocks of checksummed chunks
    (a record split across blocks as first/middle/last chunks, a block's tail under a chunk header zero-filled)."""
    out = bytearray(HEADER)
    for data in records:
        first = True
        while True:
            left = BLOCK - len(out) % BLOCK
            if left < CHUNK_HEADER:
                out += bytes(left)
                continue
            piece, data = data[: left - CHUNK_HEADER], data[left - CHUNK_HEADER :]
            kind = (1 if not data else 2) if first else (4 if not data else 3)
            out += struct.pack("<IHB", zlib.crc32(piece, zlib.crc32(bytes([kind]))), len(piece), kind) + piece
            first = False
            if not data:
                break
    return bytes(out)


def run_file(
    folder: Path, rows: list[dict], config: dict | None = None, run_id: str = "abc123", start: int = 1_700_000_000
) -> Path:
    """A ``.wandb`` file of wandb's own Record protos: the run (with its config), then one history record per row."""
    import json

    from wandb.proto import wandb_internal_pb2 as pb

    run = pb.Record(run=pb.RunRecord(run_id=run_id, project="p", display_name="demo"))
    run.run.start_time.FromSeconds(start)
    for key, value in (config or {}).items():
        run.run.config.update.add(nested_key=[key], value_json=json.dumps(value))
    records = [run.SerializeToString()]
    for n, row in enumerate(rows):
        items = [pb.HistoryItem(nested_key=[k], value_json=json.dumps(v)) for k, v in {**row, "_step": n}.items()]
        records.append(pb.Record(history=pb.HistoryRecord(item=items, step=pb.HistoryStep(num=n))).SerializeToString())
    path = folder / "wandb" / f"offline-run-20240101_000000-{run_id}" / f"run-{run_id}.wandb"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(frame(records))
    return path


def write_example(folder: Path) -> list[Path]:
    """The registry's contract run, as the Trainer's WandbCallback logs it (an eval row between train rows)."""
    rows = []
    for s in EXAMPLE_STEPS:
        rows.append({"train/loss": example_loss(s), "train/learning_rate": 1e-4, "train/global_step": s})
        if s == 5:
            rows.append({"eval/loss": 1.5, "train/global_step": s})
    return [run_file(folder, rows, {"max_steps": 10, "learning_rate": 1e-4})]


@needs_wandb
def test_the_series_is_keyed_on_the_global_step_not_on_wandbs_own(tmp_path):
    (path,) = write_example(tmp_path)
    log = WandbOfflineLog().read([path], tmp_path)
    (entries,) = log.segments
    assert [e["step"] for e in entries if "loss" in e] == list(EXAMPLE_STEPS)  # _step would say 0..4, 6..10
    assert {"step": 5, "eval_loss": 1.5} in entries
    assert log.plan == {"max_steps": 10, "learning_rate": 1e-4} and log.records == 12 and not log.skipped
    assert log.identity["runs"][0]["run_id"] == "abc123"
    assert set(log.lacks) == {"grad_norm"}  # no grad_norm was logged


@needs_wandb
def test_a_damaged_chunk_is_skipped_and_counted_and_a_torn_end_is_not(tmp_path):
    rows = [{"train/loss": 1.0, "train/global_step": s, "pad": "x" * 3000} for s in range(1, 41)]  # 4 blocks
    path = run_file(tmp_path, rows)
    data = bytearray(path.read_bytes())
    data[BLOCK + 100] ^= 0xFF  # inside a chunk of the second block
    path.write_bytes(bytes(data[:-20]))  # and the last record cut short
    log = WandbOfflineLog().read([path], tmp_path)
    steps = [e["step"] for e in log.segments[0]]
    # The damaged block's records lost (about ten), reading went on in the next block; the torn last row is the end.
    assert steps[:5] == [1, 2, 3, 4, 5] and 39 in steps and 40 not in steps and 25 <= len(steps) <= 30
    assert log.skipped[0]["file"] == str(path.relative_to(tmp_path)) and log.skipped[0]["lines"] >= 1


@needs_wandb
def test_the_real_runs_read_as_wandb_wrote_them(tmp_path):
    nan = tracker_run("wandb_offline", "nan_loss", tmp_path)
    log = WandbOfflineLog().read(source_files(WandbOfflineLog(), nan), nan)
    (entries,) = log.segments
    train = [e for e in entries if "loss" in e]
    assert [e["step"] for e in train] == list(range(1, 61)) and len(entries) == 63  # 3 eval rows
    assert [e["step"] for e in train if math.isnan(e["loss"])][0] == FIRST_NAN_STEP
    assert log.plan["max_steps"] == 60 and log.plan["learning_rate"] == 2e-5 and not log.lacks and not log.skipped
    lr = tracker_run("wandb_offline", "lr_x100", tmp_path)
    assert WandbOfflineLog().read(source_files(WandbOfflineLog(), lr), lr).plan["learning_rate"] == 2e-3


@needs_wandb
@pytest.mark.slow
def test_the_real_runs_are_judged(tmp_path):
    verdicts = {}
    for variant in ("clean", "nan_loss", "lr_x100"):
        run = tracker_run("wandb_offline", variant, tmp_path)
        shutil.rmtree(run / "history_export")  # the W&B file alone
        verdicts[variant] = audited(run)
    assert_variants_judged(verdicts)


def test_without_wandb_the_run_is_refused_in_one_line_saying_what_to_install(tmp_path, monkeypatch, capsys):
    run = tracker_run("wandb_offline", "clean", tmp_path)
    shutil.rmtree(run / "history_export")  # the W&B file alone
    (path,) = sorted(run.glob("wandb/*/run-*.wandb"))
    for module in ("wandb", "wandb.proto", "wandb.proto.wandb_internal_pb2"):  # as if not installed
        monkeypatch.setitem(sys.modules, module, None)
    for given in (path, run):  # the file named, or its run folder
        assert main(["import", str(given)]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "pip install 'sftaudit[wandb]'" in err, err


@needs_wandb
def test_each_start_is_a_segment_in_start_order_and_the_latest_run_link_is_read_once(tmp_path):
    run_file(tmp_path, [{"train/loss": 2.0, "train/global_step": s} for s in (1, 2, 3)], run_id="zzz")
    later = run_file(
        tmp_path, [{"train/loss": 1.0, "train/global_step": s} for s in (3, 4)], run_id="aaa", start=2_000_000_000
    )
    (tmp_path / "wandb" / "latest-run").symlink_to(later.parent.name)
    files = source_files(WandbOfflineLog(), tmp_path) + [tmp_path / "wandb" / "latest-run" / later.name]
    log = WandbOfflineLog().read(files, tmp_path)
    assert [[e["step"] for e in seg] for seg in log.segments] == [[1, 2, 3], [3, 4]] and len(log.files) == 2
