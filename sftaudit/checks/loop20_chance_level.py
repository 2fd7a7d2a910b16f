"""LOOP-20 loss at or above chance: ln(vocabulary size)."""

from __future__ import annotations

import math
import re

import numpy as np

from .base import AuditContext, CannotJudge, Check, Finding, at_least, count
from .stats.rolling import column, loss_family, positive, step_frame

# Logged numbers that are parts of the loss, not other metrics (a multi-head or auxiliary loss sums them).
COMPONENT = re.compile(r"(^|[/_])p?loss(_|/|$)|_loss$|^loss[/_]")
NOT_COMPONENTS = {"loss", "eval_loss", "train_loss", "predict_loss", "total_loss"}


def vocab_size(manifest: dict) -> tuple[int | None, str | None]:
    """The output vocabulary (the model's when its config says, else the tokenizer's) and where it came from."""
    model = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}
    config = model.get("config") if isinstance(model.get("config"), dict) else {}
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


class ChanceLevelLoss(Check):
    """Loss at or above chance (trigger point: every logged step).

    What it detects:
        A token cross-entropy at or above ln V, the loss of a uniform guess over the V-token vocabulary: for
        a whole stretch through the end of the run (a model stuck at chance: 10.78 = ln 50257 for the whole
        run), or at a logged step well above chance (a first window of 14.75 for a model with ln V = 12.5).
    Why it matters:
        A model that learned only the unigram frequencies of text is already far below ln V; one at ln V has
        learned nothing (a loss not reaching the weights, a frozen or re-initialised head). Above ln V it is
        confidently wrong: the weights loaded are not the pretrained ones, or labels and logits are misaligned.
    Statistic:
        ln V with V the model's vocab_size (its config), else the tokenizer's length. A logged loss is at
        chance when >= (1 - `tolerance`) ln V; above chance when >= (1 + `tolerance`) ln V.
    Threshold:
        At chance for every logged step from some step through the end (at least half the run, or the whole
        of a short one), over at least `min_steps` (100) optimizer steps: fail (a model trained from scratch
        starts at chance and leaves it within tens of steps). Above chance at logged steps the run then left: warn at the first one. Judged
        for cross-entropy losses only: not for preference or policy-gradient losses (named from the log's
        keys), nor for a loss the log shows as a sum of components (`*loss_*` keys). Vocabulary unknown: not
        judged.
    Evidence:
        V and where it came from, ln V, the first step, the logged losses, how many logged steps.
    """

    code = "LOOP-20"
    name = "loss at chance"
    needs = ("steps",)
    defaults = {"tolerance": at_least(0.02, 0), "min_steps": count(100)}

    def run(self, ctx: AuditContext) -> list[Finding]:
        vocab, source = vocab_size(ctx.manifest)
        if vocab is None:
            raise CannotJudge("the vocabulary size is unknown (no model config.json, tokenizer or checkpoint header)")
        family, keys = loss_family(ctx)
        if family != "sft":
            raise CannotJudge(f"a {family} loss (logged {', '.join(keys[:3])}) is not a token cross-entropy")
        names = {n for (n,) in ctx.con.execute("SELECT DISTINCT name FROM metrics WHERE rank = 0").fetchall()}
        parts = sorted(n for n in names - NOT_COMPONENTS if COMPONENT.search(n) and not n.startswith("eval_"))
        if parts:
            raise CannotJudge(
                f"the logged loss combines logged components ({', '.join(parts[:4])}): not one token "
                "cross-entropy over the vocabulary"
            )
        frame = step_frame(ctx, "loss")
        loss = column(frame, "loss")
        finite = np.isfinite(loss)
        if not finite.any():
            raise CannotJudge("no finite loss logged")
        steps, loss = frame["step"].to_numpy()[finite], loss[finite]
        chance = math.log(vocab)
        tol = self.params["tolerance"]
        evidence = dict(vocab_size=vocab, vocab_source=source, chance_loss=chance, threshold=tol)
        at = loss >= (1 - tol) * chance
        stuck = np.flip(np.logical_and.accumulate(np.flip(at)))  # at chance from this row through the end
        rows = np.flatnonzero(stuck)
        # A model trained from scratch starts at chance and leaves it within tens of steps (it learns the
        # unigram frequencies first): a stretch shorter than `min_steps` is too early to call stuck.
        trained = int(steps[-1] - (steps[rows[0] - 1] if rows.size and rows[0] else 0)) if rows.size else 0
        if rows.size and rows.size >= -(-loss.size // 2) and trained >= self.params["min_steps"]:
            i = int(rows[0])
            return [
                self.finding(
                    "fail",
                    f"loss stayed at chance from step {steps[i]} through the end ({rows.size} logged step(s), "
                    f"{loss[i]:.4g} .. {loss[-1]:.4g} against ln {vocab:,} = {chance:.4g}): the model learned nothing; check "
                    f"that the loss reaches trainable weights (a frozen or re-initialised output head, labels all "
                    f"ignored) and that the learning rate is not 0",
                    step=steps[i],
                    value=loss[i],
                    last_loss=loss[-1],
                    steps_at_chance=int(rows.size),
                    steps_trained=trained,
                    **evidence,
                )
            ]
        above = np.flatnonzero(loss >= (1 + tol) * chance)
        if not above.size:
            return []
        i = int(above[0])
        return [
            self.finding(
                "warn",
                f"loss {loss[i]:.4g} at step {steps[i]} is above chance (ln {vocab:,} = {chance:.4g}; {above.size} logged "
                f"step(s) above it, then {loss[-1]:.4g} at the end): the model was confidently wrong there; check the "
                f"weights loaded at start (a resized or re-initialised embedding or head) and the label alignment",
                step=steps[i],
                value=loss[i],
                last_loss=loss[-1],
                steps_above=int(above.size),
                **evidence,
            )
        ]
