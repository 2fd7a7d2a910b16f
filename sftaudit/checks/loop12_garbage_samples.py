"""LOOP-12 garbage samples."""

from __future__ import annotations

import re

import numpy as np
import polars as pl

from .base import AuditContext, Check, Finding, at_least, count, share
from .recorded import run_tokenizer

IGNORE_INDEX = -100
SENTENCEPIECE_BYTE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class GarbageSamples(Check):
    """Garbage training samples (gibberish that data cleaning let through).

    What it detects:
        Recorded training samples whose trained (assistant) tokens are mostly raw bytes: the
        single-byte tokens a byte-level tokenizer falls back to for text it has no pieces for
        (mis-decoded bytes, a script its corpus never had, binary junk). A burst of them from step N is reported at N with the sample ids;
        a run whose every sample looks like that has a tokenizer that does not cover its data.
    Why it matters:
        1% of gibberish samples can leave the loss almost unchanged yet make the model's predictions
        unstable (top-1 std 0.02 -> 0.15); the model spends its updates memorising noise.
        Found at the batch, the samples can be dropped before the run is resumed.
    Statistic:
        Per recorded sample, the share of its trained tokens that are raw bytes (a
        byte-level BPE base byte or a sentencepiece `<0xHH>` fallback that decodes to U+FFFD
        alone), looked up in one vectorised pass over the tokenizer's vocabulary; the run's
        median share is the baseline. Multi-byte pieces of a character are not counted: a
        tokenizer with few merges for a language splits its characters into them, and that
        is not garbage (clean Chinese samples of the fixture reach 26% raw bytes, gibberish 100%). Only the rows the
        profile records as evidence are seen (every step in `dev`, sampled in `preprod`).
    Threshold:
        A sample is garbage when its share is at least `byte_share` (0.5) and at least
        `baseline_factor` (4) times the run's median share: warn at the first such step.
        A run median of `byte_share` or more is one warn about the tokenizer.
    Evidence:
        Steps and sample ids of the garbage samples, their raw-byte shares, the run's
        median share, and the decoded start of the first one.
    """

    code = "LOOP-12"
    name = "garbage samples"
    rules = {
        "tokenizer-coverage": "a typical sample's trained tokens are mostly raw bytes: the tokenizer does not cover the script",
        "garbage-samples": "recorded samples are mostly raw bytes",
    }
    needs = ("samples",)
    defaults = {"byte_share": share(0.5), "baseline_factor": at_least(4.0, 1), "max_samples_listed": count(10)}

    def run(self, ctx: AuditContext) -> list[Finding]:
        samples = ctx.frame("SELECT step, sample_id, labels FROM samples WHERE rank = 0 ORDER BY step, micro, row")
        tokenizer = run_tokenizer(ctx) if len(samples) else None
        if tokenizer is None:
            return []
        byte_piece = _raw_bytes(tokenizer)
        trained = (
            samples.with_row_index("sample")
            .explode("labels")
            .filter(pl.col("labels") != IGNORE_INDEX)
            .filter(pl.col("labels").is_between(0, len(byte_piece) - 1))
        )
        share = (
            trained.with_columns(pl.Series("byte", byte_piece[trained["labels"].to_numpy()]))
            .group_by("sample", "step", "sample_id", maintain_order=True)
            .agg(pl.col("byte").mean().alias("share"))
        )
        if share.is_empty():
            return []
        baseline = float(share["share"].median())
        p = self.params
        if baseline >= p["byte_share"]:
            return [
                self.finding(
                    "tokenizer-coverage",
                    "warn",
                    f"{baseline:.0%} of the trained tokens of a typical sample are raw bytes: the tokenizer "
                    f"does not cover this data's script; train or extend a tokenizer on it before fine-tuning",
                    median_share=baseline,
                    threshold=p["byte_share"],
                )
            ]
        garbage = share.filter(
            (pl.col("share") >= p["byte_share"]) & (pl.col("share") >= p["baseline_factor"] * max(baseline, 1e-3))
        )
        if garbage.is_empty():
            return []
        first = int(garbage["step"][0])
        listed = garbage.head(p["max_samples_listed"])
        first_labels = samples["labels"][int(garbage["sample"][0])].to_list()
        excerpt = tokenizer.decode([t for t in first_labels if t != IGNORE_INDEX][:40])
        steps = sorted(set(garbage["step"].to_list()))
        return [
            self.finding(
                "garbage-samples",
                "warn",
                f"{len(garbage)} recorded sample(s) from step {first} are mostly raw bytes (first "
                f"{garbage['sample_id'][0]}, {garbage['share'][0]:.0%} of its trained tokens): garbage text in the "
                f"training data; drop these samples and resume from a checkpoint before step {first}",
                step=first,
                sample_ids=listed["sample_id"].to_list(),
                steps=steps,
                shares=[round(s, 3) for s in listed["share"].to_list()],
                median_share=baseline,
                threshold=p["byte_share"],
                excerpt=excerpt,
            )
        ]


def _raw_bytes(tokenizer) -> np.ndarray:
    """True for each token id that is one raw byte decoding to no valid text on its own."""
    ids = list(range(len(tokenizer)))
    pieces = tokenizer.batch_decode([[i] for i in ids])
    names = tokenizer.convert_ids_to_tokens(ids)
    return np.fromiter(
        (
            ("\ufffd" in piece) and (len(name) == 1 or SENTENCEPIECE_BYTE.fullmatch(name) is not None)
            for piece, name in zip(pieces, names)
        ),
        dtype=bool,
        count=len(ids),
    )
