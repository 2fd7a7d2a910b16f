"""Append-only, crash-safe artifact writer: one JSONL file per record kind, one rank folder, and the
per-tensor gradient norms of the ``steps`` records in the columnar series (see `sftaudit.core.artifacts`).

Each record is written as one line and flushed to the OS at once, so a SIGKILL
loses nothing already written (only a power cut can lose the page cache; `sync()`
fsyncs, and the recorder calls it at checkpoints). A killed process leaves at most
one incomplete last line, which readers skip.

A step's norms go to the series journal (flushed) before its ``steps`` line, so a step with a record
always has its norms. Every ``ROLL_STEPS`` steps or ``ROLL_VALUES`` values a background thread turns
the buffered steps into a Parquet part and deletes their journal; the step that triggers it pays only
for handing the buffers over. Without pyarrow in the training environment the journals stay (readers
read them as well); they are about 8 bytes a value instead of a part's 3.3.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from pathlib import Path
from typing import IO

import numpy as np

from ..core.artifacts import (
    GRAD_SERIES,
    RECORD_KINDS,
    ROLL_STEPS,
    ROLL_VALUES,
    SERIES_DIR,
    journal_name,
    journal_record,
    part_name,
    read_journal,
)
from ..schema.records import GRAD_NORM_SERIES

try:  # pyarrow is imported once, at startup, not on a step
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:  # pragma: no cover - the shim's own dependencies do not include it
    pa = pq = None

_JOURNAL = re.compile(r"journal-(\d{9,})\.bin")
_TAIL_BYTES = 1 << 20  # the end of steps.jsonl read on a resume: thousands of records
_PART_OPTIONS = {
    "compression": "zstd",
    "compression_level": 3,
    "use_dictionary": False,
    "column_encoding": {
        "step": "DELTA_BINARY_PACKED",
        "idx": "DELTA_BINARY_PACKED",
        "norm": "BYTE_STREAM_SPLIT",
        "norm_post_clip": "BYTE_STREAM_SPLIT",
    },
}


# One encoder for every record: json.dumps with options builds a new one per call.
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class JsonlWriter:
    def __init__(self, folder: Path, roll_steps: int = ROLL_STEPS, roll_values: int = ROLL_VALUES):
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, IO[str]] = {}
        self._lock = threading.Lock()  # checkpoint hashing writes from a worker thread
        rank = folder.name.removeprefix("rank-")
        self._series = (
            GradSeries(
                folder.parent / SERIES_DIR / GRAD_SERIES / f"rank={rank}",
                folder / "steps.jsonl",
                roll_steps,
                roll_values,
            )
            if rank.isdigit()
            else None
        )

    def write(self, kind: str, record: dict) -> None:
        columns = None
        if (
            kind == "steps"
            and self._series is not None
            and (record.get("grad_norms") is not None or record.get("grad_norms_post_clip") is not None)
        ):
            record = dict(record)
            columns = _step_columns(record.pop("grad_norms", None), record.pop("grad_norms_post_clip", None))
        line = _encode(record) + "\n"
        with self._lock:
            f = self._files.get(kind)
            if f is None:
                if kind not in RECORD_KINDS:
                    raise ValueError(f"unknown record kind {kind!r}")
                # A lone surrogate (a sample id decoded with surrogateescape) cannot be UTF-8: written as its
                # JSON escape (`\\udc80`, inside the JSON string it came in), the record is kept.
                f = self._files[kind] = open(
                    self.folder / f"{kind}.jsonl", "a", encoding="utf-8", errors="backslashreplace"
                )
                _terminate_torn_line(f, self.folder / f"{kind}.jsonl")
            if columns is not None:
                self._series.append(record.get("seg", 0), record["step"], *columns)
            f.write(line)
            f.flush()
            if columns is not None:
                self._series.maybe_roll()

    def sync(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.flush()
                os.fsync(f.fileno())
            if self._series is not None:
                self._series.sync()

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
            if self._series is not None:
                self._series.close()


def _step_columns(norms, post) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(idx, norm, post) of the tensors that have a norm this step (None: no gradient; NaN kept)."""
    given = norms if norms is not None else post
    values = np.asarray(given, dtype=np.float32)
    clipped = None if post is None else np.asarray(post, dtype=np.float32)
    if None not in given:  # the usual step: every tensor has a norm (a list of floats: no numpy call to tell)
        idx = _every(len(values))
    else:  # None became NaN too: tell them apart only when there is one
        idx = np.flatnonzero(np.asarray(norms if norms is not None else post, dtype=object) != None)  # noqa: E711
        idx = idx.astype(np.int32)
        values = values[idx]
        clipped = None if clipped is None else clipped[idx]
    return idx, values if norms is not None else np.full(len(idx), np.nan, np.float32), clipped


@functools.lru_cache(maxsize=4)
def _every(n: int) -> np.ndarray:
    idx = np.arange(n, dtype=np.int32)
    idx.flags.writeable = False  # shared by every buffered step
    return idx


class GradSeries:
    """One rank's gradient-norm series: the journal of the current part, and the parts written."""

    def __init__(self, root: Path, steps_file: Path, roll_steps: int, roll_values: int):
        self.root = root
        self.roll_steps, self.roll_values = roll_steps, roll_values
        self._journal: IO[bytes] | None = None
        self._where: tuple[Path, int] | None = None  # (segment folder, first step) of the open journal
        self._seg, self._seg_folder = None, None  # the last segment appended to, and its folder
        self._buffer: list[tuple[int, np.ndarray, np.ndarray, np.ndarray | None]] = []
        self._values = 0
        self._thread: threading.Thread | None = None
        self._recover(steps_file)

    def append(self, seg: int, step: int, idx: np.ndarray, norm: np.ndarray, post: np.ndarray | None) -> None:
        if seg != self._seg:
            self._seg, self._seg_folder = seg, self.root / f"seg={seg}"
        folder = self._seg_folder
        if self._where is not None and self._where[0] != folder:
            self.roll()
        if self._journal is None:
            folder.mkdir(parents=True, exist_ok=True)
            self._where = (folder, step)
            self._journal = open(folder / journal_name(step), "ab")
        self._journal.write(journal_record(step, idx, norm, post))
        self._journal.flush()
        self._buffer.append((step, idx, norm, post))
        self._values += len(idx)

    def maybe_roll(self) -> None:
        if len(self._buffer) >= self.roll_steps or self._values >= self.roll_values:
            self.roll()

    def roll(self, background: bool = True) -> None:
        """Close the journal; its steps become a part (in a thread), then the journal goes."""
        if self._journal is None:
            return
        self._journal.close()
        (folder, first), buffer = self._where, self._buffer
        self._journal, self._where, self._buffer, self._values = None, None, [], 0
        if pq is None:
            return  # the journal is the record
        self._join()
        work = (folder, first, buffer)
        if background:
            self._thread = threading.Thread(target=_write_part_quietly, args=work, name="sftaudit-parts", daemon=True)
            self._thread.start()
        else:
            _write_part_quietly(*work)

    def sync(self) -> None:
        """The journal on disk, and the part being written finished (at checkpoints: rare, ~0.1 s)."""
        if self._journal is not None:
            os.fsync(self._journal.fileno())
        self._join()

    def close(self) -> None:
        self.roll(background=False)
        self._join()

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _recover(self, steps_file: Path) -> None:
        """What a killed shim left on this rank: half-written parts go, and each journal whose part was
        not written becomes one (without a step whose record never made it to steps.jsonl)."""
        if not self.root.is_dir():
            return
        last = None
        for folder in sorted(p for p in self.root.glob("seg=*") if p.is_dir()):
            for tmp in folder.glob(".part-*.tmp"):
                tmp.unlink(missing_ok=True)
            for journal in sorted(folder.glob("journal-*.bin")):
                m = _JOURNAL.fullmatch(journal.name)
                if not m:
                    continue
                first = int(m.group(1))
                if (folder / part_name(first)).exists():
                    journal.unlink(missing_ok=True)  # killed between the part's rename and this delete
                    continue
                if pq is None:
                    continue
                if last is None:
                    last = _last_steps(steps_file)
                seg = folder.name.removeprefix("seg=")
                columns = read_journal(journal.read_bytes())
                # A segment whose last records are out of reach keeps them all (a resume supersedes them).
                keep = (
                    columns["step"] <= last.get(int(seg), np.iinfo(np.int64).max)
                    if seg.isdigit()
                    else np.zeros(len(columns["step"]), bool)
                )
                columns = {k: v[keep] for k, v in columns.items()}
                if len(columns["step"]):
                    _write_part(folder, first, _table(columns))
                journal.unlink(missing_ok=True)


def _last_steps(steps_file: Path) -> dict[int, int]:
    """The last step with a complete record, per segment among the records at the end of steps.jsonl
    (a journal the killed shim left is the latest segment's, whose last records are there)."""
    if not steps_file.exists():
        return {}
    with open(steps_file, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - _TAIL_BYTES))
        lines = f.read().split(b"\n")[1 if size > _TAIL_BYTES else 0 : -1]  # complete lines only
    last: dict[int, int] = {}
    for line in lines:
        try:
            r = json.loads(line)
            seg, step = int(r.get("seg", 0)), int(r["step"])
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
        last[seg] = max(last.get(seg, step), step)
    return last


def _table(columns: dict[str, np.ndarray]):
    post, recorded = columns["norm_post_clip"], columns["post_recorded"]
    arrays = [
        _arrow(columns["step"], pa.int64(), "<i8"),
        _arrow(columns["idx"], pa.int32(), "<i4"),
        _arrow(columns["norm"], pa.float32(), "<f4"),
        _arrow(post, pa.float32(), "<f4", None if recorded.all() else recorded),
    ]
    return pa.Table.from_arrays(arrays, names=[f.name for f in GRAD_NORM_SERIES.fields])


def _arrow(values: np.ndarray, kind, dtype: str, valid: np.ndarray | None = None):
    """An Arrow array over the numpy buffer (pa.array would import pandas, seconds on a training node)."""
    bitmap = None if valid is None else pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(kind, len(values), [bitmap, pa.py_buffer(np.ascontiguousarray(values, dtype))])


def _buffer_table(buffer: list[tuple[int, np.ndarray, np.ndarray, np.ndarray | None]]):
    lengths = np.array([len(b[1]) for b in buffer])
    post = [b[3] if b[3] is not None else np.full(len(b[1]), np.nan, np.float32) for b in buffer]
    return _table(
        {
            "step": np.repeat(np.array([b[0] for b in buffer], dtype=np.int64), lengths),
            "idx": np.concatenate([b[1] for b in buffer]),
            "norm": np.concatenate([b[2] for b in buffer]),
            "norm_post_clip": np.concatenate(post),
            "post_recorded": np.repeat(np.array([b[3] is not None for b in buffer]), lengths),
        }
    )


def _write_part(folder: Path, first: int, table) -> None:
    tmp = folder / f".{part_name(first)}.tmp"
    pq.write_table(table, tmp, row_group_size=max(len(table), 1), **_PART_OPTIONS)
    os.replace(tmp, folder / part_name(first))


def _write_part_quietly(folder: Path, first: int, buffer: list) -> None:
    """The background half of a roll. Training never waits on it or sees it fail: on an error the
    journal stays, and readers read that instead."""
    try:
        _write_part(folder, first, _buffer_table(buffer))
    except Exception:  # noqa: BLE001 - a disk full here must not stop the run; the journal is intact
        (folder / f".{part_name(first)}.tmp").unlink(missing_ok=True)
        return
    (folder / journal_name(first)).unlink(missing_ok=True)


def _terminate_torn_line(f: IO[str], path: Path) -> None:
    """A resumed run appends after a line torn by a crash: end it so the next record parses."""
    size = path.stat().st_size
    if size:
        with open(path, "rb") as raw:
            raw.seek(size - 1)
            if raw.read(1) != b"\n":
                f.write("\n")


def read_jsonl(path: Path) -> list[dict]:
    """Complete records of one artifact file (the torn last line, if any, is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
