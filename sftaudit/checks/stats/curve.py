"""A healthy loss curve, judged from the logged values alone (LOOP-10, LOOP-19, LOOP-20, LOOP-27).

Everything is judged in log space (a loss's noise scales with its level) against the run's *own* noise at its
logging resolution, measured where each value lies and available from the first logged steps: the robust sigma
(1.4826 MAD / sqrt 6) of second differences of the log values, pooled over a centred window of at least 32
logged values (clamped at the ends of the run). Second differences leave a trend out, even the steep fall of a
fine-tune's first steps, so a fall is never mistaken for noise and an early jump is judged against the calm of
the run around it.

- **Excursions** (spikes and rises that stay): each value against the median of the 5 values before it, one-sided
  (a value below its level is never an excursion), and at least `min_effect` times that level.
- **Lone peaks** (one window's loss multiplied): each value against the midpoint of its two neighbours, judged
  against the noise of such a residual and above both neighbours; in a log too short for a noise estimate, a value
  far above every other after the first.
- **Rise from the minimum** (a creep, a rise with the learning rate): a centred running median of the log values
  climbing above its own running minimum by a fixed factor and by many noise sigmas; and a trend from that
  minimum to the end (Mann-Kendall, Theil-Sen), which every later value carries, so it is told where one level's
  noise is too wide (a noisy low loss) and sooner.
- **Chance** (the loss of a uniform guess): ln K for a classification head of K labels, ln V for a language model
  over V tokens, from the model's config.json as the run recorded it.

Fixed statistics throughout (never a threshold fitted to a run); numpy, no Python loop over steps.
"""

from __future__ import annotations

import math
import re
import warnings

import numpy as np

from .rolling import MAD_TO_SIGMA, log_quantum, positive, rolling_level, row_nanmedian, tail_factor

LEVEL_POINTS = 5  # the running level: the median of the values before
MIN_LEVEL_POINTS = 3  # values before a row for its running level to judge it (a median robust to one outlier)
NOISE_POINTS = 32  # at least this many values pooled for a value's noise
NOISE_REACH = 2  # blocks pooled on each side of a value's own block
MIN_DIFFERENCES = 5  # second differences needed for a noise estimate


def log_values(values) -> np.ndarray:
    """log of each logged value; NaN where it is not a finite positive number (0, a negative, NaN)."""
    v = np.asarray(values, dtype=float)
    ok = np.isfinite(v) & (v > 0)
    return np.where(ok, np.log(np.where(ok, v, 1.0)), np.nan)


def point_noise(x: np.ndarray, min_points: int = NOISE_POINTS, reach: int = NOISE_REACH) -> np.ndarray:
    """Per row, the robust sigma of one logged (log) value's noise around its local trend.

    From second differences (1.4826 MAD / sqrt 6: a linear trend, even a steep one, leaves them), pooled over
    the row's block and `reach` blocks on each side (at least `min_points` values; blocks of run length / 32,
    4..64 rows), the window shifted inward at the ends so the first rows are judged like any other. NaN where
    fewer than `MIN_DIFFERENCES` second differences are near (a log of 6 values or fewer has no noise to judge a
    value against: its bounds do)."""
    x = np.asarray(x, dtype=float)
    return np.repeat(block_noise(x, min_points, reach), noise_block(x.size, min_points, reach))[: x.size]


def noise_block(n: int, min_points: int = NOISE_POINTS, reach: int = NOISE_REACH) -> int:
    """The rows in one block of `point_noise` for a log of `n` values."""
    return max(int(np.clip(n // 32, 4, 64)), -(-min_points // (2 * reach + 1)))


def block_noise(
    x: np.ndarray, min_points: int = NOISE_POINTS, reach: int = NOISE_REACH, first_block: int = 0
) -> np.ndarray:
    """`point_noise` a block at a time (`noise_block` rows), of the blocks from `first_block` on: each block's
    sigma depends only on the values of the blocks it pools, so a carried one is computed once."""
    x = np.asarray(x, dtype=float)
    n = x.size
    d2 = np.full(n, np.nan)
    if n >= 3:
        d2[1:-1] = x[2:] - 2 * x[1:-1] + x[:-2]
    width = 2 * reach + 1
    block = noise_block(n, min_points, reach)
    blocks = -(-n // block)
    padded = np.full(blocks * block, np.nan)
    padded[:n] = d2
    rows = padded.reshape(blocks, block)
    k = min(width, blocks)
    start = np.clip(np.arange(first_block, blocks) - reach, 0, blocks - k)
    pooled = rows[start[:, None] + np.arange(k)[None, :]].reshape(start.size, k * block)
    with warnings.catch_warnings():  # a window without finite values has no noise
        warnings.simplefilter("ignore", RuntimeWarning)
        centre = row_nanmedian(pooled)
        sigma = MAD_TO_SIGMA * row_nanmedian(np.abs(pooled - centre[:, None])) / math.sqrt(6)
    finite = np.count_nonzero(np.isfinite(pooled), axis=1)
    return np.where(finite >= MIN_DIFFERENCES, sigma, np.nan)


def excursion_scores(
    values,
    level_points: int = LEVEL_POINTS,
    noise: np.ndarray | None = None,
    level: np.ndarray | None = None,
    tail_of=None,
) -> dict:
    """What `excursions` judges each logged value by, whatever its thresholds: x (log), level, residual, scale, z,
    quantum and tail (the run's upper-tail factor of z). `noise`, `level`: `point_noise` and `rolling_level` of the
    log values when known (carried from the audit before); `tail_of`: the tail factor of every row's z (NaN where
    not judged) when it is known another way (`finite_tail` is the whole-series one)."""
    v = np.asarray(values, dtype=float)
    x = log_values(v)
    level = rolling_level(x, level_points) if level is None else level
    residual = x - level
    quantum = log_quantum(v)
    scale = floored_scale(
        (point_noise(x) if noise is None else noise) * math.sqrt(1 + math.pi / (2 * level_points)), level, quantum
    )
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        flat = np.where(residual > 0, np.inf, np.nan)  # a noiseless log (every value equal): any rise stands out
        z = np.where(scale > 0, residual / np.where(scale > 0, scale, 1.0), np.where(np.isnan(scale), np.nan, flat))
    tail = (tail_of or finite_tail)(z)
    return {"x": x, "level": level, "residual": residual, "scale": scale, "z": z, "quantum": quantum, "tail": tail}


def excursions(
    values,
    sigma: float,
    diverge_steps: int,
    min_effect: float,
    level_points: int = LEVEL_POINTS,
    scores: dict | None = None,
) -> dict:
    """Logged values judged against the run's own noise, and their excursions above their running level.

    Each value's residual from the median of the `level_points` values before it (log space), over the noise of
    such a residual (`point_noise` x sqrt(1 + pi / (2 x level_points)): the value's own noise and its level's),
    floored at one rounding step of the log at that level (no noise estimate: not judged); z >= `sigma` x the
    run's upper-tail factor and a residual >= log(`min_effect`) is elevated. One-sided: a value below its level
    never is. An episode starts at an elevated row and stays up while the values keep above the level before it
    began (by the same threshold); it is sustained when it lasts `diverge_steps` rows, or through the end of the
    run (2 rows at least).

    Returns x, level, residual, scale, z, quantum, tail, threshold and the episodes (first row, rows up,
    sustained). `scores`: `excursion_scores` of these values when known (carried from the audit before, and
    shared by the checks judging the same series with other thresholds)."""
    found = excursion_scores(values, level_points) if scores is None else scores
    x, level, residual, scale, z = (found[k] for k in ("x", "level", "residual", "scale", "z"))
    threshold = sigma * found["tail"]
    # A level of fewer than 3 values is their mean, not a robust median: one dip among them drags it down and
    # the return to trend after it would read as a spike; those first rows are the neighbour rules' (lone_peaks).
    robust = np.minimum(np.arange(x.size), level_points) >= MIN_LEVEL_POINTS
    with np.errstate(invalid="ignore"):
        elevated = robust & (z >= threshold) & (residual >= math.log(min_effect))
    starts = np.flatnonzero(elevated & ~np.r_[False, elevated[:-1]])
    episodes = []
    for s in starts:  # one pass per episode (a handful), each vectorised over the rows after it
        bar = level[s] + max(threshold * scale[s], math.log(min_effect)) if np.isfinite(scale[s]) else level[s]
        length = rows_above(x, s, bar)
        sustained = length >= diverge_steps or (s + length == x.size and length >= 2)
        episodes.append((int(s), length, bool(sustained)))
    return {**found, "threshold": threshold, "episodes": episodes}


def finite_tail(z: np.ndarray) -> float:
    """`tail_factor` of the finite values of `z` (the rows judged)."""
    return tail_factor(z[np.isfinite(z)])


def floored_scale(noise: np.ndarray, level: np.ndarray, quantum: float) -> np.ndarray:
    """A value's noise floored at one rounding step of the log at its `level` (log space); NaN where there is no
    noise estimate: not judged."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        resolution = np.log1p(quantum / np.exp(level)) if quantum else np.zeros(noise.size)
        return np.where(np.isfinite(noise), np.fmax(noise, resolution), np.nan)


def rows_above(x: np.ndarray, start: int, bar: float) -> int:
    """How many rows from `start` on stay at or above `bar` (a NaN row ends the run)."""
    with np.errstate(invalid="ignore"):
        below = np.flatnonzero(~(x[start:] >= bar))
    return int(below[0]) if below.size else x.size - start


def lone_peaks(values, sigma: float, min_effect: float, noises: dict | None = None, tails: dict | None = None) -> dict:
    """Single logged values standing above both neighbours, judged against the run's own noise of such a stand.

    Each inner value's residual from the midpoint of its two neighbours (minus half the second difference, so a
    trend, even the steep fall of a short log, leaves it out where a running level of the values before lags behind
    it), over the noise of such a residual (`point_noise` x sqrt(3 / 2): the value's own noise and half of each
    neighbour's), floored at one rounding step at that level (no noise estimate: not judged), judged through two
    lenses (`LENSES`): the log (noise in proportion to the level) and the square root (the noise of a mean of rare
    errors, a low loss's, grows like the square root of its level: its log swings with every window that happens
    to hold no error, and a spike hides in the swing). A peak: in either lens, z >= `sigma` x the upper-tail factor
    of that lens's z, and the value at least `min_effect` x each neighbour (a step down after a plateau puts its
    last value over the midpoint, never over both neighbours).

    Returns, per row, the lens judged (the one whose z stands furthest over its threshold: its index in `lenses`),
    its z and threshold;
    the log residual, the lenses' tail factors, the peak rows and each value over its higher neighbour (log).
    `noises`: per lens, `point_noise` of the values through it when known (carried from the audit before); `tails`:
    per lens, the tail factor of its z as `excursion_scores`' `tail_of`."""
    v = np.asarray(values, dtype=float)
    x = log_values(v)
    n = x.size
    quantum = log_quantum(v)
    prominence = np.full(n, np.nan)
    if n >= 3:
        prominence[1:-1] = x[1:-1] - np.fmax(x[:-2], x[2:])
    known, tail_of = noises or {}, tails or {}
    judged = {
        name: _neighbour_z(lens(x), lens, inverse, quantum, sigma, known.get(name), tail_of.get(name, finite_tail))
        for name, (lens, inverse) in LENSES.items()
    }
    (log, log_over), (root, root_over) = (
        (j, np.nan_to_num(j["z"] / j["threshold"], nan=-np.inf)) for j in (judged["log"], judged["square root"])
    )
    # Two lenses: the square root is picked where it stands strictly further over (argmax keeps the first of a tie);
    # per row an index, not a name (a million names are 44 MB to fill).
    pick = root_over > log_over
    z = np.where(pick, root["z"], log["z"])
    threshold = np.where(pick, root["threshold"], log["threshold"])
    with np.errstate(invalid="ignore"):
        peaks = np.flatnonzero((np.maximum(log_over, root_over) >= 1) & (prominence >= math.log(min_effect)))
    return {
        "residual": log["residual"],
        "z": z,
        "threshold": threshold,
        "lens": pick.view(np.int8),
        "lenses": ("log", "square root"),
        "tails": {name: j["tail"] for name, j in judged.items()},
        "peaks": peaks,
        "prominence": prominence,
    }


# The lenses a lone peak is judged through: the transform of a logged value's log, and back.
LENSES = {
    "log": (lambda x: x, lambda t: t),
    "square root": (lambda x: np.exp(x / 2), lambda t: 2 * np.log(t)),
}


def _neighbour_z(t: np.ndarray, lens, inverse, quantum: float, sigma: float, noise: np.ndarray | None, tail_of) -> dict:
    """Through one lens (`t` = lens(log value)): each inner value's residual from its neighbours' midpoint, z over
    the noise of such a residual (`noise`: `point_noise` of `t` when known) floored at one rounding step of the log
    at the midpoint, the tail factor (`tail_of` its z) and the threshold (`sigma` x tail)."""
    n = t.size
    residual = np.full(n, np.nan)
    if n >= 3:
        residual[1:-1] = t[1:-1] - (t[:-2] + t[2:]) / 2
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if quantum:
            midpoint = inverse(t - residual)  # log space
            step = lens(np.log(np.exp(midpoint) + quantum)) - lens(midpoint)
        else:
            step = np.zeros(n)
        noise = (point_noise(t) if noise is None else noise) * math.sqrt(1.5)
        scale = np.where(np.isfinite(noise), np.fmax(noise, step), np.nan)
        z = np.where(scale > 0, residual / np.where(scale > 0, scale, 1.0), np.nan)
    tail = tail_of(z)
    return {"residual": residual, "z": z, "tail": tail, "threshold": sigma * tail}


def short_log_peaks(values, min_effect: float, noise: np.ndarray | None = None) -> np.ndarray:
    """In a log too short for a noise estimate (`point_noise` has none), the rows whose value stands at least
    `min_effect` x every other value after the first (the untrained start) and is followed by a lower one: the
    rest of the log is the bound, not a history it does not have. The second row is not judged (a falling loss
    puts it above all that follow) nor the last (a rise that ends the log may be the start of a divergence)."""
    x = log_values(values)
    n = x.size
    if n < 4 or np.isfinite(point_noise(x) if noise is None else noise).any():
        return np.zeros(0, dtype=int)
    rest = np.where(np.isfinite(x[1:]), x[1:], -np.inf)
    top, second = np.sort(rest)[::-1][:2]
    others = np.where(rest == top, second, top)  # per row after the first: the highest of the other rows
    rows = np.arange(1, n)
    with np.errstate(invalid="ignore"):
        standing = (rest - others >= math.log(min_effect)) & (rows >= 2) & (rows <= n - 2)
    return rows[standing]


def centred_median(x: np.ndarray, width: int) -> np.ndarray:
    """The median of the `width` values centred on each row (fewer at the ends; NaN ignored)."""
    half = width // 2
    padded = np.concatenate([np.full(half, np.nan), np.asarray(x, dtype=float), np.full(half, np.nan)])
    with warnings.catch_warnings():  # an all-NaN window has no median
        warnings.simplefilter("ignore", RuntimeWarning)
        return row_nanmedian(np.lib.stride_tricks.sliding_window_view(padded, 2 * half + 1))


def smoothed_level(x: np.ndarray) -> tuple[np.ndarray, int]:
    """The centred running median of log values `x` over run length / 10 logged values (odd, 3 at least; on a
    long log, of the medians of blocks of run length / 200 values, so the cost stays linear), and how many logged
    values are behind each level."""
    n = x.size
    block = max(1, n // 200)
    blocks = -(-n // block)
    padded = np.full(blocks * block, np.nan)
    padded[:n] = x
    with warnings.catch_warnings():  # a block without finite values has no median
        warnings.simplefilter("ignore", RuntimeWarning)
        coarse = row_nanmedian(padded.reshape(blocks, block))
    width = max(3, (blocks // 10) | 1)
    return np.repeat(centred_median(coarse, width), block)[:n], width * block


def level_noise(x: np.ndarray, points: int, noise: np.ndarray | None = None) -> tuple[float, float]:
    """The run's typical noise of one log value (the median of `point_noise`) and that of a median of `points`
    such values (x sqrt(pi / (2 x points))). `noise`: `point_noise(x)` when known (carried from the audit before)."""
    noise = point_noise(x) if noise is None else noise
    typical = float(np.nanmedian(noise)) if np.isfinite(noise).any() else 0.0
    return typical, typical * math.sqrt(math.pi / (2 * points))


def rise_from_minimum(
    values, min_factor: float, min_sigmas: float, min_points: int = 8, noise: np.ndarray | None = None
) -> dict | None:
    """The largest climb of the loss above its own best level, when it is one.

    The level is `smoothed_level`; its running minimum is the best level so far. A rise is that level above the
    minimum by at least log(`min_factor`) and by `min_sigmas` x the noise of such a level (`level_noise`). None: no
    such rise, or fewer than `min_points` finite values.

    Returns the rows of the minimum, of the first value over the bar, of the peak, whether the level is still
    over the bar at the end, the level's values there and the run's noise. `noise`: `point_noise` of the log values
    when known (carried from the audit before: a pass over every value)."""
    x = log_values(values)
    if np.isfinite(x).sum() < min_points:
        return None
    n = x.size
    level, points = smoothed_level(x)
    best = np.fmin.accumulate(np.where(np.isfinite(level), level, np.inf))
    rise = level - best
    typical, of_level = level_noise(x, points, noise)
    bar = max(math.log(min_factor), min_sigmas * of_level)
    with np.errstate(invalid="ignore"):
        over = rise >= bar
    if not over.any():
        return None
    crossing = int(np.flatnonzero(over)[0])
    minimum = int(np.argmin(np.where(np.isfinite(level[: crossing + 1]), level[: crossing + 1], np.inf)))
    peak = int(np.nanargmax(np.where(np.arange(n) >= crossing, rise, -np.inf)))
    return {
        "minimum": minimum,
        "crossing": crossing,
        "peak": peak,
        "to_end": bool(over[-1]),
        "level": np.exp(level),
        "factor": float(np.exp(rise[peak])),
        "end_factor": float(np.exp(rise[-1])) if np.isfinite(rise[-1]) else None,
        "bar_factor": float(math.exp(bar)),
        "noise": typical,
        "width": points,
    }


TREND_VALUES = 400  # the trend test pairs at most this many evenly spaced values (its cost grows as their square)
TREND_LEVEL_SIGMAS = 3  # a trend is dated where its recent values stay over the best level by this many sigmas


def rising_trend(
    values, min_factor: float, min_z: float, min_points: int = 10, noise: np.ndarray | None = None
) -> dict | None:
    """The loss trending up from its best level to the end of the run, when it does.

    From the minimum of `smoothed_level` to the end: the one-sided Mann-Kendall statistic of the log values (later
    over earlier pairs less earlier over later, in units of its standard deviation under no trend, ties counted as
    no trend: conservative) and the Theil-Sen slope (the median of the pairwise slopes) times the stretch, the rise
    the trend makes. Ranks and medians, no model of the noise: a noisy low loss or heavy tails, which a level's
    sigma judges too wide, do not mask a trend that every later value carries. A trend: z >= `min_z` and a rise >=
    log(`min_factor`) (a multi-epoch run's loss drifting up a few percent within its last epoch is a trend, not a
    climb). Dated where the climb is under way: the first row from which to the end the median of the values up to
    it (run length / 40 of them, 5 at least; never after it) stands `TREND_LEVEL_SIGMAS` of its own noise above the
    best level; else the last row. None: no such trend, or fewer than `min_points` finite values from the minimum on.

    Returns the rows of the minimum and of the dating, z, the rise factor, the values from the minimum on and the
    evenly spaced ones of them tested (at most `TREND_VALUES`), the level's values and the run's noise. `noise`:
    `point_noise` of the log values when known (as `rise_from_minimum`'s)."""
    x = log_values(values)
    if np.isfinite(x).sum() < min_points:
        return None
    level, points = smoothed_level(x)
    minimum = int(np.argmin(np.where(np.isfinite(level), level, np.inf)))
    rows = minimum + np.flatnonzero(np.isfinite(x[minimum:]))
    if rows.size < min_points:
        return None
    picked = rows[np.unique(np.linspace(0, rows.size - 1, min(rows.size, TREND_VALUES)).astype(int))]
    y, t = x[picked], picked.astype(float)
    later, earlier = np.triu_indices(y.size, 1)[::-1]
    sign = np.sign(y[later] - y[earlier])
    k = y.size
    s = float(sign.sum())
    z = (s - math.copysign(1.0, s)) / math.sqrt(k * (k - 1) * (2 * k + 5) / 18) if s else 0.0
    slope = float(np.median((y[later] - y[earlier]) / (t[later] - t[earlier])))
    rise = slope * (rows[-1] - minimum)
    if z < min_z or rise < math.log(min_factor):
        return None
    # Dated by a trailing median (the values up to the row, never after it: a centred one rises half its width
    # before a jump) of a quarter of the level's values, from where it stays over the best level by its own noise
    # to the end (a multi-epoch loss drifts up within an epoch and falls back at the next before any fault).
    trailing = max(5, points // 4)
    typical, of_trailing = level_noise(x, trailing, noise)
    after = np.concatenate([np.full(trailing - 1, np.nan), x[minimum:]])
    with warnings.catch_warnings():  # a window without finite values has no median
        warnings.simplefilter("ignore", RuntimeWarning)
        recent = row_nanmedian(np.lib.stride_tricks.sliding_window_view(after, trailing))
    with np.errstate(invalid="ignore"):
        above = recent[1:] >= level[minimum] + TREND_LEVEL_SIGMAS * of_trailing
    up = np.flatnonzero(np.flip(np.logical_and.accumulate(np.flip(above))))
    return {
        "minimum": minimum,
        "crossing": minimum + 1 + int(up[0]) if up.size else x.size - 1,
        "z": z,
        "factor": float(math.exp(rise)),
        "values": int(rows.size),
        "tested": int(picked.size),
        "level": np.exp(level),
        "noise": typical,
        "width": points,
    }


# ---------------------------------------------------------------------------- chance level

# Heads whose loss is a cross-entropy over labels, not over the vocabulary (transformers' class names).
CLASSIFIER = re.compile(r"For(Sequence|Token|Audio|Image|Video)Classification$|ForMultipleChoice$")


def _model_config(manifest: dict) -> dict:
    model = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}
    config = model.get("config") if isinstance(model.get("config"), dict) else {}
    return config


def vocab_size(manifest: dict) -> tuple[int | None, str | None]:
    """The output vocabulary (the model's when its config says, else the tokenizer's) and where it came from."""
    config = _model_config(manifest)
    for where, value in (
        ("manifest", manifest.get("vocab_size")),
        ("model config", config.get("vocab_size")),
        (
            "model config (text_config)",
            (config.get("text_config") or {}).get("vocab_size")
            if isinstance(config.get("text_config"), dict)
            else None,
        ),
        (
            "tokenizer",
            (manifest.get("tokenizer") or {}).get("length") if isinstance(manifest.get("tokenizer"), dict) else None,
        ),
    ):
        v = positive(value)
        if v is not None and v >= 2:
            return int(v), where
    return None, None


class NoChance(Exception):
    """The run's loss has no chance level to judge it by (a regression head, an unknown vocabulary)."""


def chance_level(manifest: dict) -> dict:
    """The loss of a uniform guess for the run's model: ln K for a classification head of K labels (config.json's
    id2label, else num_labels, else transformers' default of 2; ln 2 per label for a multi-label head), ln V
    for a language model (seq2seq and speech decoders too) over its vocabulary. Raises NoChance with the reason
    when the model's loss has none."""
    config = _model_config(manifest)
    architectures = config.get("architectures") if isinstance(config.get("architectures"), list) else []
    head = next((a for a in architectures if isinstance(a, str) and CLASSIFIER.search(a)), None)
    if head is not None:
        labels = config.get("id2label")
        if isinstance(labels, dict) and labels:
            k, source = len(labels), "config.json id2label"
        elif positive(config.get("num_labels")):
            k, source = int(config["num_labels"]), "config.json num_labels"
        else:
            k, source = 2, "transformers' default: config.json names no labels"
        if config.get("problem_type") == "regression" or k < 2:
            raise NoChance(f"{head} is a regression head (mean squared error): its loss has no chance level")
        if config.get("problem_type") == "multi_label_classification":
            return {"chance": math.log(2), "kind": "multi-label head", "classes": 2, "source": source, "head": head}
        return {"chance": math.log(k), "kind": "classification head", "classes": k, "source": source, "head": head}
    vocab, source = vocab_size(manifest)
    if vocab is None:
        raise NoChance("the vocabulary size is unknown (no model config.json, tokenizer or checkpoint header)")
    return {"chance": math.log(vocab), "kind": "language model", "classes": vocab, "source": source, "head": None}


def pretrained_evidence(manifest: dict) -> str | None:
    """What shows the run fine-tunes a pretrained model (an adapter, a model loaded by name), or None."""
    params = manifest.get("params") if isinstance(manifest.get("params"), list) else []
    adapters = [p.get("name", "") for p in params if isinstance(p, dict) and "lora_" in str(p.get("name", ""))]
    if adapters:
        return f"LoRA adapter weights ({adapters[0]})"
    config = _model_config(manifest)
    task = manifest.get("task") if isinstance(manifest.get("task"), dict) else {}
    adapter = task.get("adapter") if isinstance(task.get("adapter"), dict) else {}  # an import's adapter_config.json
    for base in (config.get("base_model_name_or_path"), adapter.get("base_model")):
        if isinstance(base, str) and base.strip():
            return f"an adapter on {base}"
    name = config.get("_name_or_path")
    if isinstance(name, str) and name.strip():
        return f"a model loaded from {name}"
    return None
