"""A logged series' noise and running level carried from one audit to the next (`carried_curve`) equal
`point_noise` and `rolling_level` of the whole series, bit for bit, however it grew or changed since: appended
values, a resume that rewrote its end, a value changed anywhere, a log cut shorter. So does the tail factor of the
series' z carried sorted (`carried_tail`) equal `tail_factor` of them all."""

from __future__ import annotations

import duckdb
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sftaudit.checks import AuditContext
from sftaudit.checks import carried_curve as carried
from sftaudit.checks.carried_curve import carried_curve, carried_tail
from sftaudit.checks.stats.curve import LENSES, LEVEL_POINTS, log_values, point_noise
from sftaudit.checks.stats.rolling import rolling_level, sorted_tail_factor, tail_factor
from sftaudit.store.rundb import database_dir


def audit_context(run) -> AuditContext:
    database_dir(run).mkdir(parents=True, exist_ok=True)  # the audit's cache folder, as `audit` makes it
    return AuditContext(duckdb.connect(), run, {})


def loss_log(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    loss = 2.0 + np.exp(-np.arange(n) / 300) + 0.05 * rng.standard_normal(n)
    loss[rng.integers(0, n, n // 500)] = np.nan  # a few values not logged
    return np.round(loss, 4)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    first=st.integers(3, 6000),
    grown=st.integers(0, 3000),
    change=st.sampled_from(["appended", "end rewritten", "a value changed", "cut shorter"]),
    at=st.floats(0, 1),
    chunk=st.sampled_from([carried.CURVE_CHUNK, 1000, 64, 7]),
)
def test_a_carried_curve_equals_the_statistics_of_the_whole_series(
    tmp_path_factory, seed, first, grown, change, at, chunk
):
    run = tmp_path_factory.mktemp("run")
    before = loss_log(seed, first)
    saved_every, carried.CURVE_CHUNK = carried.CURVE_CHUNK, chunk  # cut short: the first audit saves part
    try:
        carried_curve(audit_context(run), "loss", before)
    finally:
        carried.CURVE_CHUNK = saved_every
    after = np.concatenate([before, loss_log(seed + 1, grown)])
    row = int(at * (after.size - 1))
    if change == "end rewritten":  # a resume from an earlier step: the steps after it logged again
        after[row:] = loss_log(seed + 2, after.size - row)
    elif change == "a value changed":
        after[row] *= 3.0
    elif change == "cut shorter":
        after = after[: max(3, row)]
    curve = carried_curve(audit_context(run), "loss", after)
    x = log_values(after)
    assert curve.noise.view(np.int64).tolist() == point_noise(x).view(np.int64).tolist()
    assert curve.level.view(np.int64).tolist() == rolling_level(x, LEVEL_POINTS).view(np.int64).tolist()
    # Through a lens (LOOP-10 judges lone peaks on the square root too): the noise of the transformed values.
    root = LENSES["square root"][0]
    carried_curve(audit_context(run), "root", before, root)
    through = carried_curve(audit_context(run), "root", after, root)
    assert through.noise.view(np.int64).tolist() == point_noise(root(x)).view(np.int64).tolist()


def test_what_a_later_audit_computes_is_only_the_blocks_near_what_is_new(tmp_path, monkeypatch):
    from sftaudit.checks import carried_curve as module

    computed_from = []
    original = module.block_noise

    def recorded(x, *args, first_block=0, **kwargs):
        computed_from.append(first_block)
        return original(x, *args, first_block=first_block, **kwargs)

    monkeypatch.setattr(module, "block_noise", recorded)
    loss = loss_log(1, 100_000)
    carried_curve(audit_context(tmp_path), "loss", loss[:99_000])
    carried_curve(audit_context(tmp_path), "loss", loss)
    carried_curve(audit_context(tmp_path), "loss", np.r_[loss, loss_log(2, 500)])
    # The curve is saved up to the last multiple of CURVE_CHUNK rows (98,304; written again only once that moves):
    # blocks of 64 rows, the last saved value's block (1535) and the 2 blocks pooled before it are computed again.
    saved = 99_000 // carried.CURVE_CHUNK * carried.CURVE_CHUNK
    assert computed_from == [0, (saved - 1) // 64 - 2, (saved - 1) // 64 - 2]


def z_scores(seed: int, n: int) -> np.ndarray:
    """Heavy-tailed z with ties (rounded), rows not judged (NaN) and a noiseless rise (inf) among them."""
    rng = np.random.default_rng(seed)
    z = np.round(rng.standard_t(3, n), int(rng.integers(0, 3)))
    if n:
        z[rng.integers(0, n, n // 50 + 1)] = np.nan
        z[rng.integers(0, n, n // 500 + 1)] = np.inf
    return z


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(0, 3000))
def test_the_tail_factor_of_sorted_values_is_the_tail_factor(seed, n):
    z = z_scores(seed, n)
    finite = z[np.isfinite(z)]
    assert sorted_tail_factor(np.sort(finite)) == tail_factor(finite)


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    first=st.integers(0, 1500),
    grown=st.integers(0, 600),
    change=st.sampled_from(["appended", "end rewritten", "a value changed", "cut shorter", "all moved"]),
    at=st.floats(0, 1),
)
def test_a_carried_tail_factor_equals_the_tail_factor_of_the_whole_series(
    tmp_path_factory, seed, first, grown, change, at
):
    run = tmp_path_factory.mktemp("run")
    before = z_scores(seed, first)
    after = np.concatenate([before, z_scores(seed + 1, grown)])
    row = int(at * max(0, after.size - 1))
    if change == "end rewritten":  # a resume from an earlier step: its rows judged again
        after[row:] = z_scores(seed + 2, after.size - row)
    elif change == "a value changed" and after.size:
        after[row] = -after[row] if np.isfinite(after[row]) and after[row] else 7.0
    elif change == "cut shorter":
        after = after[:row]
    elif change == "all moved":  # a new rounding step of the log rescales every z
        after = after * 1.5
    with pytest.MonkeyPatch.context() as small:  # chunks of a few hundred rows, so that some close
        small.setattr(carried, "TAIL_CHUNK", 128)
        small.setattr(carried, "TAIL_OPEN", 16)
        ctx = audit_context(run)  # it keeps nothing between the calls but the cache folder's file
        assert carried_tail(ctx, "z", before) == tail_factor(before[np.isfinite(before)])
        assert carried_tail(ctx, "z", after) == tail_factor(after[np.isfinite(after)])
