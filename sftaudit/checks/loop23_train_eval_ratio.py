"""LOOP-23 training loss far above the eval loss: a ratio no over-fitting explains."""

from __future__ import annotations

import numpy as np

from .base import AuditContext, CannotJudge, Check, Finding, at_least
from .stats.rolling import column, run_config, step_frame


class TrainEvalRatio(Check):
    """Train/eval loss ratio (trigger point: every evaluation).

    What it detects:
        A logged training loss many times the eval loss measured at the same point of the run (train 16-18x
        eval, a first logged loss of 285 beside an eval loss of 15).
    Why it matters:
        Over-fitting makes the training loss the lower one; dropout, label smoothing or a harder training mix
        make it higher by a modest factor. Several times higher, steadily, means the two numbers are not the
        same quantity: the logged training loss is scaled (multiplied by the gradient-accumulation steps, as
        some transformers 4.46-4.47 releases logged it for models whose forward takes no `**kwargs`; summed
        instead of averaged), or the eval computes a different objective. Every loss-based judgement of the run,
        and its learning-rate tuning, then rests on a wrong number.
    Statistic:
        At each eval step, the training loss logged in the same logging window (the last training log at or
        before the eval, within one eval interval) over the eval loss. The run's ratio is the median over the
        later half of its evaluations (the early ones compare a window mean with a model that has moved on).
    Threshold:
        Median ratio >= `max_ratio` (3): warn, once for the run (a number that is wrong, not a step that
        went wrong). Fewer than 2 evaluations with a training loss beside them: not judged.
    Evidence:
        The eval steps, training and eval losses, the ratios, the gradient-accumulation steps when known.
    """

    code = "LOOP-23"
    name = "train/eval loss ratio"
    rules = {
        "train-above-eval": "the training loss is far above the eval loss",
    }
    needs = ("steps", "metrics")
    defaults = {"max_ratio": at_least(3.0, 1)}

    def run(self, ctx: AuditContext) -> list[Finding]:
        evals = ctx.frame(
            "SELECT step, avg(value) AS eval_loss FROM metrics WHERE rank = 0 AND name = 'eval_loss' "
            "AND isfinite(value) AND value > 0 GROUP BY step ORDER BY step"
        )
        if evals.height < 2:
            raise CannotJudge(f"{evals.height} evaluation(s) with a positive eval_loss: a ratio needs 2")
        frame = step_frame(ctx, "loss")
        steps, loss = frame["step"].to_numpy(), column(frame, "loss")
        keep = np.isfinite(loss)
        steps, loss = steps[keep], loss[keep]
        eval_steps, eval_loss = evals["step"].to_numpy(), evals["eval_loss"].to_numpy().astype(float)
        gap = np.diff(eval_steps).min() if eval_steps.size > 1 else 0
        # The last training log at or before each eval, if it is within one eval interval of it.
        i = np.searchsorted(steps, eval_steps, side="right") - 1
        paired = (i >= 0) & (eval_steps - steps[np.clip(i, 0, None)] <= max(gap, 1))
        if paired.sum() < 2:
            raise CannotJudge("fewer than 2 evaluations have a training loss logged beside them")
        at, train, ev = eval_steps[paired], loss[i[paired]], eval_loss[paired]
        ratio = train / ev
        late = ratio[ratio.size // 2 :]
        median = float(np.median(late))
        if median < self.params["max_ratio"]:
            return []
        accumulation = run_config(ctx.manifest).get("gradient_accumulation_steps")
        return [
            self.finding(
                "train-above-eval",
                "warn",
                f"the logged training loss is {median:.1f}x the eval loss over the later evaluations (e.g. {train[-1]:.4g} "
                f"against {ev[-1]:.4g} at step {at[-1]}); no over-fitting makes training loss the higher one by that much: "
                f"check whether the logged training loss is scaled (multiplied by the gradient-accumulation steps, as "
                f"some transformers 4.46-4.47 releases logged it for models whose forward takes no **kwargs) or the eval "
                f"computes a different objective, before trusting either number",
                category="risk",
                value=median,
                threshold=self.params["max_ratio"],
                eval_steps=at.tolist()[:50],
                train_loss=train.tolist()[:50],
                eval_loss=ev.tolist()[:50],
                ratios=ratio.tolist()[:50],
                gradient_accumulation_steps=accumulation,
            )
        ]
