"""The run's own noise of a logged series (`point_noise`), carried from one audit to the next.

The loss-curve rules (LOOP-10, LOOP-19, LOOP-27) judge each value against the noise of the values around it: the
robust sigma of the second differences pooled over a few blocks of rows, a median per block, a million rows in a
run of 10^6 steps. A block's sigma depends only on the values of the blocks it pools, so once later blocks exist
it never changes while those values stay as they were. The audit keeps each series' values and block sigmas beside
the run's database (``carried-noise-<name>.npz``) and the next one computes only the blocks that pool a value that
changed or is new. What was carried is checked against the values themselves, bit for bit, so a resume that
rewrote the end of the log, or any other change, is judged again from where it begins.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..store.rundb import database_dir
from .stats.curve import NOISE_POINTS, NOISE_REACH, block_noise, log_values, noise_block

FORMAT = 1


def carried_point_noise(ctx, name: str, values: np.ndarray) -> np.ndarray:
    """`point_noise(log_values(values))`, the blocks the audit before computed for the same values taken as they
    were; within an audit, computed once per `name` (the checks that judge the same series share it)."""
    x = log_values(values)
    done = ctx.__dict__.setdefault("_point_noise", {})
    if name in done and _same(done[name][0], x):
        return done[name][1]
    folder = _folder(ctx.run_dir)
    path = folder / f"carried-noise-{name}.npz" if folder else None
    old_x, old_sigma = _load(path) if path else (None, None)
    block = noise_block(x.size)
    keep = _unchanged_blocks(old_x, x, block, old_sigma.size if old_sigma is not None else 0)
    sigma = np.concatenate([old_sigma[:keep] if keep else np.zeros(0), block_noise(x, first_block=keep)])
    if path:
        _save(path, x, sigma)
    noise = np.repeat(sigma, block)[: x.size]
    done[name] = (x, noise)
    return noise


def _unchanged_blocks(old_x: np.ndarray | None, x: np.ndarray, block: int, old_blocks: int) -> int:
    """How many leading blocks pool only second differences that are as they were: each block pools `reach`
    blocks on each side, shifted inward at the run's ends; a second difference at row i reads rows i - 1..i + 1,
    and the old values' last row had none."""
    width = 2 * NOISE_REACH + 1
    if old_x is None or noise_block(old_x.size) != block or old_blocks != -(-old_x.size // block):
        return 0
    if old_blocks < width or -(-x.size // block) < width:  # a window clipped at both ends: none is carried
        return 0
    m = min(old_x.size, x.size)
    differ = old_x[:m].view(np.int64) != x[:m].view(np.int64)
    first_changed = int(np.argmax(differ)) if differ.any() else m
    first_difference = max(0, min(first_changed - 1, old_x.size - 1))
    changed_block = first_difference // block
    # Block b pools blocks max(b, reach) - reach .. max(b, reach) + reach: the first ones all pool 0..2 x reach.
    return changed_block - NOISE_REACH if changed_block > 2 * NOISE_REACH else 0


def _folder(run_dir) -> Path | None:
    """The run's cache folder when the audit made one (a check judged on a bare context has none)."""
    try:
        folder = database_dir(run_dir)
    except InputError:
        return None
    return folder if folder.is_dir() else None


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool((a.view(np.int64) == b.view(np.int64)).all())


def _load(path) -> tuple[np.ndarray | None, np.ndarray | None]:
    try:
        with np.load(path, allow_pickle=False) as state:
            meta, x, sigma = state["meta"], state["x"], state["sigma"]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None, None
    if meta.tolist() != [FORMAT, NOISE_POINTS, NOISE_REACH] or x.dtype != np.float64 or sigma.dtype != np.float64:
        return None, None
    return x, sigma


def _save(path, x: np.ndarray, sigma: np.ndarray) -> None:
    """Written whole or not at all; a cache folder that cannot be written only costs the next audit the work."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, meta=np.array([FORMAT, NOISE_POINTS, NOISE_REACH]), x=x, sigma=sigma)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
