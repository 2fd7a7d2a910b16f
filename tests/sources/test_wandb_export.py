"""The W&B history export source: the server's Parquet partitions of one run, read with pyarrow."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sftaudit.imports.sources import source_files
from sftaudit.imports.sources.wandb_export import WandbHistoryExport

from . import EXAMPLE_STEPS, FIRST_NAN_STEP, assert_variants_judged, audited, example_loss, tracker_run


def write_export(path: Path, rows: list[dict]) -> Path:
    """One partition as the export lays it out: ``_step`` int64, ``_runtime``/``_timestamp`` float64, a column per
    logged key under its logged name, null where a row did not log it."""
    keys = sorted({k for r in rows for k in r})
    columns = {"_step": pa.array(range(len(rows)), pa.int64())}
    columns["_runtime"] = pa.array([float(n) for n in range(len(rows))], pa.float64())
    columns["_timestamp"] = pa.array([1.7e9 + n for n in range(len(rows))], pa.float64())
    for key in keys:
        values = [r.get(key) for r in rows]
        whole = all(type(v) is int for v in values if v is not None)
        columns[key] = pa.array(values, pa.int64() if whole else pa.float64())
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


def write_example(folder: Path) -> list[Path]:
    """The registry's contract run, as the Trainer's WandbCallback logged it and the server exported it."""
    rows = [{"train/loss": example_loss(s), "train/learning_rate": 1e-4, "train/global_step": s} for s in EXAMPLE_STEPS]
    rows.insert(5, {"eval/loss": 1.5, "train/global_step": 5})
    return [write_export(folder / "history" / "ent_proj_abc123_0.runhistory.parquet", rows)]


def test_partitions_are_one_run_in_step_order(tmp_path):
    (path,) = write_example(tmp_path)
    table = pq.read_table(path)
    # The server lists partitions in no order: the later half first, under another name.
    pq.write_table(table.slice(6), tmp_path / "history" / "ent_proj_abc123_0.runhistory.parquet")
    pq.write_table(table.slice(0, 6), tmp_path / "history" / "ent_proj_abc123_1.runhistory.parquet")
    files = source_files(WandbHistoryExport(), tmp_path)
    log = WandbHistoryExport().read(files, tmp_path)
    (entries,) = log.segments
    assert [e["step"] for e in entries if "loss" in e] == list(EXAMPLE_STEPS)
    assert {"step": 5, "eval_loss": 1.5} in entries and log.records == 11 and not log.plan
    assert "grad_norm" in log.lacks


def test_a_damaged_partition_is_skipped_and_counted(tmp_path):
    (path,) = write_example(tmp_path)
    broken = path.with_name("ent_proj_abc123_1.runhistory.parquet")
    broken.write_bytes(path.read_bytes()[:200] + b"\0" * 64 + path.read_bytes()[-8:])
    log = WandbHistoryExport().read([path, broken], tmp_path)
    assert len(log.segments[0]) == 11
    assert log.skipped == [{"file": str(broken.relative_to(tmp_path)), "lines": 1, "of": 1}]


def test_a_dataset_in_parquet_is_not_a_history_export(tmp_path):
    data = tmp_path / "data" / "train-00000.parquet"
    data.parent.mkdir()
    pq.write_table(pa.table({"step": [1, 2], "text": ["a", "b"]}), data)
    (data.parent / "fake.parquet").write_bytes(b"PAR1" + b"\0" * 4 + (2**31).to_bytes(4, "little") + b"PAR1")
    assert not WandbHistoryExport().detect(data) and not WandbHistoryExport().detect(data.parent / "fake.parquet")


def test_the_real_exports_read_as_written(tmp_path):
    run = tracker_run("wandb_offline", "nan_loss", tmp_path)
    log = WandbHistoryExport().read(source_files(WandbHistoryExport(), run), run)
    train = [e for e in log.segments[0] if "loss" in e]
    assert [e["step"] for e in train] == list(range(1, 61))
    assert [e["step"] for e in train if math.isnan(e["loss"])][0] == FIRST_NAN_STEP and not log.lacks


@pytest.mark.slow
def test_the_real_exports_are_judged(tmp_path):
    verdicts = {}
    for variant in ("clean", "nan_loss", "lr_x100"):
        run = tracker_run("wandb_offline", variant, tmp_path)
        verdicts[variant] = audited(run, "--source", "wandb-export")
    assert_variants_judged(verdicts)
