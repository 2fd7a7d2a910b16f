"""Statistics of an interleaved A/B timing (shim_overhead.py): per-repetition ratios, their median
and its bootstrap interval, and the schedule arithmetic that amortises rare steps.

Kept apart from the benchmark so tests/test_benchmarks_stats.py checks them without training."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
from scipy import stats


def step_classes(intervals: dict[str, int]) -> tuple[frozenset, dict[frozenset, float]]:
    """The kinds of step a schedule makes: `intervals` maps each scheduled piece of work to its period
    in steps (0: off; it runs at steps that are multiples of it). Returns the base class (what runs at
    an ordinary step: the pieces due every step) and each other class with the share of steps it takes
    over one period of the schedule (the lcm of the periods)."""
    on = {kind: every for kind, every in intervals.items() if every}
    period = math.lcm(*on.values()) if on else 1
    counts = Counter(step_class(intervals, s) for s in range(1, period + 1))
    base = frozenset(kind for kind, every in on.items() if every == 1)
    return base, {cls: n / period for cls, n in sorted(counts.items(), key=lambda kv: sorted(kv[0])) if cls != base}


def step_class(intervals: dict[str, int], step: int) -> frozenset:
    return frozenset(kind for kind, every in intervals.items() if every and step % every == 0)


def next_step(intervals: dict[str, int], after: int, cls: frozenset) -> int:
    """The first step number after `after` whose scheduled work is exactly `cls`."""
    step = after + 1
    while step_class(intervals, step) != cls:
        step += 1
    return step


def rep_ratios(a: np.ndarray, b_base: np.ndarray, b_events: np.ndarray, shares: np.ndarray) -> dict[str, np.ndarray]:
    """Per repetition r: a[r] the bare block's step times, b_base[r] the instrumented block's ordinary
    steps, b_events[r, c] its one step of each rarer class c, whose share of steps is shares[c].
    An instrumented step costs, amortised over the schedule, its ordinary step plus each rare class's
    excess over it times that class's share. Returns per repetition: per_step (ordinary B / A),
    probe_share (the amortised excess over A) and amortised (their sum): each a ratio to the same
    repetition's A block."""
    a_mean = np.asarray(a, dtype=float).mean(axis=1)
    base = np.asarray(b_base, dtype=float).mean(axis=1)
    events = np.asarray(b_events, dtype=float).reshape(len(base), -1)
    excess = (events - base[:, None]) @ np.asarray(shares, dtype=float).reshape(-1)
    return {"per_step": base / a_mean, "probe_share": excess / a_mean, "amortised": (base + excess) / a_mean}


def median_ci(
    values: np.ndarray, confidence: float = 0.95, seed: int = 0, resamples: int = 10_000
) -> tuple[float, float, float]:
    """Median of `values` and its percentile-bootstrap interval (repetitions resampled with
    replacement; a fixed seed, so a rerun on the same figures prints the same interval)."""
    values = np.asarray(values, dtype=float)
    if len(values) < 2 or np.ptp(values) == 0:  # no spread to resample: the interval is the point
        m = float(np.median(values))
        return m, m, m
    res = stats.bootstrap(
        (values,),
        np.median,
        confidence_level=confidence,
        n_resamples=resamples,
        method="percentile",
        random_state=np.random.default_rng(seed),
    )
    return float(np.median(values)), float(res.confidence_interval.low), float(res.confidence_interval.high)
