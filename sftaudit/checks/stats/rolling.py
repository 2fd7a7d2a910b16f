"""Robust running statistics shared by the dynamics checks (LOOP-05, LOOP-06, LOOP-10), vectorised.

A running median over a sliding window costs O(steps x window) per series: at 100,000 steps x
200 tensors that is minutes. The baseline here is the median and MAD of the *previous block* of
`window` steps instead (blocks are a reshape and one `np.median`), so each step is judged
against between `window` and 2 x `window` steps of its own history, none of which include it.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

MAD_TO_SIGMA = 1.4826  # MAD x this estimates the standard deviation of normal data
QUANTUM_SAMPLE = 1024  # values a rounding is first tried on (`log_quantum`)


# A run's history window: 1/16 of it, at least 8 steps (short runs), at most 128 (OLMo-core's).
WINDOW_MIN, WINDOW_MAX, WINDOW_SHARE = 8, 128, 16


def adaptive_window(n_steps: int, lo: int = WINDOW_MIN, hi: int = WINDOW_MAX) -> int:
    """History length for a run: 1/`WINDOW_SHARE` of it, at least `lo` steps, at most `hi`."""
    return int(min(hi, max(lo, n_steps // WINDOW_SHARE)))


def warmup_end(lr: np.ndarray, skipped: np.ndarray | None = None) -> int:
    """Index of the first step whose learning rate no longer rises: the end of the warmup.

    A later jump (a scheduler bug) does not extend it: only the initial rise counts. A step the
    optimizer skipped (`skipped`: an fp16 loss-scaler skip holds the LR) does not end it."""
    lr = np.asarray(lr, dtype=float)
    if lr.size < 2 or not np.isfinite(lr).all():
        return 0
    held = np.zeros(lr.size, bool) if skipped is None else np.asarray(skipped, bool)
    stops = np.flatnonzero((lr[1:] <= lr[:-1]) & ~held[1:] & ~held[:-1])
    return int(stops[0]) if stops.size else lr.size - 1


def _finite_median(sorted_rows: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Median of the first `count` values of each row of `sorted_rows` (sorted, NaN last); NaN where none."""
    lo = np.maximum(count - 1, 0) // 2
    hi = np.maximum(count, 1) // 2 - (count == 0)
    pick = np.take_along_axis
    with np.errstate(invalid="ignore"):
        mid = (
            pick(sorted_rows, lo[..., None], -1)[..., 0] + pick(sorted_rows, np.maximum(hi, 0)[..., None], -1)[..., 0]
        ) / 2
    return np.where(count > 0, mid, np.nan).astype(sorted_rows.dtype, copy=False)


def block_stats(
    series: np.ndarray, window: int, sigma_blocks: int = 1, min_share: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """Per series (row of `series`, series x steps) and complete block of `window` steps: the median and the
    robust sigma (1.4826 x MAD) of its finite values, as series x blocks arrays. A block with fewer than
    `min_share` of its values finite gives NaN. With `sigma_blocks` > 1 a block's sigma is the median of
    the sigmas of it and the `sigma_blocks` - 1 blocks before it.

    Medians by sorting each block (numpy sorts short float rows with SIMD: ten times `np.median`'s
    partition, a hundred times `np.nanmedian`), NaN sorted last and left out by the finite count."""
    k, n = series.shape
    blocks = n // window
    if blocks == 0:
        return np.full((k, 0), np.nan, series.dtype), np.full((k, 0), np.nan, series.dtype)
    b = series[:, : blocks * window].reshape(k, blocks, window)
    b = np.where(np.isfinite(b), b, np.nan)
    count = np.count_nonzero(~np.isnan(b), axis=-1)
    med = _finite_median(np.sort(b, axis=-1), count)
    with np.errstate(invalid="ignore"):
        sig = MAD_TO_SIGMA * _finite_median(np.sort(np.abs(b - med[..., None]), axis=-1), count)
    del b
    if min_share > 0:
        few = count < min_share * window
        med[few], sig[few] = np.nan, np.nan
    if sigma_blocks > 1:
        history = np.concatenate([np.full((k, sigma_blocks - 1), np.nan, dtype=sig.dtype), sig], axis=1)
        recent = np.sort(np.lib.stride_tricks.sliding_window_view(history, sigma_blocks, axis=1), axis=-1)
        sig = _finite_median(recent, np.count_nonzero(~np.isnan(recent), axis=-1))
    return med, sig


def previous_block_stats(
    values: np.ndarray, window: int, sigma_blocks: int = 1, min_share: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
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
    series = x[None, :] if squeeze else np.ascontiguousarray(x.T)
    med, sig = block_stats(series, window, sigma_blocks, min_share)
    median, sigma = (per_step(a, window, series.shape[1]) for a in (med, sig))
    return (median[0], sigma[0]) if squeeze else (median.T, sigma.T)


def per_step(block_values: np.ndarray, window: int, steps: int) -> np.ndarray:
    """Series x blocks values spread over series x `steps`: each step gets the values of the block before
    its own (NaN in the first block); the steps after the last complete block belong to the block after it."""
    k, blocks = block_values.shape
    out = np.full((k, steps), np.nan, dtype=block_values.dtype)
    if blocks >= 1 and steps > window:
        owner = np.arange(window, steps) // window - 1  # the block before each row's own block
        out[:, window:] = block_values[:, owner]
    return out


def robust_z(values: np.ndarray, median: np.ndarray, sigma: np.ndarray, floor: float) -> np.ndarray:
    """(value - median) / sigma, with sigma floored so a flat history does not turn noise into alarms."""
    with np.errstate(invalid="ignore"):
        return (values - median) / np.maximum(sigma, floor)


def normal_sf(z: float) -> float:
    """One-sided p-value of a z-score under the standard normal (scipy's ``stats.norm.sf``), from the
    standard library: importing scipy.stats costs most of a second of CPU, more than auditing a log."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


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


LOGGED = ("loss", "lr", "grad_norm")  # the per-step values the curve checks judge


def step_frame(ctx, *columns: str):
    """Rank 0's per-step columns in step order (one row per step: ingest sets abandoned resumed steps aside);
    numeric columns as DOUBLE, so a column that is all NULL (a log without a learning rate) is still a column.
    The logged values are read once an audit for every check that asks (a million steps: a read each costs)."""
    if not set(columns) <= set(LOGGED):
        cols = ", ".join(f"CAST({c} AS DOUBLE) AS {c}" if c in LOGGED else c for c in columns)
        return ctx.frame(f"SELECT step, {cols} FROM steps WHERE rank = 0 ORDER BY step")
    cols = ", ".join(f"CAST({c} AS DOUBLE) AS {c}" for c in LOGGED)
    logged = ctx.shared(
        "logged_steps", lambda: ctx.frame(f"SELECT step, {cols} FROM steps WHERE rank = 0 ORDER BY step")
    )
    return logged.select("step", *columns)


def column(frame, name: str) -> np.ndarray:
    """A frame's column as float64, NaN where NULL."""
    return frame[name].cast(float).fill_null(np.nan).to_numpy().astype(float)


# ---------------------------------------------------------------------------- the logged loss's own noise

GAUSS_Q90_OVER_MAD = 1.6449 / 0.6745  # |x - median| at its 90th percentile over its median, for normal data
FAMILIES = ("sft", "preference", "rl")
PREFERENCE_KEYS = (
    "logps/chosen",
    "logps/rejected",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "odds_ratio_loss",
)
RL_KEYS = ("kl", "reward", "reward_std", "completion_length", "objective/kl", "objective/rlhf_reward")


def loss_family(ctx) -> tuple[str, list[str]]:
    """The training objective's family, named from the log's keys, and the keys that named it: "preference"
    (DPO, ORPO, KTO, SimPO: sigmoid losses of a few pairs, heavy-tailed per step; `rewards/*`, `logps/*`), "rl"
    (GRPO, PPO, RLOO: a policy-gradient surrogate, not a fit; `kl`, `reward`) or "sft" (a token cross-entropy)."""

    def named() -> tuple[str, list[str]]:
        names = {n for (n,) in ctx.con.execute("SELECT DISTINCT name FROM metrics WHERE rank = 0").fetchall()}
        preference = sorted(n for n in names if n in PREFERENCE_KEYS or n.startswith("logps/"))
        rl = sorted(n for n in names if n in RL_KEYS or n.startswith("completions/"))
        return ("preference", preference) if preference else ("rl", rl) if rl else ("sft", [])

    return ctx.shared("loss_family", named)


def log_quantum(values: np.ndarray) -> float:
    """The rounding step of logged values, estimated from them: 1e-4 for a log rounded to 4 decimals (the
    Trainer's `round(loss, 4)`); 0.0 when they are not decimal-rounded (to at most 8 places)."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if v.size < 3:
        return 0.0
    # A rounding a few values refute is not tried on all (a million values cost some 6 ms a rounding tried).
    sample = v[:QUANTUM_SAMPLE]
    for k in range(9):
        if _rounded_to(sample, k) and _rounded_to(v, k):
            return 10.0**-k
    return 0.0


def _rounded_to(values: np.ndarray, places: int) -> bool:
    scaled = values * 10.0**places
    return bool(np.all(np.abs(scaled - np.round(scaled)) <= 1e-4))


def row_nanmedian(rows: np.ndarray) -> np.ndarray:
    """`np.nanmedian(rows, axis=1)`, by `np.median` for the rows without a NaN (numpy's NaN-aware median of short
    rows goes through masked arrays: six times slower). Each selection of rows is a copy of its own, partitioned in
    place (not copied again: a million-row log's blocks of noise are 90 MB)."""
    gaps = np.isnan(rows).any(axis=1)
    out = np.empty(rows.shape[0])
    out[~gaps] = np.median(rows[~gaps], axis=1, overwrite_input=True)
    out[gaps] = np.nanmedian(rows[gaps], axis=1, overwrite_input=True)
    return out


def rolling_level(x: np.ndarray, points: int) -> np.ndarray:
    """Per row, the median of the `points` rows before it (fewer at the start; NaN for the first row)."""
    padded = np.concatenate([np.full(points, np.nan), np.asarray(x, dtype=float)])[:-1]
    with warnings.catch_warnings():  # a window of NaN only (the first row, a NaN stretch) has no level
        warnings.simplefilter("ignore", RuntimeWarning)
        return row_nanmedian(np.lib.stride_tricks.sliding_window_view(padded, points))


def tail_factor(residuals: np.ndarray, min_count: int = 200) -> float:
    """How much heavier than normal the upper tail of the run's own residuals is: the 90th percentile of the
    deviations above the median over the median absolute deviation, relative to a normal distribution's (>= 1).
    The mean loss of a few rows is skewed up (one hard row lifts it); a preference loss is heavy-tailed. Robust
    to 10% outliers: a few spikes do not raise it. 1 with fewer than `min_count` residuals: a 90th percentile
    of the upward deviations needs about a hundred of them (a short log's few high values would set it)."""
    r = np.asarray(residuals, dtype=float)
    r = r[np.isfinite(r)]  # a copy: the statistics below need no order, so each partitions it in place
    if r.size < min_count:
        return 1.0
    dev = np.subtract(r, np.median(r, overwrite_input=True), out=r)
    up = dev[dev > 0]
    mad = np.median(np.abs(dev, out=dev), overwrite_input=True)
    return (
        1.0
        if mad <= 0 or up.size < 10
        else max(1.0, float(np.quantile(up, 0.9, overwrite_input=True) / mad / GAUSS_Q90_OVER_MAD))
    )


def sorted_tail_factor(ascending: np.ndarray, min_count: int = 200) -> float:
    """`tail_factor` of finite residuals already sorted ascending, equal to it bit for bit, without partitioning
    them: the median is its middle values, the deviations keep their order, their median absolute deviation is
    found by bisection of its two ascending runs (the values below the median, flipped, and the others), the 90th
    percentile of the upward deviations by `np.quantile` over a sorted run of them (a carried tail factor merges a
    few new residuals into the sorted ones of the audit before, `carried_curve.carried_tail`)."""
    r = np.asarray(ascending, dtype=float)
    n = r.size
    if n < min_count:
        return 1.0
    middle = slice((n - 1) // 2, n // 2 + 1)  # the one or two middle values np.median averages
    centre = np.median(r[middle])
    # r - centre is negative exactly where r < centre, zero where equal; c - r rounds as -(r - c).
    below, above = int(np.searchsorted(r, centre, side="left")), int(np.searchsorted(r, centre, side="right"))
    mad = np.median(np.array([_kth_deviation(r, centre, below, k) for k in range(middle.start, middle.stop)]))
    up = r[above:] - centre
    return 1.0 if mad <= 0 or up.size < 10 else max(1.0, float(np.quantile(up, 0.9) / mad / GAUSS_Q90_OVER_MAD))


def _kth_deviation(r: np.ndarray, centre: np.float64, below: int, k: int) -> np.float64:
    """The k-th smallest (from 0) of |r - centre| over ascending `r` whose first `below` values are under
    `centre`: two ascending runs (centre - r[below - 1 - i] and r[below + i] - centre), bisected on how many of
    the k + 1 smallest come from the first."""

    def flipped(i):
        return centre - r[below - 1 - i]

    def rest(i):
        return r[below + i] - centre

    lo, hi = max(0, k + 1 - (r.size - below)), min(k + 1, below)
    while lo < hi:
        i = (lo + hi) // 2
        if flipped(i) < rest(k - i):  # flipped(i) is among the k + 1 smallest
            lo = i + 1
        else:
            hi = i
    return max(flipped(lo - 1) if lo else -np.inf, rest(k - lo) if k + 1 - lo else -np.inf)


def run_config(manifest: dict) -> dict:
    """What the run's manifest says of its configuration, read defensively: the shim's `config` (with the
    Trainer's `training_args`), an import's `trainer_state` keys, flattened to one dict (first found wins)."""
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    out: dict = {}
    for part in (
        config,
        config.get("training_args"),
        config.get("trainer_state"),
        manifest.get("granularity"),
        manifest,
    ):
        if isinstance(part, dict):
            for k, v in part.items():
                if v is not None and not isinstance(v, (dict, list)):
                    out.setdefault(k, v)
    return out


def positive(value) -> float | None:
    """A positive finite number, or None (a missing, zero or nonsense setting)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if np.isfinite(v) and v > 0 else None


def rows_per_log(ctx) -> int | None:
    """Rows each logged loss averages when the run says: per-device batch x accumulation x logging interval."""
    c = run_config(ctx.manifest)
    batch = positive(c.get("train_batch_size") or c.get("per_device_train_batch_size") or c.get("batch_size"))
    if batch is None:
        return None
    accumulation = positive(c.get("gradient_accumulation_steps") or c.get("grad_accum")) or 1
    interval = positive(c.get("logging_steps")) or 1
    return int(batch * accumulation * (interval if interval >= 1 else 1))


def nonfinite_logged(ctx) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rank 0's steps; whether each logged a non-finite loss, a non-finite gradient norm, any gradient norm. Once
    an audit (four checks ask), read-only."""

    def read() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        f = step_frame(ctx, "loss", "grad_norm")
        loss, norm = f["loss"], f["grad_norm"]
        found = (
            f["step"].to_numpy(),
            (~loss.is_finite()).fill_null(False).to_numpy(),
            (~norm.is_finite()).fill_null(False).to_numpy(),
            norm.is_not_null().to_numpy(),
        )
        for values in found:
            values.flags.writeable = False
        return found

    return ctx.shared("nonfinite_logged", read)


def skipped_updates(bad_norm: np.ndarray, has_norm: np.ndarray, manifest: dict) -> np.ndarray:
    """Rows whose update the optimizer skipped: a non-finite logged gradient norm with a finite one logged later.
    Weights an applied non-finite update reached stay non-finite, and so does every later gradient norm: a finite
    one after it shows the update was not applied (the fp16 GradScaler skips such steps and holds the LR). None
    when the manifest says nothing could skip a step (the shim saw no loss scaler nor DeepSpeed's overflow check:
    `loss_scaler.skips_nonfinite_steps` false); a manifest without it (older recordings, imported logs) as above."""
    bad = np.asarray(bad_norm, bool)
    scaler = manifest.get("loss_scaler")
    if isinstance(scaler, dict) and scaler.get("skips_nonfinite_steps") is False:
        return np.zeros_like(bad)
    finite = np.asarray(has_norm, bool) & ~bad
    finite_after = np.r_[np.flip(np.logical_or.accumulate(np.flip(finite)))[1:], False]
    return bad & finite_after
