"""The artifact format: the contract between the shim (writer) and the analyzer (reader).

Everything the shim records lives under ``RUN_DIR/sftaudit/``::

    RUN_DIR/sftaudit/
      tokenizer/              the run's tokenizer (save_pretrained), written once by rank 0
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

This module is imported by both halves, so it must stay free of torch and DuckDB.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .schema.records import RECORDS

SCHEMA_VERSION = 1
ARTIFACT_DIR = "sftaudit"
TOKENIZER_DIR = "tokenizer"
DATABASE_FILE = "audit.duckdb"

# One file per record kind, each declared field by field in sftaudit/schema/records.py.
RECORD_KINDS = tuple(RECORDS)

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
