"""The artifact format: the contract between the shim (writer) and the analyzer (reader).

Everything the shim records lives under ``RUN_DIR/sftaudit/``::

    RUN_DIR/sftaudit/
      tokenizer/              the run's tokenizer (save_pretrained), written once by rank 0
      stop-request.json       a request to stop the run, read by the shim's guard (`StopRequest`)
      kept/<checkpoint>/      a checkpoint the guard kept out of the trainer's rotation (hard links)
      rank-<r>/               one folder per rank; each file is newline-delimited JSON,
        manifest.jsonl          append-only and flushed after every record
        steps.jsonl
        ...

Each record is one JSON object on one line. A process killed at any moment leaves
at most one incomplete last line, which readers skip; every complete line is a
valid record. Every record carries ``seg``: the segment number, incremented each
time a recorder (re)starts on the same rank folder (a resumed run). The records are
declared field by field in `sftaudit.schema.records` (``docs/artifacts.md`` is generated
from it); the format is versioned by ``SCHEMA_VERSION`` in every manifest record.

Per-tensor gradient norms (schema version 2) are not in ``steps.jsonl`` but in a columnar
series beside the rank folders, hive-partitioned so DuckDB, Polars, Spark or Trino read it as is::

    RUN_DIR/sftaudit/series/grad_norms/rank=<r>/seg=<s>/
      part-<first step, 9 digits>.parquet    immutable parts, one row group each
      journal-<first step, 9 digits>.bin     the steps since the last part (the tail), appended per step

A part's columns: ``step`` INT64, ``idx`` INT32 (the tensor's index in that rank's manifest
``params``), ``norm`` FLOAT32 (the pre-clip norm; NaN and inf kept), ``norm_post_clip`` FLOAT32
(NULL unless the Trainer's clip was read too). A tensor without a gradient at a step has no row.
Parts are written by the shim every ``ROLL_STEPS`` steps or ``ROLL_VALUES`` values (zstd level 3,
byte-stream-split floats, delta-coded integers: about 3.3 bytes per value) to a hidden temporary
name and renamed, then the journal they replace is deleted. A journal is a sequence of records
(``JOURNAL_HEADER``: magic, step, values, flags, CRC-32 of the payload; then ``idx`` int32[n],
``norm`` float32[n] and, with flag ``POST_CLIP``, ``norm_post_clip`` float32[n]), flushed per step
before the step's ``steps.jsonl`` line, so a SIGKILL loses at most the step in flight and a torn
last record is skipped. A journal whose part exists (a kill between the rename and the delete) is
ignored; a resumed shim turns the journals a killed one left into parts. Read everything with::

    SELECT * FROM read_parquet('RUN_DIR/sftaudit/series/grad_norms/**/*.parquet', hive_partitioning=true)

(plus the journal tails, which sftaudit's ingest reads). Schema version 1 runs kept the norms as
the ``grad_norms`` list of each ``steps.jsonl`` record; both are read.

This module is imported by both halves, so it must stay free of torch and DuckDB.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..schema.records import RECORDS
from .safe_io import read_bytes
from .terminal import shown

SCHEMA_VERSION = 2  # 2: per-tensor gradient norms in the columnar series, not in steps.jsonl
ARTIFACT_DIR = "sftaudit"
TOKENIZER_DIR = "tokenizer"
DATABASE_FILE = "audit.duckdb"
SERIES_DIR = "series"
KEPT_DIR = "kept"  # RUN_DIR/sftaudit/kept/<checkpoint name>/: checkpoints the guard kept out of rotation
GRAD_SERIES = "grad_norms"
# A part is written every ROLL_STEPS steps or ROLL_VALUES values, whichever comes first.
ROLL_STEPS = 10_000
ROLL_VALUES = 1 << 20
JOURNAL_MAGIC = 0x314A4653  # "SFJ1"
JOURNAL_HEADER = struct.Struct("<IqIII")  # magic, step, values, flags, CRC-32 of the payload
POST_CLIP = 1

# One file per record kind, each declared field by field in sftaudit/schema/records.py.
RECORD_KINDS = tuple(RECORDS)
# The kinds an import writes as `<kind>.parquet`, typed columns (`RecordKind.columnar_import`).
COLUMNAR_IMPORT_KINDS = tuple(k for k, spec in RECORDS.items() if spec.columnar_import)

# Histogram bin edges for log10|grad|: fixed so histograms compare across steps and tensors.
GRAD_HIST_EDGES = [float(e) / 2 for e in range(-24, 5)]  # 1e-12 .. 1e2, half-decade bins


def artifact_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / ARTIFACT_DIR


def rank_dir(run_dir: str | Path, rank: int) -> Path:
    return artifact_root(run_dir) / f"rank-{rank}"


def record_path(run_dir: str | Path, rank: int, kind: str) -> Path:
    if kind not in RECORD_KINDS:
        raise ValueError(f"unknown record kind {kind!r}")
    return rank_dir(run_dir, rank) / f"{kind}.jsonl"


def template_fingerprint(chat_template: str | None) -> str | None:
    """Short hash of a chat template's text: recorded per batch, compared by LOOP-01."""
    if not chat_template:
        return None
    text = chat_template if isinstance(chat_template, str) else json.dumps(chat_template, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def series_dir(run_dir: str | Path, rank: int, seg: int | None = None, series: str = GRAD_SERIES) -> Path:
    folder = artifact_root(run_dir) / SERIES_DIR / series / f"rank={rank}"
    return folder if seg is None else folder / f"seg={seg}"


def part_name(first_step: int) -> str:
    return f"part-{first_step:09d}.parquet"


def journal_name(first_step: int) -> str:
    return f"journal-{first_step:09d}.bin"


def journal_record(step: int, idx: np.ndarray, norm: np.ndarray, post: np.ndarray | None) -> bytes:
    """One step of a journal: `idx` int32, `norm` (and `post`) float32, all of one length."""
    payload = (
        idx.astype("<i4").tobytes()
        + norm.astype("<f4").tobytes()
        + (b"" if post is None else post.astype("<f4").tobytes())
    )
    return (
        JOURNAL_HEADER.pack(JOURNAL_MAGIC, step, len(idx), 0 if post is None else POST_CLIP, zlib.crc32(payload))
        + payload
    )


def read_journal(data: bytes) -> dict[str, np.ndarray]:
    """A journal's complete records as columns: step, idx, norm, norm_post_clip and post_recorded
    (whether the step recorded post-clip norms). Reading stops at the first torn or corrupt record: what follows it was never flushed."""
    steps, idxs, norms, posts, recorded = [], [], [], [], []
    pos, size = 0, len(data)
    while pos + JOURNAL_HEADER.size <= size:
        magic, step, n, flags, crc = JOURNAL_HEADER.unpack_from(data, pos)
        end = pos + JOURNAL_HEADER.size + n * (12 if flags & POST_CLIP else 8)
        if (
            magic != JOURNAL_MAGIC
            or flags & ~POST_CLIP
            or end > size
            or zlib.crc32(data[pos + JOURNAL_HEADER.size : end]) != crc
        ):
            break
        at = pos + JOURNAL_HEADER.size
        steps.append(np.full(n, step, dtype=np.int64))
        idxs.append(np.frombuffer(data, "<i4", n, at))
        norms.append(np.frombuffer(data, "<f4", n, at + 4 * n))
        posts.append(np.frombuffer(data, "<f4", n, at + 8 * n) if flags & POST_CLIP else np.full(n, np.nan, "<f4"))
        recorded.append(np.full(n, bool(flags & POST_CLIP)))
        pos = end
    if not steps:
        return {
            "step": np.zeros(0, np.int64),
            "idx": np.zeros(0, np.int32),
            "norm": np.zeros(0, np.float32),
            "norm_post_clip": np.zeros(0, np.float32),
            "post_recorded": np.zeros(0, bool),
        }
    return {
        "step": np.concatenate(steps),
        "idx": np.concatenate(idxs).astype(np.int32),
        "norm": np.concatenate(norms).astype(np.float32),
        "norm_post_clip": np.concatenate(posts).astype(np.float32),
        "post_recorded": np.concatenate(recorded),
    }


# ---------------------------------------------------------------------------------------------- stop request
# How `sftaudit watch`, or a person, asks a running shim whose guard is on to stop. The run folder is the only
# channel between the halves: the analyzer writes this file, the shim's guard reads it.
STOP_REQUEST_FILE = "stop-request.json"
STOP_REQUEST_MAX_BYTES = 64 * 1024  # a request is a few hundred bytes: anything larger is not one
STOP_REASON_CHARS = 400
_CODE = re.compile(r"[A-Za-z0-9_.:-]{1,40}")


@dataclass(frozen=True)
class StopRequest:
    """``RUN_DIR/sftaudit/stop-request.json``: one JSON object, written whole (a temporary file renamed over it)::

        {"reason": "LOOP-05 fail at step 30: non-finite gradients", "step": 30, "code": "LOOP-05",
         "requested_at": 1764662400.0}

    reason: one line, said on the training's stderr and kept in the close record (at most 400 characters, control
        characters escaped). step: the first anomalous step the request is about, or null (a plain "stop"): no
        checkpoint is saved at or after it, and the last one saved before it is kept out of rotation. code: the
        finding's code (``LOOP-05``), or null. requested_at: when (seconds since 1970): a request older than the
        recorder's start is left from an earlier segment of the run and ignored.
    An empty file (``touch RUN_DIR/sftaudit/stop-request.json``) is a request too: reason "stop requested", no step,
    requested_at its modification time. A request stays in place once acted on (the close record says so); a
    resumed run ignores it as older than its own start."""

    reason: str
    step: int | None = None
    code: str | None = None
    requested_at: float = 0.0

    def to_json(self) -> dict:
        return {"reason": self.reason, "step": self.step, "code": self.code, "requested_at": self.requested_at}


def stop_request_path(run_dir: str | Path) -> Path:
    return artifact_root(run_dir) / STOP_REQUEST_FILE


def write_stop_request(
    run_dir: str | Path,
    reason: str,
    *,
    step: int | None = None,
    code: str | None = None,
    requested_at: float | None = None,
) -> Path:
    """Ask the run's guard to stop: the request written whole (a reader never sees half of it). Returns its path."""
    request = _valid_request(
        {
            "reason": reason,
            "step": step,
            "code": code,
            "requested_at": time.time() if requested_at is None else requested_at,
        }
    )
    path = stop_request_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".stop-request-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(request.to_json(), f, ensure_ascii=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_stop_request(run_dir: str | Path) -> StopRequest | None:
    """The run's stop request; None when there is none. A file that is not one raises, saying why: `safe_io.UnsafeFile`
    (not a regular file inside the run folder, or over 64 KiB) or ValueError (not the object `StopRequest` describes)."""
    path = stop_request_path(run_dir)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    data = read_bytes(path, artifact_root(run_dir), STOP_REQUEST_MAX_BYTES)
    if not data.strip():
        return StopRequest("stop requested", requested_at=st.st_mtime)
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    return _valid_request(doc)


def _valid_request(doc: object) -> StopRequest:
    if not isinstance(doc, dict):
        raise ValueError("a stop request is a JSON object")
    reason, step, code, at = doc.get("reason"), doc.get("step"), doc.get("code"), doc.get("requested_at")
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError("a stop request's reason must be a non-empty string")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError("a stop request's step must be a non-negative integer or null")
    if code is not None and (not isinstance(code, str) or not _CODE.fullmatch(code)):
        raise ValueError("a stop request's code must be a finding code such as LOOP-05, or null")
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
        raise ValueError("a stop request's requested_at must be a number (seconds since 1970)")
    reason = shown(" ".join(reason.split()))[:STOP_REASON_CHARS]
    return StopRequest(reason, step, code, float(at))
