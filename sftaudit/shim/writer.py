"""Append-only, crash-safe JSONL writer: one file per record kind, one rank folder.

Each record is written as one line and flushed to the OS at once, so a SIGKILL
loses nothing already written (only a power cut can lose the page cache; `sync()`
fsyncs, and the recorder calls it at checkpoints). A killed process leaves at most
one incomplete last line, which readers skip.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import IO

from ..artifacts import RECORD_KINDS


class JsonlWriter:
    def __init__(self, folder: Path):
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, IO[str]] = {}
        self._lock = threading.Lock()  # checkpoint hashing writes from a worker thread

    def write(self, kind: str, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        with self._lock:
            f = self._files.get(kind)
            if f is None:
                if kind not in RECORD_KINDS:
                    raise ValueError(f"unknown record kind {kind!r}")
                f = self._files[kind] = open(self.folder / f"{kind}.jsonl", "a", encoding="utf-8")
                _terminate_torn_line(f, self.folder / f"{kind}.jsonl")
            f.write(line)
            f.flush()

    def sync(self) -> None:
        import os

        with self._lock:
            for f in self._files.values():
                f.flush()
                os.fsync(f.fileno())

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


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
