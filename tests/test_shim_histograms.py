"""The shim's gradient histograms against an independent numpy count, on tensors with zeros, NaN,
infinities and values below and above the bin range (the histogram takes the infinities out of the
last bin it clamps them into, and histc skips NaN)."""

from __future__ import annotations

import numpy as np
import torch

from sftaudit.core.artifacts import GRAD_HIST_EDGES
from sftaudit.shim.gradients import histograms


def reference(g: np.ndarray) -> np.ndarray:
    lo, hi, bins = GRAD_HIST_EDGES[0], GRAD_HIST_EDGES[-1], len(GRAD_HIST_EDGES) - 1
    finite = g[np.isfinite(g)]
    mag = np.clip(np.log10(np.maximum(np.abs(finite), 1e-30)), lo, hi - 1e-6)
    counts = np.bincount(((mag - lo) * bins / (hi - lo)).astype(int), minlength=bins)
    return np.concatenate([[np.sum(g == 0), g.size - finite.size], counts])


def test_histograms_count_like_numpy_with_zeros_nan_and_infinities():
    rng = np.random.default_rng(0)
    tensors = []
    for n in (1_000, 20_000):
        # Magnitudes from 1e-40 to 1e5 (random: none on a bin edge, where float rounding may differ).
        g = rng.standard_normal(n) * 10.0 ** rng.uniform(-40, 5, n)
        g[::7], g[::13], g[::17], g[::19] = 0.0, np.nan, np.inf, -np.inf
        tensors.append(g.astype(np.float32))
    tensors.append(np.full(9, np.inf, np.float32))
    tensors.append(np.zeros(4, np.float32))
    got = histograms([torch.from_numpy(t) for t in tensors]).numpy()
    for row, t in zip(got, tensors):
        assert row[1] == np.sum(~np.isfinite(t))  # NaN and infinities, none left in a bin
        np.testing.assert_array_equal(row, reference(t.astype(np.float64)))
