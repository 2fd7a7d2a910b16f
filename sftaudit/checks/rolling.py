"""Robust running statistics shared by the dynamics checks (LOOP-05, LOOP-06, LOOP-10), vectorised.

A running median over a sliding window costs O(steps x window) per series: at 100,000 steps x
200 tensors that is minutes. The baseline here is the median and MAD of the *previous block* of
`window` steps instead (blocks are a reshape and one `np.median`), so each step is judged
against between `window` and 2 x `window` steps of its own history, none of which include it.
"""

from __future__ import annotations

import warnings

import numpy as np

MAD_TO_SIGMA = 1.4826  # MAD x this estimates the standard deviation of normal data


def adaptive_window(n_steps: int, lo: int = 8, hi: int = 128) -> int:
    """History length for a run: 1/16 of it, at least `lo` steps (short runs), at most `hi` (OLMo-core's 128)."""
    return int(min(hi, max(lo, n_steps // 16)))


def warmup_end(lr: np.ndarray) -> int:
    """Index of the first step whose learning rate no longer rises: the end of the warmup.

    A later jump (a scheduler bug) does not extend it: only the initial rise counts."""
    lr = np.asarray(lr, dtype=float)
    if lr.size < 2 or not np.isfinite(lr).all():
        return 0
    stops = np.flatnonzero(lr[1:] <= lr[:-1])
    return int(stops[0]) if stops.size else lr.size - 1


def previous_block_stats(values: np.ndarray, window: int, sigma_blocks: int = 1,
                         min_share: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Per row (step) and column (series): median and robust sigma (1.4826 x MAD) of the previous block.

    `values` is steps x series (a 1-D array is one series). Rows of the first block get NaN (no
    history yet). Non-finite values are ignored inside a block; a block with fewer than
    `min_share` of its values finite is no baseline (NaN). With `sigma_blocks` > 1 the sigma is
    the median of the previous `sigma_blocks` blocks' sigmas: the level follows the latest block,
    while the dispersion, a property of the run, comes from a longer history that one unusually
    calm or volatile block does not set."""
    x = np.asarray(values)
    x = x if x.dtype.kind == "f" else x.astype(float)  # float32 stays float32 (half the memory traffic)
    squeeze = x.ndim == 1
    if squeeze:
        x = x[:, None]
    n, k = x.shape
    blocks = n // window  # complete blocks; only they serve as a baseline
    median = np.full((n, k), np.nan, dtype=x.dtype)
    sigma = np.full((n, k), np.nan, dtype=x.dtype)
    if blocks >= 1 and n > window:
        b = x[: blocks * window].reshape(blocks, window, k)
        b = np.where(np.isfinite(b), b, np.nan)
        agg = np.nanmedian if np.isnan(b).any() else np.median
        with warnings.catch_warnings():  # an all-NaN block (a NaN stretch) has no baseline: NaN is the answer
            warnings.simplefilter("ignore", RuntimeWarning)
            med = agg(b, axis=1)
            sig = MAD_TO_SIGMA * agg(np.abs(b - med[:, None, :]), axis=1)
            if min_share > 0:
                few = np.isfinite(b).sum(axis=1) < min_share * window
                med[few], sig[few] = np.nan, np.nan
            if sigma_blocks > 1:
                history = np.concatenate([np.full((sigma_blocks - 1, k), np.nan, dtype=sig.dtype), sig])
                sig = np.nanmedian(np.lib.stride_tricks.sliding_window_view(history, sigma_blocks, axis=0), axis=-1)
        owner = np.arange(window, n) // window - 1  # the block before each row's own block
        median[window:] = med[owner]
        sigma[window:] = sig[owner]
    if squeeze:
        return median[:, 0], sigma[:, 0]
    return median, sigma


def robust_z(values: np.ndarray, median: np.ndarray, sigma: np.ndarray, floor: float) -> np.ndarray:
    """(value - median) / sigma, with sigma floored so a flat history does not turn noise into alarms."""
    with np.errstate(invalid="ignore"):
        return (values - median) / np.maximum(sigma, floor)


def runs_of(mask: np.ndarray, length: int) -> np.ndarray:
    """Indices where `mask` has been true for `length` consecutive rows (the index of the last row)."""
    mask = np.asarray(mask, dtype=bool)
    if length <= 1:
        return np.flatnonzero(mask)
    counts = np.convolve(mask.astype(int), np.ones(length, dtype=int), mode="full")[: mask.size]
    return np.flatnonzero(counts >= length)


def dominant_period(steps: np.ndarray, min_events: int = 4, share: float = 0.75) -> int | None:
    """The interval that separates most consecutive events (>= `share` of gaps), if it is > 1."""
    steps = np.unique(np.asarray(steps))
    if steps.size < min_events:
        return None
    gaps = np.diff(steps)
    values, counts = np.unique(gaps, return_counts=True)
    best = int(values[np.argmax(counts)])
    return best if best > 1 and counts.max() >= share * gaps.size else None


def step_frame(ctx, *columns: str):
    """Rank 0's per-step columns in step order (one row per step: ingest sets abandoned resumed steps aside)."""
    return ctx.frame(f"SELECT step, {', '.join(columns)} FROM steps WHERE rank = 0 ORDER BY step")


def grad_norm_matrix(ctx) -> tuple[np.ndarray, list[str], np.ndarray]:
    """(steps, tensor names, steps x tensors norms) of rank 0, NaN where a tensor had no gradient.

    Several checks need it; it is read once per audit and kept on the context."""
    cached = ctx.__dict__.get("_grad_norm_matrix")
    if cached is None:
        steps = ctx.con.sql("SELECT DISTINCT step FROM steps WHERE rank = 0 ORDER BY step").fetchnumpy()["step"]
        names = [r[0] for r in ctx.con.execute(
            "SELECT name FROM params WHERE rank = 0 AND idx IS NOT NULL AND seg = (SELECT max(seg) FROM params WHERE rank = 0) "
            "ORDER BY idx").fetchall()]
        cells = ctx.con.sql("SELECT step, idx, norm FROM grad_norms WHERE rank = 0").fetchnumpy()
        norms = np.full((steps.size, len(names)), np.nan)
        contiguous = steps.size and steps[-1] - steps[0] == steps.size - 1  # the usual case: no search needed
        rows = cells["step"] - steps[0] if contiguous else np.searchsorted(steps, cells["step"])
        norms[rows, cells["idx"]] = cells["norm"]
        cached = ctx.__dict__["_grad_norm_matrix"] = (np.asarray(steps), names, norms)
    return cached
