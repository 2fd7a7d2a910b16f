"""A W&B run's local transaction log, ``wandb/offline-run-*/run-<id>.wandb`` (``wandb/run-*/`` for a run that
synced as it went): the only record wandb 0.30+ keeps on disk (the optional extra ``sftaudit[wandb]``, for wandb's
protobuf classes).

The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB blocks of
chunks, each ``crc32 (u32) | length (u16) | type (u8: 1 full, 2 first, 3 middle, 4 last) | data``, the checksum
``zlib.crc32(data, zlib.crc32(bytes([type])))``; a block's tail shorter than a chunk header is padding. A record is
one ``wandb_internal_pb2.Record``. Chunks are framed here: a chunk whose checksum fails (and the record it was part
of) is skipped and counted, and reading goes on at the next block, as LevelDB's reader does; a last chunk cut short
(a run killed mid-write) ends the file.

The Trainer's ``WandbCallback`` logs every ``on_log`` as one history row of ``rewrite_logs(logs)`` (``train/loss``,
``train/learning_rate``, ``train/grad_norm``, ``train/epoch``; ``eval_x`` as ``eval/x``, ``test_x`` as ``test/x``)
plus ``train/global_step``, declared the step of every metric. W&B's own ``_step`` counts ``log`` calls (an eval adds
a row), so the series is keyed on ``train/global_step``; a run that never logged it (``wandb.log`` called by hand) is
keyed on ``_step``. The run config (``args.to_dict()`` merged with the model config) is the plan. Every ``.wandb``
file is one start: several (a run resumed, or ``wandb.init`` again) are read in the order they started.
"""

from __future__ import annotations

import json
import mmap
import struct
import zlib
from pathlib import Path
from typing import Any

from ...core.safe_io import open_regular
from ...errors import InputError
from ..logs import MAX_LOG_BYTES, is_step, normalised
from ..source import PLAN_KEYS, LogSource, SourceLog, numbers_only

HEADER = struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
BLOCK = 32768
CHUNK_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
# The step every metric of a Trainer run is declared against (`define_metric`), then Lightning's WandbLogger's.
STEP_KEYS = ("train/global_step", "trainer/global_step")
# A value longer than this in one history item is no scalar the callback logged (a table, an image's metadata).
MAX_VALUE_BYTES = 1 << 16
INSTALL = "pip install 'sftaudit[wandb]'"
NO_GRAD_NORM = "the W&B run logged no grad_norm (an older Trainer, or max_grad_norm 0)"


class WandbOfflineLog(LogSource):
    name = "wandb"
    provenance = "imported logs: W&B run file (.wandb)"
    patterns = ("**/run-*.wandb",)
    what = "the W&B run files"
    rank = 30
    no_grad_norm = NO_GRAD_NORM
    needs = ("wandb", "sftaudit[wandb]")

    def detect(self, path: Path) -> bool:
        """The W&B transaction log's header (wandb itself is not needed to tell one)."""
        with open_regular(path) as f:
            return f.read(len(HEADER)) == HEADER

    def read(self, files: list[Path], run_dir: Path) -> SourceLog:
        try:
            from wandb.proto import wandb_internal_pb2
        except ImportError:
            raise InputError(f"{files[0]}: a W&B run file; reading it needs wandb: {INSTALL}") from None
        runs, skipped, count = [], [], 0
        unique = {p.resolve(): p for p in reversed(files)}  # wandb/latest-run is a link to one of the run folders
        files = [p for p in files if unique.get(p.resolve()) is p]
        for path in files:
            run, bad, read = read_run(path, run_dir, wandb_internal_pb2.Record)
            count += read + bad
            if bad:
                skipped.append({"file": str(path.relative_to(run_dir)), "lines": bad, "of": read + bad})
            runs.append(run)
        runs.sort(key=lambda r: r["started"])
        config = {k: v for r in runs for k, v in r["config"].items()}
        plan, ignored = numbers_only(
            {**config, "train_batch_size": config.get("per_device_train_batch_size")}, PLAN_KEYS
        )
        segments = [r["entries"] for r in runs if r["entries"]]
        return self.log(
            files,
            run_dir,
            segments=segments,
            plan=plan,
            identity={
                "config": config,
                "model_config": None,
                "runs": [{k: r[k] for k in ("run_id", "project", "name", "started")} for r in runs],
            },
            skipped=skipped,
            records=count,
            ignored=ignored,
        )


def chunks(m: mmap.mmap, size: int) -> tuple[list[bytes], int]:
    """The file's records as bytes (chunks joined), and how many were skipped: a chunk whose checksum fails, a
    record left unfinished by one, a chunk out of order. A damaged chunk loses the rest of its block."""
    out, skipped = [], 0
    pos, pending = len(HEADER), None
    while pos + CHUNK_HEADER <= size:
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:
            pos += left
            continue
        checksum, length, kind = struct.unpack_from("<IHB", m, pos)
        if checksum == length == kind == 0:  # zero fill: the rest of the block is padding
            pos += left
            continue
        end = pos + CHUNK_HEADER + length
        if end > size:
            break  # the last chunk, cut short
        data = m[pos + CHUNK_HEADER : end]
        if (
            length > left - CHUNK_HEADER
            or kind not in (FULL, FIRST, MIDDLE, LAST)
            or (zlib.crc32(data, zlib.crc32(bytes([kind]))) != checksum)
        ):
            skipped += 1
            pending = None
            pos += left  # LevelDB's reader drops the rest of a damaged block
            continue
        pos = end
        if kind == FULL or kind == FIRST:
            skipped += pending is not None  # a record whose last chunk never came
            pending = [data] if kind == FIRST else None
            if kind == FULL:
                out.append(data)
        elif pending is None:
            skipped += kind == LAST  # the tail of a record whose start was lost
        else:
            pending.append(data)
            if kind == LAST:
                out.append(b"".join(pending))
                pending = None
    return out, skipped


def read_run(path: Path, run_dir: Path, record_type: Any) -> tuple[dict[str, Any], int, int]:
    """One ``.wandb`` file: its run (``entries``, ``config``, ``run_id``, ``project``, ``name``, ``started``), the
    records skipped, the records read."""
    from google.protobuf.message import DecodeError

    with open_regular(path.absolute(), run_dir, MAX_LOG_BYTES) as f:
        size = f.seek(0, 2)
        f.seek(0)
        if f.read(len(HEADER)) != HEADER:
            raise InputError(f"{path}: not a W&B run file (no :W&B header)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            raw, skipped = chunks(m, size)
    run: dict[str, Any] = {"run_id": None, "project": None, "name": None, "started": 0.0, "config": {}}
    rows = []
    for data in raw:
        try:
            record = record_type.FromString(data)
        except DecodeError:
            skipped += 1
            continue
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.update(run_id=r.run_id, project=r.project, name=r.display_name, started=r.start_time.ToSeconds())
            _update(run["config"], r.config.update)
        elif kind == "config":
            _update(run["config"], record.config.update)
        elif kind == "history":
            row = {_key(item): _value(item.value_json) for item in record.history.item}
            row.setdefault("_step", record.history.step.num)
            rows.append(row)
    run["entries"] = entries(rows)
    return run, skipped, len(raw)


def entries(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """History rows as log-history entries: numbers only, under the Trainer's names (``train/x`` -> ``x``,
    ``eval/x`` -> ``eval_x``), at the declared global step; ``test/x`` rows (``trainer.predict``) are no step."""
    key = next((k for k in STEP_KEYS if any(r.get(k) is not None for r in rows)), "_step")
    out = []
    for row in rows:
        step = row.get(key)
        step = int(step) if isinstance(step, float) and step.is_integer() and abs(step) < 2**63 else step
        if not is_step(step):
            continue
        logged = {
            (k[6:] if k.startswith("train/") else k): v
            for k, v in row.items()
            if not k.startswith(("_", "test/")) and k not in STEP_KEYS
        }
        entry = {k: v for k, v in normalised(logged).items() if type(v) is float}
        if entry:
            out.append({"step": step, **entry})
    out.sort(key=lambda e: e["step"])  # stable: a train row before the eval row of its step, as logged
    return out


def _key(item: Any) -> str:
    # wandb < 0.19 sets `key`; later ones `nested_key` (one element for a flat key like "train/loss").
    return item.key or "/".join(item.nested_key)


def _value(text: str) -> Any:
    if len(text) > MAX_VALUE_BYTES:
        return None
    try:
        return json.loads(text)  # NaN and Infinity as W&B writes them
    except (ValueError, RecursionError):
        return None


def _update(config: dict[str, Any], items: Any) -> None:
    for item in items:
        key = _key(item)
        if not key.startswith("_"):  # _wandb: the client's own bookkeeping
            config[key] = _value(item.value_json)
