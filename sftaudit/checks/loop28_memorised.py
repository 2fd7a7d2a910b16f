"""LOOP-28 memorised training set: with too few evaluations, a later epoch's loss far below the first pass's."""

from __future__ import annotations

import numpy as np

from .base import AuditContext, CannotJudge, Check, Finding, at_least
from .selection_metric import MIN_BAND_EVALS
from .stats.rolling import column, loss_family, step_frame


class MemorisedTrainingSet(Check):
    """Memorised training set (trigger point: every epoch).

    What it detects:
        A run of several epochs with no evaluation (or too few to judge) whose training loss in a later epoch
        is a small fraction of what the model scored on the same data the first time it saw it (1.45 over the
        second half of epoch 1, 0.09 in epoch 9 of a LoRA chat fine-tune; 2.08 then 0.07 in epoch 24 of a QLoRA
        run at a constant LR; 0.47 in epoch 17, the earliest logged, then 0.026 in epoch 33 of a GPT-2 run of 100
        epochs over 31 samples).
    Why it matters:
        In the first epoch every sample is trained on the first time the model sees it, so the loss logged there
        is a loss on unseen data: the only held-out measure a run without evaluations has. Later epochs revisit
        the same samples; a loss far below the first pass's is the gap between data seen and unseen, which is
        what memorising the training set looks like (a reproduced answer scores near 0, a new question does
        not). The training curve looks healthy and nothing says the model still generalises.
    Statistic:
        The first-pass loss: the median of the training losses logged in the second half of epoch 1 (epoch 0.5
        to 1.0; the first half still falls from the pretrained model's level, which would inflate it). Where
        nothing was logged there (a logging interval longer than an epoch), the earliest later epoch's median
        stands in for it: the loss falls as epochs pass, so the first pass scored no less, and a later epoch far
        below it is at least as far below the first pass. Each later epoch's loss: the median of the losses
        logged in it (epoch e belongs to epoch ceil(e)). Their ratio.
    Threshold:
        The first later epoch whose loss is at most 1/`factor` (10) of the first pass's: warn at its first logged
        step (the checkpoints before it are the ones to keep). A healthy multi-epoch fine-tune's later epochs
        sit lower by a factor of 1.2-4 (each revisit is easier); a tenth is the model reproducing what it saw.
        With fewer evaluations than LOOP-26 needs, a last eval_loss at most 1/`factor` of the first pass's is
        said too (an eval set as memorised as the training set is no held-out measure).
        Not judged: a run that logged enough evaluations for LOOP-26 to judge over-fitting on (6), or whose eval
        set the shim generated on (LOOP-08 judges it), under two epochs, a training loss logged in only one
        epoch after the first and none in the second half of the first, preference and policy-gradient losses
        (not a fit to the data), or a log without epochs.
    Evidence:
        The first-pass loss and its windows, each epoch's median loss and ratio, the epoch and step judged.
    """

    code = "LOOP-28"
    name = "memorised training set"
    rules = {
        "memorised": "with too few evaluations to judge, a later epoch's loss is a small fraction of the first pass's",
    }
    needs = ("steps", "metrics")
    defaults = {"factor": at_least(10.0, 1)}

    def run(self, ctx: AuditContext) -> list[Finding]:
        family, keys = loss_family(ctx)
        if family != "sft":
            raise CannotJudge(f"a {family} loss (logged {', '.join(keys[:3])}) is not a fit to the data")
        evaluations = ctx.frame(
            "SELECT step, any_value(value) FILTER (WHERE name = 'eval_loss' AND isfinite(value)) AS eval_loss "
            "FROM metrics WHERE rank = 0 AND name LIKE 'eval\\_%' ESCAPE '\\' GROUP BY step ORDER BY step"
        )
        if evaluations.height >= MIN_BAND_EVALS or ctx.has_rows("evals"):  # the shim's eval-set generations
            raise CannotJudge("the run logged evaluations: over-fitting is judged on them (LOOP-26, LOOP-08)")
        frame = step_frame(ctx, "loss")
        epochs = ctx.frame(
            "SELECT step, avg(value) AS epoch FROM metrics WHERE rank = 0 AND name = 'epoch' "
            "AND isfinite(value) GROUP BY step"
        )
        if epochs.height == 0:
            raise CannotJudge("no epoch logged: the first pass over the data cannot be told")
        joined = frame.join(epochs, on="step", how="inner").sort("step")  # a join keeps no order
        steps, loss, epoch = joined["step"].to_numpy(), column(joined, "loss"), column(joined, "epoch")
        keep = np.isfinite(loss) & (loss > 0)
        steps, loss, epoch = steps[keep], loss[keep], epoch[keep]
        if not epoch.size or epoch.max() <= 1.0:
            raise CannotJudge(f"{epoch.max() if epoch.size else 0:.2f} epoch(s) logged: a later epoch is needed")
        index = np.ceil(epoch - 1e-9).astype(int)  # the epoch each log belongs to
        first_pass = (epoch > 0.5) & (epoch <= 1.0)
        if first_pass.any():
            reference_epoch, reference_text = 1, "over the second half of epoch 1"
        else:  # the first pass unlogged: the earliest later epoch logged scored no more than it did (the loss falls)
            reference_epoch = int(index[index >= 2].min())
            first_pass = index == reference_epoch
            reference_text = (
                f"in epoch {reference_epoch}, the earliest logged after the first: the first pass, not logged, "
                "scored no less"
            )
        reference = float(np.median(loss[first_pass]))
        later = np.unique(index[index > reference_epoch])
        if not later.size:
            raise CannotJudge(f"only epoch {reference_epoch} logged a training loss: a later epoch is needed")
        medians = np.array([np.median(loss[index == e]) for e in later])  # one per epoch: a handful
        ratios = medians / reference
        below = np.flatnonzero(ratios <= 1.0 / self.params["factor"])
        if not below.size:
            return []
        e = int(later[below[0]])
        evaluations_said = _evaluations_text(evaluations, reference, self.params["factor"])
        row = int(np.flatnonzero(index == e)[0])
        return [
            self.finding(
                "memorised",
                "warn",
                f"epoch {e}'s training loss ({medians[below[0]]:.4g}, the median of its logged losses from step "
                f"{steps[row]}) is {1 / ratios[below[0]]:.0f}x below what the model scored on the same data the first "
                f"time it saw it ({reference:.4g} {reference_text}), and {evaluations_said}: "
                f"the model is reproducing its training set, and nothing shows it still generalises; evaluate the "
                f"checkpoints from before epoch {e} on held-out data and keep the best, and train fewer epochs (or on "
                f"more data) next time",
                step=steps[row],
                value=float(medians[below[0]]),
                first_pass_loss=reference,
                first_pass_windows=int(first_pass.sum()),
                first_pass_epoch=reference_epoch,
                epoch=e,
                epoch_losses=dict(zip(map(str, later.tolist()), np.round(medians, 6).tolist())),
                ratio=float(ratios[below[0]]),
                threshold=self.params["factor"],
            )
        ]


def _evaluations_text(evaluations, first_pass_loss: float, factor: float) -> str:
    """What the run's few evaluations (fewer than an over-fitting judgement needs) add to the finding."""
    if evaluations.height == 0:
        return "the run logged no evaluation"
    losses = evaluations["eval_loss"].drop_nulls()
    said = f"its {evaluations.height} evaluation(s) are too few to show over-fitting"
    if losses.len() and losses[-1] <= first_pass_loss / factor:  # as low as the memorised training loss
        return (
            f"{said}; the last eval_loss ({losses[-1]:.4g}) is as low as the training loss: the eval set is no "
            f"held-out measure (it overlaps the training data, or is as easy)"
        )
    return said
