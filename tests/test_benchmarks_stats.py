"""The statistics of benchmarks/shim_overhead.py on known inputs (no training)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location(
    "ab_stats", Path(__file__).resolve().parents[1] / "benchmarks" / "ab_stats.py"
)
ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab)

PREPROD = {"samples": 50, "histograms": 200, "probes": 50, "generations": 200, "evals": 200}


def test_step_classes_of_a_schedule_share_its_period():
    base, shares = ab.step_classes(PREPROD)
    assert base == frozenset()
    assert shares == {
        frozenset({"samples", "probes"}): 3 / 200,
        frozenset({"samples", "probes", "histograms", "generations", "evals"}): 1 / 200,
    }
    # Work due every step is the ordinary step's, not a rarer class; a piece switched off never runs.
    base, shares = ab.step_classes({"samples": 1, "probes": 10, "evals": 0})
    assert base == frozenset({"samples"})
    assert shares == {frozenset({"samples", "probes"}): 0.1}


def test_next_step_places_each_class_by_step_number():
    assert ab.next_step(PREPROD, 0, frozenset()) == 1
    assert ab.next_step(PREPROD, 49, frozenset()) == 51  # 50 is a probe step
    assert ab.next_step(PREPROD, 51, frozenset({"samples", "probes"})) == 100
    assert ab.next_step(PREPROD, 100, frozenset(PREPROD)) == 200


def test_rep_ratios_amortise_the_rarer_steps_at_their_share():
    a = np.full((3, 4), 0.200)  # bare: 200 ms a step
    b_base = np.full((3, 2), 0.202)  # ordinary instrumented steps: +1%
    b_events = np.array([[0.202 + 2.0, 0.202 + 0.4]] * 3)  # one step of each rarer class: +2 s and +0.4 s
    r = ab.rep_ratios(a, b_base, b_events, np.array([1 / 200, 3 / 200]))
    np.testing.assert_allclose(r["per_step"], 1.01)
    np.testing.assert_allclose(r["probe_share"], (2.0 / 200 + 0.4 * 3 / 200) / 0.2)  # 5% + 3%
    np.testing.assert_allclose(r["amortised"], 1.01 + 0.08)
    # Each repetition is against its own A block: load that doubles both leaves the ratio alone.
    slow = ab.rep_ratios(2 * a, 2 * b_base, 2 * b_events, np.array([1 / 200, 3 / 200]))
    np.testing.assert_allclose(slow["amortised"], r["amortised"])


def test_median_ci_brackets_the_median_and_is_reproducible():
    rng = np.random.default_rng(1)
    ratios = 1.02 + 0.01 * rng.standard_normal(9)
    m, lo, hi = ab.median_ci(ratios)
    assert m == pytest.approx(np.median(ratios))
    assert ratios.min() <= lo <= m <= hi <= ratios.max()
    assert ab.median_ci(ratios) == (m, lo, hi)  # fixed seed
    # More spread, a wider interval; no spread, the point itself.
    _, lo2, hi2 = ab.median_ci(1.02 + 0.05 * rng.standard_normal(9))
    assert hi2 - lo2 > hi - lo
    assert ab.median_ci(np.full(7, 1.01)) == (1.01, 1.01, 1.01)
