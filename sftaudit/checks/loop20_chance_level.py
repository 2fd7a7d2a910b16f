"""LOOP-20 loss at chance (ln K labels, ln V tokens), above it, or back to it."""

from __future__ import annotations

import re

import numpy as np

from .base import AuditContext, CannotJudge, Check, Finding, at_least, count, share
from .stats.curve import NoChance, centred_median, chance_level, pretrained_evidence
from .stats.rolling import column, loss_family, step_frame

# Logged numbers that are parts of the loss, not other metrics (a multi-head or auxiliary loss sums them).
COMPONENT = re.compile(r"(^|[/_])p?loss(_|/|$)|_loss$|^loss[/_]")
NOT_COMPONENTS = {"loss", "eval_loss", "train_loss", "predict_loss", "total_loss"}


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(first row, length) of each stretch of consecutive true rows."""
    edges = np.diff(np.r_[0, np.asarray(mask, bool).astype(np.int8), 0])
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return list(zip(starts.tolist(), (ends - starts).tolist()))


class ChanceLevelLoss(Check):
    """Loss at chance (trigger point: every logged step).

    What it detects:
        A cross-entropy at the loss of a uniform guess (ln K for a classification head of K labels, ln V for a
        language model over V tokens): for the whole run (a model stuck at chance: 10.78 = ln 50257 throughout);
        back at chance through the end after the run had left it (a two-label classifier that reached 0.31 and
        sits at ln 2 = 0.693 after a gradient burst, to the end); for a stretch the run later leaves (a window
        back at chance; the first windows of a LoRA fine-tune at ln 50257); above chance after the run was at
        or below it (a learning rate 100x too high: 4.2 -> 11.3 -> 12.05 against ln 2048 = 7.62), or at a
        logged step the run then left (a first window of 14.75 for a model with ln V = 12.5); and a pretrained
        language model whose first logged loss is above what a model knowing only token frequencies scores.
    Why it matters:
        A model at chance has learned nothing (a loss not reaching the weights, a frozen or re-initialised head);
        a classifier back at ln K predicts its label prior whatever the input: the run collapsed, and every later
        step is wasted. Above chance the model is confidently wrong: after an update, the update destroyed what
        it knew; at the start, the weights loaded are not the pretrained ones or labels and logits are
        misaligned. A pretrained model never starts at (or near) chance: its first windows there mean its
        weights did not load or the labels are wrong (pad tokens trained).
    Statistic:
        Chance from the model's config.json as recorded: a `*ForSequenceClassification` (token, audio, image
        classification, multiple choice) head has K = len(id2label), else num_labels, else transformers' default
        2 (ln 2 per label for a multi-label head; a regression head has no chance level); any other model ln V
        with V its vocab_size (seq2seq and speech decoders too), else the tokenizer's length. A logged loss is at
        chance when the centred median of 3 logged values is >= (1 - `tolerance`) x chance (within 15%: less than
        a model knowing only token frequencies scores, about 0.7 ln V for a language model); above chance when a
        logged value is >= (1 + `above`) x chance (15% over: a collapsed classifier's window mean wanders a few
        percent either side of ln K). Pretrained: LoRA weights, an adapter config or a model loaded by
        name (config.json's `_name_or_path`).
    Threshold:
        At chance from a step through the end after the run had left chance, over at least `min_points` (3)
        logged steps: fail (collapse). At chance for every logged step from some step through the end (at least
        half the run) over at least `min_steps` (100) optimizer steps: fail (a model trained from scratch starts
        at chance and leaves it within tens of steps). At chance for a stretch the run then leaves, after it had
        left chance (or at the start, when the model is a pretrained language model): warn at its first step.
        Above chance for 2 logged steps in a row after a step at or below chance: fail; above chance otherwise:
        warn. First logged loss of a pretrained language model >= `unigram_share` (0.75) x ln V: warn. Judged for
        cross-entropy losses only: not for preference losses (a DPO loss starts at ln 2 by construction) or
        policy-gradient losses (named from the log's keys), nor for a loss the log shows as a sum of components
        (`*loss_*` keys). Chance unknown: not judged.
    Evidence:
        K or V and where it came from, ln K or ln V, the kind of head, the first and last step of the stretch,
        the logged losses there, the best loss before it, the gradient norm at its start.
    """

    code = "LOOP-20"
    name = "loss at chance"
    rules = {
        "at-chance": "the loss stayed at chance level through the end",
        "above-chance": "the loss rose above chance level",
        "chance-throughout": "the loss sat at chance from its first logged step through the end",
        "back-to-chance": "the loss went back to chance for a stretch of logged steps",
        "chance-at-start": "the first logged steps of a pretrained model are at chance",
        "destroyed": "the loss went above chance after the run had learned: an update destroyed the model",
        "above-unigram": "the first logged loss of a pretrained language model is above what token frequencies score",
    }
    needs = ("steps",)
    defaults = {
        "tolerance": at_least(0.15, 0),
        "above": at_least(0.15, 0),
        "min_steps": count(100),
        "min_points": count(3),
        "unigram_share": share(0.75),
    }

    def run(self, ctx: AuditContext) -> list[Finding]:
        family, keys = loss_family(ctx)
        if family == "preference":
            raise CannotJudge(
                f"a preference loss (logged {', '.join(keys[:3])}) starts at ln 2 = 0.693 by construction (the policy "
                "equals its reference): it has no chance level"
            )
        if family != "sft":
            raise CannotJudge(f"a {family} loss (logged {', '.join(keys[:3])}) is not a cross-entropy")
        try:
            chance = chance_level(ctx.manifest)
        except NoChance as exc:
            raise CannotJudge(str(exc)) from None
        names = {n for (n,) in ctx.con.execute("SELECT DISTINCT name FROM metrics WHERE rank = 0").fetchall()}
        parts = sorted(n for n in names - NOT_COMPONENTS if COMPONENT.search(n) and not n.startswith("eval_"))
        if parts:
            raise CannotJudge(
                f"the logged loss combines logged components ({', '.join(parts[:4])}): not one cross-entropy "
                "over the vocabulary or the labels"
            )
        frame = step_frame(ctx, "loss", "grad_norm")
        loss = column(frame, "loss")
        finite = np.isfinite(loss)
        if not finite.any():
            raise CannotJudge("no finite loss logged")
        steps, loss, norm = frame["step"].to_numpy()[finite], loss[finite], column(frame, "grad_norm")[finite]
        c = chance["chance"]
        p = self.params
        at = centred_median(loss, 3) >= (1 - p["tolerance"]) * c if loss.size >= 3 else loss >= (1 - p["tolerance"]) * c
        above = loss >= (1 + p["above"]) * c
        self._ctx = dict(steps=steps, loss=loss, norm=norm, chance=chance, pretrained=pretrained_evidence(ctx.manifest))
        destroyed = self._destroyed(above)
        found = [destroyed] if destroyed else []
        found += self._stuck(at) or self._transient(at, above, skip=destroyed)
        if not destroyed:
            found += self._above(above)
        found += self._unigram_start(at, above)
        return sorted(found, key=lambda f: f.step if f.step is not None else -1)

    # ------------------------------------------------------------------ the rules

    def _evidence(self, first: int, last: int, **more) -> dict:
        k = self._ctx
        steps, loss, norm, chance = k["steps"], k["loss"], k["norm"], k["chance"]
        before = loss[:first]
        return dict(
            chance_loss=chance["chance"],
            classes=chance["classes"],
            kind=chance["kind"],
            chance_source=chance["source"],
            first_step=steps[first],
            last_step=steps[last],
            logged_steps=last - first + 1,
            losses=loss[first : last + 1].tolist()[:50],
            best_before=float(before.min()) if before.size else None,
            grad_norm_at_start=float(norm[first]) if np.isfinite(norm[first]) else None,
            pretrained=k["pretrained"],
            threshold=self.params["tolerance"],
            **more,
        )

    def _name(self) -> str:
        chance = self._ctx["chance"]
        symbol = "K" if chance["head"] else "V"
        unit = "labels" if chance["head"] else "tokens"
        return f"ln {symbol} = ln {chance['classes']:,} = {chance['chance']:.4g} ({chance['classes']:,} {unit})"

    def _stuck(self, at: np.ndarray) -> list[Finding]:
        """At chance through the end: a collapse (after leaving it) or a model that never learned."""
        steps, loss, norm = self._ctx["steps"], self._ctx["loss"], self._ctx["norm"]
        if not at[-1]:
            return []
        i = int(np.flatnonzero(~at)[-1]) + 1 if (~at).any() else 0
        n = loss.size - i
        if i > 0 and n >= self.params["min_points"]:
            head = self._ctx["chance"]["head"]
            what = (
                "its label prior, whatever the input"
                if head
                else "tokens no better than a uniform guess, whatever the context"
            )
            burst = ""
            if np.isfinite(norm[max(i - 1, 0) : i + 1]).any() and np.isfinite(norm).sum() >= 3:
                peak = float(np.nanmax(norm[max(i - 1, 0) : i + 1]))
                typical = float(np.nanmedian(norm))
                if peak >= 3 * typical:
                    burst = f" after a gradient-norm burst ({peak:.3g} against a median of {typical:.3g})"
            return [
                self.finding(
                    "at-chance",
                    "fail",
                    f"loss went back to chance at step {steps[i]}{burst} and stayed there through the end ({n} logged "
                    f"steps, {loss[i:].min():.4g} .. {loss[i:].max():.4g} against {self._name()}) after reaching "
                    f"{loss[:i].min():.4g}: the model collapsed to predicting {what}; lower the learning rate (or "
                    f"clip the gradients) and resume from a checkpoint before step {steps[i]}",
                    step=steps[i],
                    value=loss[i],
                    **self._evidence(i, loss.size - 1, collapse=True),
                )
            ]
        trained = int(steps[-1] - (steps[i - 1] if i else 0))
        if i == 0 and n >= -(-loss.size // 2) and trained >= self.params["min_steps"]:
            return [
                self.finding(
                    "chance-throughout",
                    "fail",
                    f"loss stayed at chance from step {steps[0]} through the end ({n} logged step(s), {loss[0]:.4g} .. "
                    f"{loss[-1]:.4g} against {self._name()}): the model learned nothing; check that the loss reaches "
                    f"trainable weights (a frozen or re-initialised output head, labels all ignored) and that the "
                    f"learning rate is not 0",
                    step=steps[0],
                    value=loss[0],
                    last_loss=loss[-1],
                    steps_trained=trained,
                    **self._evidence(0, loss.size - 1, collapse=False),
                )
            ]
        return []

    def _transient(self, at: np.ndarray, above: np.ndarray, skip: Finding | None) -> list[Finding]:
        """The first stretch at chance the run later leaves: after it had left chance, or at the start of a
        pretrained language model's fine-tune."""
        steps, loss = self._ctx["steps"], self._ctx["loss"]
        overlap = (skip.evidence["first_step"], skip.evidence["last_step"]) if skip else None
        for s, n in _runs(at):
            if s + n == loss.size:
                continue  # through the end: `_stuck`'s
            if overlap and steps[s] <= overlap[1] and steps[s + n - 1] >= overlap[0]:
                continue  # the same stretch, above chance: `_destroyed`'s
            e = s + n - 1
            if s > 0:
                return [
                    self.finding(
                        "back-to-chance",
                        "warn",
                        f"loss went back to chance at steps {steps[s]}-{steps[e]} ({n} logged steps, {loss[s : e + 1].min():.4g} "
                        f".. {loss[s : e + 1].max():.4g} against {self._name()}) after reaching {loss[:s].min():.4g}, then "
                        f"left it: the model lost what it had learned for that stretch; check the gradient norm and the "
                        f"learning rate there, and prefer a checkpoint from before step {steps[s]}",
                        step=steps[s],
                        value=loss[s],
                        **self._evidence(s, e, collapse=False),
                    )
                ]
            if self._ctx["pretrained"] and not self._ctx["chance"]["head"] and not above[s : e + 1].any():
                return [
                    self.finding(
                        "chance-at-start",
                        "warn",
                        f"loss is at chance for the first {n} logged step(s) (steps {steps[s]}-{steps[e]}: "
                        f"{', '.join(f'{v:.4g}' for v in loss[s : e + 1][:5])} against {self._name()}) although the run "
                        f"fine-tunes a pretrained model ({self._ctx['pretrained']}): a pretrained model starts far below "
                        f"chance; its weights did not load (a re-initialised or resized embedding or head), or labels "
                        f"and logits are misaligned; check how the model and the labels were built",
                        step=steps[s],
                        value=loss[s],
                        **self._evidence(s, e, collapse=False),
                    )
                ]
        return []

    def _destroyed(self, above: np.ndarray) -> Finding | None:
        """Above chance for 2 logged steps in a row after a step at or below chance: an update destroyed the model."""
        steps, loss = self._ctx["steps"], self._ctx["loss"]
        for s, n in _runs(above):
            if s > 0 and n >= 2:
                e = s + n - 1
                return self.finding(
                    "destroyed",
                    "fail",
                    f"loss went above chance at step {steps[s]} ({loss[s]:.4g}, {loss[s] / loss[s - 1]:.3g}x the "
                    f"{loss[s - 1]:.4g} before it) and stayed above {self._name()} for {n} logged steps: an update "
                    f"destroyed what the model knew (its predictions became worse than a uniform guess); lower the "
                    f"learning rate and resume from a checkpoint before step {steps[s]}",
                    step=steps[s],
                    value=loss[s],
                    loss_before=loss[s - 1],
                    **self._evidence(s, e, collapse=False),
                )
        return None

    def _above(self, above: np.ndarray) -> list[Finding]:
        steps, loss = self._ctx["steps"], self._ctx["loss"]
        rows = np.flatnonzero(above)
        if not rows.size:
            return []
        i = int(rows[0])
        return [
            self.finding(
                "above-chance",
                "warn",
                f"loss {loss[i]:.4g} at step {steps[i]} is above chance ({self._name()}; {rows.size} logged step(s) "
                f"above it, then {loss[-1]:.4g} at the end): the model was confidently wrong there; check the weights "
                f"loaded at start (a resized or re-initialised embedding or head) and the label alignment",
                step=steps[i],
                value=loss[i],
                last_loss=loss[-1],
                steps_above=int(rows.size),
                **self._evidence(i, i, collapse=False),
            )
        ]

    def _unigram_start(self, at: np.ndarray, above: np.ndarray) -> list[Finding]:
        """A pretrained language model whose first logged loss is above what token frequencies alone score."""
        steps, loss, chance = self._ctx["steps"], self._ctx["loss"], self._ctx["chance"]
        share = self.params["unigram_share"]
        if chance["head"] or not self._ctx["pretrained"] or at[0] or above[0] or loss[0] < share * chance["chance"]:
            return []
        return [
            self.finding(
                "above-unigram",
                "warn",
                f"the first logged loss ({loss[0]:.4g} at step {steps[0]}) is {loss[0] / chance['chance']:.0%} of "
                f"chance ({self._name()}), above what a model knowing only token frequencies scores (about 70%), although "
                f"the run fine-tunes a pretrained model ({self._ctx['pretrained']}); then {loss[-1]:.4g} at the end: "
                f"check the labels (pad or prompt tokens trained, labels shifted), the tokenizer and the weights loaded",
                step=steps[0],
                value=loss[0],
                share_of_chance=float(loss[0] / chance["chance"]),
                **self._evidence(0, 0, collapse=False, unigram_share=share),
            )
        ]
