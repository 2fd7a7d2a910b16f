"""LOOP-26 eval metrics judged by their direction and by the metric the run selected on."""

from __future__ import annotations

import numpy as np

from .base import AuditContext, CannotJudge, Check, Finding, probability, share
from .selection_metric import (
    BAND_SIGMA,
    ERROR_RATES,
    MIN_BAND_EVALS,
    better,
    chance_accuracy,
    direction,
    eval_series,
    metric_name,
    name_parts,
    noise_band,
    selection_metric,
    worse_than_all_before,
    worse_to_the_end,
)

# Values above this cannot be fractions of 1 for an error rate the run is learning: it is logged in percent.
PERCENT_ABOVE = 1.5
LISTED = 50


def turn(steps: np.ndarray, i: int) -> dict:
    """Where an eval finding stands: the evaluation at `steps[i]` shows what happened after the one before it,
    so the finding's step is the first step after that one, and its resolution the evaluation window."""
    first = int(steps[i - 1]) + 1 if i else 1
    return {
        "step": first,
        "resolution": {"kind": "evaluation window", "first_step": first, "last_step": int(steps[i])},
    }


class EvalSelection(Check):
    """Eval metrics by direction and selection metric (trigger point: every evaluation).

    What it detects:
        The metric the run chose its best checkpoint on (trainer_state.json's best_metric: WER, accuracy, ROUGE;
        eval_loss, the Trainer's default, when it recorded none) worse than its best at every evaluation to the
        end, by more than the eval's own noise: over-fitting, or a jump that then plateaus (WER 17.7 at step 250,
        then 28-31 to the end). The same metric worsening while eval_loss keeps falling; eval_loss rising while the
        selection metric keeps improving (a Whisper run whose WER falls as its loss rises is not over-fitting by
        its own measure), and told apart from it, eval_loss stepping up between two evaluations and staying there
        (the eval set or its scoring changed, or a break the selection metric does not see). A metric at a
        degenerate level to the end: a word or character error rate of 95% or more
        (a WER of 99% while eval_loss falls to 0.0006), a classifier's accuracy at chance (1 / its labels).
    Why it matters:
        The run's own selection metric says which checkpoint to ship; eval_loss alone can point the other way.
        Training past the best evaluation buys nothing and costs the best model when the last checkpoint ships; a
        metric that contradicts the loss, or sits at a degenerate level, means the predictions are decoded or
        scored wrongly (labels, generation config, the tokenizer that decodes them) or the model learned nothing.
    Statistic:
        Per eval key, its direction from its name (loss, WER, CER, perplexity: lower; accuracy, BLEU, ROUGE, F1, exact
        match, chrF: higher) or, for the selection metric, from best_metric against its logged values; keys whose
        direction neither tells are listed, never guessed. The eval's noise: the robust spread (1.4826 MAD) of second
        differences of the metric over sqrt(6) (a smooth trend leaves them out), floored at the log's rounding step; the
        band is 3 standard deviations of the difference of two evaluations (3 x sqrt 2 x that). Worse to the end: the
        best evaluation against every later one. Worse than all before (a jump that stayed, told where the noise it
        keeps hides it from the band): the first evaluation from which every evaluation to the end is worse than every
        one before it; noise without a trend orders its last m of n evaluations so with probability 1 / C(n, m), taken
        over the n - 2 places the series could split (a falling metric makes it rarer still); or, with 3 evaluations or
        more on each side, the mean after over the mean before in units of the eval's noise (that sigma x sqrt(1 /
        before + 1 / after)): a jump early in the run leaves too few evaluations before it for the ranks alone.
    Threshold:
        Selection metric worse than its best by more than the band at every evaluation from some step to the end (2
        evaluations at least): warn. Worse than all before, at (n - 2) / C(n, m) <= `rank_alpha` (0.01; 13 evaluations
        at least, 4 worse at the end of 15) or at a one-sided normal p of the mean's shift <= `rank_alpha` / (n - 2),
        and earlier than the band's turn: warn, in its stead. eval_loss so, while
        the selection metric is not: info; but where eval_loss stepped up by more than the band between two
        evaluations and stayed within the band of that level to the end (a step, not a drift): warn, a risk that
        neither dates the run nor moves the rollback (the selection metric says the model did not get worse).
        An error rate >= `error_rate_level` (95%; read in percent when a value
        exceeds 1.5, not judged when the scale cannot be told) or a classifier's accuracy within max(`chance_margin`
        (5%) of chance, the band) of 1 / its labels, from some evaluation to the end: fail. Each is an anomaly dated
        where the run turned: the evaluation window that ends at the first such evaluation (from the step after the
        evaluation before it). Fewer than 6 evaluations: no band, so over-fitting and contradictions are not judged (the
        check says so); no eval metric: not judged.
    Evidence:
        The metric, its direction and where it came from, the best step and value, the band, the turning step, the
        last value, eval_loss beside it, the evaluations (up to 50), the keys of unknown direction.
    """

    code = "LOOP-26"
    name = "eval metrics and selection"
    rules = {
        "best-before-end": "the selection metric was best mid-run and worse to the end",
        "worse-than-all-before": "every evaluation of the selection metric from some step on was worse than all before",
        "eval-loss-rose": "eval_loss rose while the selection metric did not worsen",
        "eval-loss-jumped": "eval_loss stepped up and stayed while the selection metric did not worsen",
        "metric-degenerate": "an eval metric sits at a degenerate level at the last evaluation",
    }
    needs = ("metrics",)
    defaults = {"error_rate_level": share(0.95), "chance_margin": share(0.05), "rank_alpha": probability(0.01)}

    def run(self, ctx: AuditContext) -> list[Finding]:
        series = eval_series(ctx.con)
        if not series:
            raise CannotJudge("no eval metric was logged")
        chosen = selection_metric(ctx.manifest, set(series))
        metric, way = chosen["metric"], chosen["direction"]
        unknown = sorted(k for k in series if direction(k) is None and not (k == metric and way))
        findings = self._degenerate(ctx, series)
        if metric is None or way is None:
            if findings:
                return findings
            raise CannotJudge(chosen["note"] + self._unknown(unknown))
        steps, values = series[metric]
        band = noise_band(values)
        if band is None:
            if findings:
                return findings
            raise CannotJudge(
                f"{values.size} evaluation(s) of {metric}: too few to tell its noise ({MIN_BAND_EVALS} needed), so "
                f"neither over-fitting nor a contradiction with eval_loss can be told; none is at a degenerate level"
                + self._unknown(unknown)
            )
        best = int(np.argmin(better(values, way)))
        ctx.add_series(
            self.code,
            f"{metric}, the run's selection metric, against its best worsened by the noise band",
            steps.tolist(),
            values.tolist(),
            float(values[best] + band if way == "lower" else values[best] - band),
        )
        context = {
            "metric": metric,
            "direction": way,
            "selected_by": chosen["source"],
            "band": band,
            "band_sigma": BAND_SIGMA,
            "eval_steps": steps.tolist()[-LISTED:],
            "values": values.tolist()[-LISTED:],
            "unknown_direction": unknown,
        }
        turned = worse_to_the_end(values, way, band)
        # A jump in a noisy metric keeps the noise, so not every later evaluation clears the best by the band: the
        # ranks tell it, and tell it at the jump where the band may clear only the last evaluations.
        separated = worse_than_all_before(values, way, self.params["rank_alpha"])
        if separated is not None and (turned is None or separated < turned[1]):
            return findings + [self._separated(steps, values, way, separated, context)]
        if turned is not None:
            return findings + [self._worse(series, metric, way, steps, values, band, turned, context)]
        if metric != "eval_loss" and "eval_loss" in series:
            return findings + self._loss_disagrees(series, metric, steps, values, best, context)
        return findings

    def _worse(self, series, metric, way, steps, values, band, turned, context) -> Finding:
        b, t = turned
        x = better(values, way)
        jumped = x[t] - x[t - 1] > band and abs(x[-1] - x[t]) <= band
        shape = (
            f"jumped to {values[t]:.4g} at step {steps[t]} and stayed there"
            if jumped
            else f"was worse from step {steps[t]} on"
        )
        loss = self._loss_over(series, steps[b], steps[-1]) if metric != "eval_loss" else None
        contradiction = ""
        if loss is not None and loss["improved"]:
            contradiction = (
                f", while eval_loss kept falling ({loss['at_best']:.4g} -> {loss['last']:.4g}): the loss no longer "
                f"measures what the run is judged on; check how predictions are decoded and scored (generation "
                f"config, the tokenizer that decodes them, labels with -100 replaced) as well"
            )
        return self.finding(
            "best-before-end",
            "warn",
            f"{metric} was best at step {steps[b]} ({values[b]:.4g}) and {shape}: every evaluation to the end is worse "
            f"by more than its noise band ({band:.3g}; last {values[-1]:.4g}){contradiction}; ship the checkpoint "
            f"nearest its best (the verdict's keep_checkpoint), not the last, and stop earlier or regularise",
            **turn(steps, t),
            best_step=steps[b],
            best_value=values[b],
            value=values[-1],
            turned_step=steps[t],
            shape="jump" if jumped else "drift",
            threshold=band,
            eval_loss=loss,
            **context,
        )

    def _separated(self, steps, values, way, t, context) -> Finding:
        x = better(values, way)
        b = int(np.argmin(x[:t]))
        return self.finding(
            "worse-than-all-before",
            "warn",
            f"{context['metric']} turned worse at step {steps[t]} ({values[t]:.4g}) and stayed there: every one of the "
            f"{values.size - t} evaluations from it to the end is worse than every one of the {t} before it (best "
            f"{values[b]:.4g} at step {steps[b]}, last {values[-1]:.4g}; noise would separate them so, by their order or "
            f"by how far apart they are, with probability <= {self.params['rank_alpha']:g}); ship the checkpoint nearest its best (the verdict's keep_checkpoint), "
            f"not the last, and look at what changed at step {steps[t]} (data, learning rate, a resume)",
            **turn(steps, t),
            best_step=steps[b],
            best_value=values[b],
            value=values[-1],
            turned_step=steps[t],
            worst_before=float(values[int(np.argmax(x[:t]))]),
            best_after=float(values[t + int(np.argmin(x[t:]))]),
            threshold=self.params["rank_alpha"],
            **context,
        )

    def _loss_disagrees(self, series, metric, steps, values, best, context) -> list[Finding]:
        loss_steps, loss = series["eval_loss"]
        band = noise_band(loss)
        turned = worse_to_the_end(loss, "lower", band) if band is not None else None
        if turned is None:
            return []
        b, t = turned
        if loss[t] - loss[t - 1] > band and abs(loss[-1] - loss[t]) <= band:
            return [self._loss_jumped(loss_steps, loss, band, metric, steps, values, best, context, t)]
        return [
            self.finding(
                "eval-loss-rose",
                "info",
                f"eval_loss rose from its best {loss[b]:.4g} at step {loss_steps[b]} (worse by more than its noise band "
                f"from step {loss_steps[t]}; last {loss[-1]:.4g}) while {metric}, the metric the run selects checkpoints "
                f"on, did not worsen (best {values[best]:.4g} at step {steps[best]}): not over-fitting by the run's own "
                f"measure (a speech or seq2seq model's loss often rises as it grows over-confident while its error rate "
                f"keeps falling); judge checkpoints on {metric}",
                **turn(loss_steps, t),
                eval_loss_best_step=loss_steps[b],
                eval_loss_best=loss[b],
                eval_loss_last=loss[-1],
                eval_loss_band=band,
                best_step=steps[best],
                best_value=values[best],
                **context,
            )
        ]

    def _loss_jumped(self, loss_steps, loss, band, metric, steps, values, best, context, t) -> Finding:
        """eval_loss stepped up between two evaluations and stayed, the selection metric unharmed: a risk to look
        at, not over-fitting by the run's measure (it neither dates the run nor moves the rollback)."""
        return self.finding(
            "eval-loss-jumped",
            "warn",
            f"eval_loss jumped from {loss[t - 1]:.4g} to {loss[t]:.4g} between the evaluations at steps "
            f"{loss_steps[t - 1]} and {loss_steps[t]} (more than its noise band, {band:.3g}) and stayed there (last "
            f"{loss[-1]:.4g}), while {metric}, the metric the run selects checkpoints on, did not worsen (best "
            f"{values[best]:.4g} at step {steps[best]}): a step, not a drift, so look at what changed at step "
            f"{loss_steps[t]}: the eval set or how it is scored (a resume with other arguments, the eval batch or "
            f"padding, labels), or a break that {metric} does not measure; checkpoints stay judged on {metric}",
            **turn(loss_steps, t),
            category="risk",
            eval_loss_before=loss[t - 1],
            eval_loss_jumped_to=loss[t],
            eval_loss_last=loss[-1],
            eval_loss_band=band,
            best_step=steps[best],
            best_value=values[best],
            **context,
        )

    @staticmethod
    def _loss_over(series, first: int, last: int) -> dict | None:
        """eval_loss at step `first` and at the end (`last`), and whether it fell by more than its noise band
        (None: too few evaluations to tell its noise)."""
        if "eval_loss" not in series:
            return None
        steps, loss = series["eval_loss"]
        at = np.flatnonzero(steps == first)
        if not at.size or steps[-1] < last:
            return None
        start, band = float(loss[at[0]]), noise_band(loss)
        improved = None if band is None else bool(start - loss[-1] > band)
        return {"at_best": start, "last": float(loss[-1]), "band": band, "improved": improved}

    def _degenerate(self, ctx: AuditContext, series) -> list[Finding]:
        """Error rates at >= 95% and classifier accuracies at chance, from some evaluation to the end."""
        chance = chance_accuracy(ctx.manifest)
        out = []
        for key, (steps, values) in series.items():
            if set(name_parts(key)) & ERROR_RATES and direction(key) == "lower":
                if values.max() <= PERCENT_ABOVE:
                    continue  # a fraction or a percent below 1.5: the scale cannot be told, the level is not judged
                level = 100 * self.params["error_rate_level"]
                bad = values >= level
                what = (
                    f"at or above {level:.0f}%: the model gets almost every word wrong; check how predictions "
                    f"and labels are decoded (the tokenizer, -100 replaced by the pad id, language and task tokens, "
                    f"generation length) before training further"
                )
            elif metric_name(key) in ("accuracy", "acc") and chance is not None:
                scale = 100 if values.max() > PERCENT_ABOVE else 1
                level = scale * max(chance * (1 + self.params["chance_margin"]), chance + (noise_band(values) or 0))
                bad = values <= level
                what = (
                    f"at chance (1/{round(1 / chance)} = {scale * chance:.3g}): the classifier does no better than a "
                    f"guess; check that the labels reach the head (label column, num_labels) and the learning rate"
                )
            else:
                continue
            stretch = int(np.flip(np.logical_and.accumulate(np.flip(bad))).sum())
            if not stretch:
                continue
            i = values.size - stretch
            loss = self._loss_over(series, steps[i], steps[-1]) if key != "eval_loss" else None
            # A fact, judged or not: a loss that fell while the metric sat at a degenerate level does not see it.
            falling = (
                f"; eval_loss fell meanwhile ({loss['at_best']:.4g} -> {loss['last']:.4g}), so the loss does not see it"
                if loss and loss["last"] < loss["at_best"] and loss["improved"] is not False
                else ""
            )
            out.append(
                self.finding(
                    "metric-degenerate",
                    "fail",
                    f"{key} is {values[-1]:.4g} at the last evaluation, {what}; it has been there since step {steps[i]}"
                    f"{falling}",
                    **turn(steps, i),
                    metric=key,
                    value=values[-1],
                    threshold=level,
                    evaluations_at_level=stretch,
                    eval_loss=loss,
                    eval_steps=steps.tolist()[-LISTED:],
                    values=values.tolist()[-LISTED:],
                )
            )
        return out

    @staticmethod
    def _unknown(unknown: list[str]) -> str:
        return f" (direction not told by the name, not guessed: {', '.join(unknown[:10])})" if unknown else ""
