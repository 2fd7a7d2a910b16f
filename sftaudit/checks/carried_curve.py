"""The statistics of a logged series the loss-curve rules judge each value against, carried from one audit to the next.

The loss-curve rules (LOOP-10, LOOP-19, LOOP-27) judge each value against the run's own noise around it
(`point_noise`: the robust sigma of the second differences pooled over a few blocks of rows, a median per block)
and against its running level (`rolling_level`: the median of the values before it), a median a row in a run of
10^6 steps. A block's noise depends only on the values of the blocks it pools, a row's level only on the values
before it, so neither changes while those values stay as they were. The audit keeps each series' values, block
noise and levels beside the run's database (``carried-curve-<name>.arrays``; a long series' up to its last multiple
of `CURVE_CHUNK` rows, written only when that moves) and the next one computes only what reads a value past them,
changed or new. What was carried is checked against the values themselves, bit for bit, so
a resume that rewrote the end of the log, or any other change, is judged again from where it begins.

The rules' thresholds scale with the run's upper-tail factor of the values' z (`tail_factor`: a median, a median
absolute deviation and a quantile of a million z each). The z of the closed rows (all but the last ones, a multiple
of `TAIL_CHUNK`) are carried sorted (``carried-tail-<name>.arrays``, beside the z themselves, which the next audit
compares with its own bit for bit); the open rows' are merged in and the factor read off the sorted whole.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..store.rundb import database_dir
from .carried_arrays import load_arrays, save_arrays
from .stats.curve import (
    LEVEL_POINTS,
    NOISE_POINTS,
    NOISE_REACH,
    block_noise,
    excursion_scores,
    excursions,
    log_values,
    noise_block,
)
from .stats.rolling import rolling_level, sorted_tail_factor, tail_factor

FORMAT = 1
TAIL_CHUNK = 1 << 16  # rows of z closed into the carried sorted ones at a time: saved once in so many new rows
TAIL_OPEN = 1024  # the last rows stay open: their z moves with the rows after them (a block's noise, a neighbour)
# A long series' curve is saved up to a multiple of this many rows, only when that moves: a watch's poll found a
# few new rows and wrote the three carried curves whole (14 MB each at 860,000 steps); the next audit computes
# again from there (at most this many rows' levels and their blocks' noise, a few ms).
CURVE_CHUNK = 1 << 13


@dataclass(frozen=True)
class Curve:
    """A series' log values, each one's `point_noise` and its running level (`rolling_level` of `LEVEL_POINTS`)."""

    x: np.ndarray
    noise: np.ndarray
    level: np.ndarray


def carried_curve(ctx, name: str, values: np.ndarray, lens=None) -> Curve:
    """`Curve` of `values`, what the audit before computed for the same values taken as it was; within an audit,
    computed once per `name` (the checks that judge the same series share it). `lens`: a transform of the log
    values to judge them through instead (`stats.curve.LENSES`), under a `name` of its own."""
    x = log_values(values) if lens is None else lens(log_values(values))
    done = ctx.shared("carried_curves", dict)
    if name in done and _same(done[name].x, x):
        return done[name]
    folder = _folder(ctx.run_dir)
    path = folder / f"carried-curve-{name}.arrays" if folder else None
    old = _load(path) if path else None
    block = noise_block(x.size)
    changed = _first_changed(old.x, x) if old else 0
    keep = _unchanged_blocks(old, x.size, block, changed) if old else 0
    sigma = np.concatenate([old.noise[:keep] if keep else np.zeros(0), block_noise(x, first_block=keep)])
    # A row's level reads the LEVEL_POINTS rows before it: the rows up to the first changed one are as they were.
    rows = changed if changed >= LEVEL_POINTS else 0
    if rows:
        fresh = rolling_level(x[rows - LEVEL_POINTS :], LEVEL_POINTS)[LEVEL_POINTS:]
        level = np.concatenate([old.level[:rows], fresh])
    else:
        level = rolling_level(x, LEVEL_POINTS)
    saved = x.size // CURVE_CHUNK * CURVE_CHUNK or x.size  # a short series is saved whole
    if path and (old is None or changed < old.x.size or saved != old.x.size):
        _save(path, Curve(x[:saved], sigma[: -(-saved // block)], level[:saved]))
    curve = done[name] = Curve(x, np.repeat(sigma, block)[: x.size], level)
    return curve


def carried_excursions(ctx, name: str, values: np.ndarray, sigma: float, diverge_steps: int, min_effect: float) -> dict:
    """`excursions` of `values` against their `carried_curve`; the scores it judges (z, the tail factor: a few
    passes over every value) computed once an audit per `name` for the checks that judge the same series with their
    own thresholds (LOOP-10 and LOOP-19 the loss)."""
    curve = carried_curve(ctx, name, values)
    scored = ctx.shared("curve_scores", dict)
    if name not in scored or scored[name][0] is not curve:
        scored[name] = (
            curve,
            excursion_scores(
                values, noise=curve.noise, level=curve.level, tail_of=lambda z: carried_tail(ctx, f"{name}-rise", z)
            ),
        )
    return excursions(values, sigma, diverge_steps, min_effect, scores=scored[name][1])


def carried_tail(ctx, name: str, z: np.ndarray) -> float:
    """`tail_factor` of the finite values of `z` (every row's, NaN where not judged), bit for bit: the sorted finite
    z of the closed rows (the first multiple of `TAIL_CHUNK` rows short of the last `TAIL_OPEN`) taken from the
    audit before when those rows' z are as they were, the others sorted and merged in."""
    closed = max(0, (z.size - TAIL_OPEN) // TAIL_CHUNK * TAIL_CHUNK)
    folder = _folder(ctx.run_dir)
    if not closed or folder is None:
        return tail_factor(z[np.isfinite(z)])
    path = folder / f"carried-tail-{name}.arrays"
    state = load_arrays(path) or {}
    old_z, old_sorted = state.get("z"), state.get("sorted")
    if (
        isinstance(old_z, np.ndarray)
        and isinstance(old_sorted, np.ndarray)
        and old_z.dtype == old_sorted.dtype == np.float64
        and old_z.ndim == old_sorted.ndim == 1
        and old_z.size <= closed
        and _same(old_z, z[: old_z.size])
    ):
        done, ascending = old_z.size, old_sorted
    else:
        done, ascending = 0, np.zeros(0)
    if closed > done:
        ascending = _merged(ascending, z[done:closed])
        with contextlib.suppress(OSError):  # a cache folder that cannot be written only costs the next audit
            save_arrays(path, {"z": z[:closed], "sorted": ascending})
    return sorted_tail_factor(_merged(ascending, z[closed:]))


def _merged(ascending: np.ndarray, z: np.ndarray) -> np.ndarray:
    """The sorted `ascending` with the finite values of `z` merged in, sorted."""
    new = np.sort(z[np.isfinite(z)])
    return np.insert(ascending, np.searchsorted(ascending, new), new)


def _first_changed(old_x: np.ndarray, x: np.ndarray) -> int:
    """The first row whose value differs (bit for bit), or the shorter length."""
    m = min(old_x.size, x.size)
    differ = old_x[:m].view(np.int64) != x[:m].view(np.int64)
    return int(np.argmax(differ)) if differ.any() else m


def _unchanged_blocks(old: Curve, n: int, block: int, changed: int) -> int:
    """How many leading blocks of noise pool only second differences that are as they were: each block pools
    `reach` blocks on each side, shifted inward at the run's ends; a second difference at row i reads rows
    i - 1..i + 1, and the old values' last row had none."""
    width = 2 * NOISE_REACH + 1
    old_blocks = -(-old.x.size // block)
    if noise_block(old.x.size) != block or old.noise.size != old_blocks:
        return 0
    if old_blocks < width or -(-n // block) < width:  # a window clipped at both ends: none is carried
        return 0
    changed_block = max(0, min(changed - 1, old.x.size - 1)) // block
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


def _load(path) -> Curve | None:
    """The carried block noise (in `Curve.noise`) and levels, or None when absent, torn or of another kind."""
    state = load_arrays(path)
    try:
        meta, x, noise, level = state["meta"], state["x"], state["noise"], state["level"]
    except (TypeError, KeyError):  # none, or not what `_save` writes
        return None
    if meta.tolist() != [FORMAT, NOISE_POINTS, NOISE_REACH, LEVEL_POINTS] or level.shape != x.shape:
        return None
    if not all(a.dtype == np.float64 and a.ndim == 1 for a in (x, noise, level)):
        return None
    return Curve(x, noise, level)


def _save(path, carried: Curve) -> None:
    """Written whole or not at all; a cache folder that cannot be written only costs the next audit the work."""
    meta = np.array([FORMAT, NOISE_POINTS, NOISE_REACH, LEVEL_POINTS])
    with contextlib.suppress(OSError):
        save_arrays(path, {"meta": meta, "x": carried.x, "noise": carried.noise, "level": carried.level})
