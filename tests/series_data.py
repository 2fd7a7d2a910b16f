"""Test data: a run folder holding only the columnar gradient-norm series and the manifests that name
its tensors, in the layout the shim's Parquet writer uses (sftaudit/checks/engines.py describes it):

    RUN_DIR/sftaudit/series/grad_norms/rank=<r>/seg=<s>/part-<first step, 9 digits>.parquet
    RUN_DIR/sftaudit/rank-<r>/manifest.jsonl   (one record per segment; `params` names the tensors)

with the writer's other files beside the parts (a hidden part being written, the journal of the
steps since the last part), which no engine may read as parts.

Written here with pyarrow so the engines can be tested without training; a recorded run has the same
folders. Used by tests/test_second_engine.py and benchmarks/second_engine.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sftaudit.checks.engines import series_root
from sftaudit.core.artifacts import SCHEMA_VERSION, rank_dir


def write_manifest(run_dir: Path, rank: int, seg: int, names: list[str]) -> None:
    """Append one segment's manifest record with its parameter list (the shim writes more fields)."""
    folder = rank_dir(run_dir, rank)
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "schema_version": SCHEMA_VERSION,
        "seg": seg,
        "run_id": "series-test",
        "world_size": 2,
        "params": [{"name": n, "dtype": "float32", "shape": [64], "numel": 64, "requires_grad": True} for n in names],
    }
    with open(folder / "manifest.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def write_parts(
    run_dir: Path, rank: int, seg: int, first_step: int, norms: np.ndarray, steps_per_part: int = 1000
) -> int:
    """Write a steps x tensors matrix of norms (float32, NaN/inf kept) as the parts of one segment, from
    `first_step` on, `steps_per_part` steps per file; returns the bytes written."""
    folder = series_root(run_dir) / f"rank={rank}" / f"seg={seg}"
    folder.mkdir(parents=True, exist_ok=True)
    n_steps, n_tensors = norms.shape
    written = 0
    for start in range(0, n_steps, steps_per_part):
        block = np.asarray(norms[start : start + steps_per_part], dtype=np.float32)
        steps = np.repeat(np.arange(first_step + start, first_step + start + block.shape[0], dtype=np.int64), n_tensors)
        idx = np.tile(np.arange(n_tensors, dtype=np.int32), block.shape[0])
        table = pa.table(
            {"step": steps, "idx": idx, "norm": block.reshape(-1), "norm_post_clip": pa.nulls(steps.size, pa.float32())}
        )  # NULL unless the Trainer clipped
        path = folder / f"part-{first_step + start:09d}.parquet"
        pq.write_table(table, path, compression="zstd")
        written += path.stat().st_size
    # What else the writer leaves in the folder: a part being written and the journal of the steps since.
    (folder / f".part-{first_step + n_steps:09d}.parquet.tmp").write_bytes(b"PAR1 torn")
    (folder / f"journal-{first_step + n_steps:09d}.bin").write_bytes(b"\x00" * 64)
    return written


def noisy_norms(rng: np.random.Generator, n_steps: int, n_tensors: int) -> np.ndarray:
    """Log-normal gradient norms: each tensor its own level (embeddings and norms differ by orders of
    magnitude), 20% step-to-step noise."""
    level = rng.uniform(-4.0, 1.0, size=n_tensors)
    return np.exp(level + 0.2 * rng.standard_normal((n_steps, n_tensors))).astype(np.float32)
