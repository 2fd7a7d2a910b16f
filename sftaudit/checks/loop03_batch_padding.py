"""LOOP-03 batch padding strategy."""

from __future__ import annotations

import numpy as np
import polars as pl

from .base import AuditContext, Check, Finding, at_least, count, share

# Rank 0's batches that hold rows, in the order they were trained.
BATCHES = "FROM batches WHERE rank = 0 AND rows > 0 ORDER BY seg, step, micro"


class BatchPaddingStrategy(Check):
    """Batch padding strategy (trigger point: after collate).

    What it detects:
        Batches whose sequence lengths vary so much that most of the batch is padding, and
        how much of the whole run's compute went to padding compared with length-grouped
        batching.
    Why it matters:
        Padding costs the same compute as real tokens and trains nothing; a batch of one
        long and many short samples also weights the loss towards the long one.
    Statistic:
        Per micro-batch (from the recorded lengths): coefficient of variation of the
        sequence lengths (population std / mean) and padding share
        1 - sum(lengths) / (rows * padded length). CV alone flags every randomly batched chat
        dataset (the fixture's clean run sits at 16-48%), so a batch is flagged only when
        its lengths vary above the CV threshold AND that variation makes most of the
        batch padding. Run level: padding share of all tokens, and the padded tokens that
        length-grouped batching (lengths sorted within megabatches of `group_batches`
        consecutive batches, as HF's `group_by_length` does) would need.
    Threshold:
        CV above 15% with padding share above 60% in a batch is a warn (a configuration:
        the batching is a choice, stated at run scope); the run's
        padding waste and the grouped-batching saving are reported as info.
    Evidence:
        Steps and count of flagged batches, the worst batch's CV, padding share, lengths
        and sample ids (shortest and longest); run totals of real and padded tokens.
    """

    code = "LOOP-03"
    name = "batch padding strategy"
    rules = {
        "length-variance": "batches are mostly padding because their lengths vary",
        "padding-share": "the run's share of padding and what length grouping would save",
    }
    needs = ("batches",)
    defaults = {"cv_threshold": at_least(0.15, 0), "padding_threshold": share(0.6), "group_batches": count(50)}

    def run(self, ctx: AuditContext) -> list[Finding]:
        # Each batch's statistics, not its lists: a million batches' lists made into a frame cost 0.2 s of CPU at
        # each audit; the run's lengths are read flat (`_run_waste`), the worst batch's lists by its rowid.
        batches = ctx.frame(
            f"""
            SELECT rowid AS batch_row, step, rows, seq_len,
                   list_stddev_pop(lengths) / nullif(list_avg(lengths), 0) AS cv,
                   1 - list_sum(lengths) / (rows * seq_len)::DOUBLE AS padding_share
            {BATCHES}
            """
        )
        if batches.is_empty():
            return []
        per_step = _per_step_max(batches)
        ctx.add_series(
            self.code, "length CV", per_step["step"], per_step["cv"].fill_null(0), self.params["cv_threshold"]
        )
        ctx.add_series(
            self.code, "padding share", per_step["step"], per_step["padding_share"], self.params["padding_threshold"]
        )
        return self._wasteful_batches(ctx, batches) + self._run_waste(ctx, batches)

    def _wasteful_batches(self, ctx: AuditContext, batches) -> list[Finding]:
        flagged = batches.filter(
            (batches["cv"] > self.params["cv_threshold"])
            & (batches["padding_share"] > self.params["padding_threshold"])
        )
        if flagged.is_empty():
            return []
        first = int(flagged["step"].min())
        worst = flagged.sort("padding_share", descending=True).row(0, named=True)
        lengths, ids = ctx.row("SELECT lengths, sample_ids FROM batches WHERE rowid = ?", [worst["batch_row"]])
        return [
            self.finding(
                "length-variance",
                "warn",
                f"{flagged.height} batch(es) from step {first} are mostly padding because their lengths vary "
                f"(worst: step {worst['step']}, CV {worst['cv']:.0%}, {worst['padding_share']:.0%} padding); "
                f"batch by length (group_by_length or a length-bucketing sampler)",
                category="configuration",
                first_step=first,
                batches_flagged=flagged.height,
                steps=sorted(set(flagged["step"].to_list()))[:50],
                worst_step=worst["step"],
                value=worst["cv"],
                threshold=self.params["cv_threshold"],
                padding_share=worst["padding_share"],
                lengths=lengths,
                sample_ids=[ids[int(np.argmin(lengths))], ids[int(np.argmax(lengths))]],
            )
        ]

    def _run_waste(self, ctx: AuditContext, batches) -> list[Finding]:
        # The batches' lengths one after another, in the order of `batches` (an unnest keeps its input's order).
        lengths = ctx.con.sql(f"SELECT unnest(lengths) AS length FROM (SELECT lengths {BATCHES})").fetchnumpy()[
            "length"
        ]
        lengths = np.asarray(lengths, dtype=np.int64)
        sizes = batches["rows"].to_numpy().astype(np.int64)
        real = int(lengths.sum())
        padded = int((sizes * batches["seq_len"].to_numpy()).sum())
        grouped = _grouped_padded_tokens(lengths, sizes, self.params["group_batches"])
        waste, saving = 1 - real / padded, 1 - grouped / padded
        return [
            self.finding(
                "padding-share",
                "info",
                f"padding is {waste:.0%} of the run's {padded} batch tokens; length-grouped batching would need "
                f"{grouped} ({saving:.0%} less compute)",
                value=waste,
                real_tokens=real,
                padded_tokens=padded,
                grouped_padded_tokens=grouped,
                grouped_saving=saving,
            )
        ]


def _per_step_max(batches: pl.DataFrame) -> pl.DataFrame:
    """Each step's largest CV and padding share, steps in their first batch's order. Batches come ordered by step
    (a resume moves the steps it trains again out of the table) and mostly without nulls: numpy's maximum over each
    run of a step, NaN left out as polars' `max` does (a polars group-by of a million batches cost 0.2 s of CPU);
    else polars' group-by."""
    steps = batches["step"].to_numpy()
    if batches["cv"].null_count() or batches["padding_share"].null_count() or (np.diff(steps) < 0).any():
        return batches.group_by("step", maintain_order=True).agg(pl.col("cv").max(), pl.col("padding_share").max())
    starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
    with np.errstate(invalid="ignore"):
        return pl.DataFrame(
            {
                "step": steps[starts],
                "cv": np.fmax.reduceat(batches["cv"].to_numpy(), starts),
                "padding_share": np.fmax.reduceat(batches["padding_share"].to_numpy(), starts),
            }
        )


def _grouped_padded_tokens(lengths: np.ndarray, sizes: np.ndarray, group_batches: int) -> int:
    """Padded tokens if each megabatch of `group_batches` batches were re-batched by sorted length
    (the batch sizes kept in order), each batch padded to its longest row. Each row's megabatch and length (INTEGER:
    less than 2^32 apart) are one int64 key, sorted in place: the rows in megabatch order, each one's lengths
    ascending, so a batch's longest is the last row of its slice (a megabatch's batches tile its rows): one array of
    the rows sorted, not a lexsort's several."""
    shortest = int(lengths.min())
    megabatch = np.repeat(np.arange(sizes.size, dtype=np.int64) // group_batches, sizes)
    keys = (megabatch << 32) | (lengths - shortest)
    keys.sort()
    longest = (keys[np.cumsum(sizes) - 1] & 0xFFFFFFFF) + shortest
    return int((longest * sizes).sum())
