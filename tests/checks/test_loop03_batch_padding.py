"""LOOP-03: lopsided batches warn (a configuration) naming their steps and the extreme samples; clean only gets
the info."""

import numpy as np
import polars as pl
from hypothesis import given, settings
from hypothesis import strategies as st

from sftaudit.checks.loop03_batch_padding import _grouped_padded_tokens, _per_step_max
from sftaudit.store.rundb import connect

from .data_runs import audited, clean_data_findings, findings


def test_high_length_variance_warns_from_its_step(runs):
    run_dir, verdict = audited(runs, "data_template")
    (f,) = findings(verdict, "LOOP-03", "warn")
    # The batching is a choice, stated at run scope: it dates no anomaly.
    assert (f["category"], f["step"]) == ("configuration", None)
    assert f["evidence"]["first_step"] == 3 and f["evidence"]["steps"] == [3, 4, 5, 6]
    assert f["evidence"]["value"] > 0.15 and f["evidence"]["padding_share"] > 0.6
    con = connect(run_dir, read_only=True)
    ids, lengths = con.execute(
        "SELECT sample_ids, lengths FROM batches WHERE step = ?", [f["evidence"]["worst_step"]]
    ).fetchall()[0]
    con.close()
    assert max(lengths) > 4 * min(lengths) and f["evidence"]["lengths"] == lengths
    # the shortest and the longest sample of the worst batch
    assert f["evidence"]["sample_ids"] == [ids[int(np.argmin(lengths))], ids[int(np.argmax(lengths))]]


def test_grouped_batching_pads_only_to_the_sorted_neighbours():
    # two batches of 2: [1, 9] and [8, 2] -> grouped [1, 2] and [8, 9]: padded 2*2 + 9*2 = 22 tokens
    assert _grouped_padded_tokens(np.array([1, 9, 8, 2]), np.array([2, 2]), group_batches=50) == 22
    assert _grouped_padded_tokens(np.array([1, 9, 8, 2]), np.array([2, 2]), group_batches=1) == 18 + 16


def lexsorted_grouped_padded_tokens(lengths, sizes, group_batches) -> int:
    """The grouped padding as it was computed before one packed key was sorted: a lexsort of (length, megabatch)."""
    megabatch = np.repeat(np.arange(len(sizes)), sizes) // group_batches
    order = np.lexsort((lengths, megabatch))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return int((np.maximum.reduceat(lengths[order], starts) * sizes).sum())


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=40).flatmap(
        lambda sizes: st.tuples(
            st.just(sizes), st.lists(st.integers(-(2**31), 2**31 - 1), min_size=sum(sizes), max_size=sum(sizes))
        )
    ),
    st.integers(1, 8),
)
def test_the_packed_sort_pads_as_the_lexsort_did(batches, group_batches):
    sizes, lengths = (np.array(v, dtype=np.int64) for v in batches)  # any INTEGER, negative and extreme included
    expected = lexsorted_grouped_padded_tokens(lengths, sizes, group_batches)
    assert _grouped_padded_tokens(lengths, sizes, group_batches) == expected


def test_each_steps_largest_statistics_are_polars_group_maxima():
    rng = np.random.default_rng(3)
    for steps, nulls in (([1, 1, 2, 3, 3, 3, 5], False), ([1, 1, 2, 3, 3, 3, 5], True), ([2, 2, 1, 3, 1, 4, 4], False)):
        cv = rng.random(len(steps))
        cv[[1, 2]] = np.nan  # a step with only NaN, one with a NaN beside a number
        share = [None if nulls and i == 3 else float(v) for i, v in enumerate(rng.random(len(steps)))]
        batches = pl.DataFrame({"step": steps, "cv": cv, "padding_share": share}, schema_overrides={"step": pl.Int64})
        expected = batches.group_by("step", maintain_order=True).agg(pl.col("cv").max(), pl.col("padding_share").max())
        assert _per_step_max(batches).equals(expected)


def test_clean_run_gets_only_the_waste_summary(clean_run):
    from ..shared import cached_audit

    verdict = cached_audit(clean_run)
    assert [f for f in clean_data_findings(verdict) if f["code"] == "LOOP-03"] == []
    (info,) = findings(verdict, "LOOP-03", "info")
    assert 0 < info["evidence"]["grouped_padded_tokens"] < info["evidence"]["padded_tokens"]
