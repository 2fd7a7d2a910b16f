"""The sha256 of a checkpoint file, one definition for both halves: the shim records it after a save,
LOOP-09 recomputes it to find files changed since; the two must agree byte for byte.

Imported by the shim and the analyzer alike, so it stays free of torch and DuckDB.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CHUNK_BYTES = 1 << 20  # streamed: a multi-gigabyte shard never sits in memory


def file_sha256(path: str | Path, chunk_bytes: int = CHUNK_BYTES) -> str:
    """Hex sha256 of a file's bytes, read in bounded chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(chunk_bytes), b""):
            h.update(chunk)
    return h.hexdigest()
