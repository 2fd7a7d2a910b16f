"""LOOP-28 memorised training set: with no evaluation, a later epoch's loss far below the first pass's."""

from __future__ import annotations

import numpy as np

from .base import AuditContext, CannotJudge, Check, Finding, at_least
from .stats.rolling import column, loss_family, step_frame


class MemorisedTrainingSet(Check):
    """Memorised training set (trigger point: every epoch).

    What it detects:
        A run of several epochs with no evaluation whose training loss in a later epoch is a small fraction of
        what the model scored on the same data the first time it saw it (1.45 over the second half of epoch 1,
        0.09 in epoch 9 of a LoRA chat fine-tune; 2.08 then 0.07 in epoch 24 of a QLoRA run at a constant LR).
    Why it matters:
        In the first epoch every sample is trained on the first time the model sees it, so the loss logged there
        is a loss on unseen data: the only held-out measure a run without evaluations has. Later epochs revisit
        the same samples; a loss far below the first pass's is the gap between data seen and unseen, which is
        what memorising the training set looks like (a reproduced answer scores near 0, a new question does
        not). The training curve looks healthy and nothing says the model still generalises.
    Statistic:
        The first-pass loss: the median of the training losses logged in the second half of epoch 1 (epoch 0.5
        to 1.0; the first half still falls from the pretrained model's level, which would inflate it). Each later
        epoch's loss: the median of the losses logged in it (epoch e belongs to epoch ceil(e)). Their ratio.
    Threshold:
        The first later epoch whose loss is at most 1/`factor` (10) of the first pass's: warn at its first logged
        step (the checkpoints before it are the ones to keep). A healthy multi-epoch fine-tune's later epochs
        sit lower by a factor of 1.2-4 (each revisit is easier); a tenth is the model reproducing what it saw.
        Not judged: a run that logged an evaluation, or whose eval set the shim generated on (over-fitting is
        judged on them: LOOP-26, LOOP-08), under two epochs,
        no training loss logged in the second half of epoch 1, preference and policy-gradient losses (not a fit to
        the data), or a log without epochs.
    Evidence:
        The first-pass loss and its windows, each epoch's median loss and ratio, the epoch and step judged.
    """

    code = "LOOP-28"
    name = "memorised training set"
    rules = {
        "memorised": "with no evaluation, a later epoch's loss is a small fraction of the first pass's",
    }
    needs = ("steps", "metrics")
    defaults = {"factor": at_least(10.0, 1)}

    def run(self, ctx: AuditContext) -> list[Finding]:
        family, keys = loss_family(ctx)
        if family != "sft":
            raise CannotJudge(f"a {family} loss (logged {', '.join(keys[:3])}) is not a fit to the data")
        evaluated = ctx.row("SELECT 1 FROM metrics WHERE rank = 0 AND name LIKE 'eval\\_%' ESCAPE '\\' LIMIT 1")
        if evaluated or ctx.has_rows("evals"):  # the Trainer's evaluations, or the shim's eval-set generations
            raise CannotJudge("the run logged evaluations: over-fitting is judged on them (LOOP-26, LOOP-08)")
        frame = step_frame(ctx, "loss")
        epochs = ctx.frame(
            "SELECT step, avg(value) AS epoch FROM metrics WHERE rank = 0 AND name = 'epoch' "
            "AND isfinite(value) GROUP BY step"
        )
        if epochs.height == 0:
            raise CannotJudge("no epoch logged: the first pass over the data cannot be told")
        joined = frame.join(epochs, on="step", how="inner")
        steps, loss, epoch = joined["step"].to_numpy(), column(joined, "loss"), column(joined, "epoch")
        keep = np.isfinite(loss) & (loss > 0)
        steps, loss, epoch = steps[keep], loss[keep], epoch[keep]
        if not epoch.size or epoch.max() <= 1.0:
            raise CannotJudge(f"{epoch.max() if epoch.size else 0:.2f} epoch(s) logged: a later epoch is needed")
        first_pass = (epoch > 0.5) & (epoch <= 1.0)
        if not first_pass.any():
            raise CannotJudge("no training loss logged in the second half of epoch 1 (the first pass)")
        reference = float(np.median(loss[first_pass]))
        index = np.ceil(epoch - 1e-9).astype(int)  # the epoch each log belongs to
        later = np.unique(index[index >= 2])
        medians = np.array([np.median(loss[index == e]) for e in later])  # one per epoch: a handful
        ratios = medians / reference
        below = np.flatnonzero(ratios <= 1.0 / self.params["factor"])
        if not below.size:
            return []
        e = int(later[below[0]])
        row = int(np.flatnonzero(index == e)[0])
        return [
            self.finding(
                "memorised",
                "warn",
                f"epoch {e}'s training loss ({medians[below[0]]:.4g}, the median of its logged losses from step "
                f"{steps[row]}) is {1 / ratios[below[0]]:.0f}x below what the model scored on the same data the first "
                f"time it saw it ({reference:.4g} over the second half of epoch 1), and the run logged no evaluation: "
                f"the model is reproducing its training set, and nothing shows it still generalises; evaluate the "
                f"checkpoints from before epoch {e} on held-out data and keep the best, and train fewer epochs (or on "
                f"more data) next time",
                step=steps[row],
                value=float(medians[below[0]]),
                first_pass_loss=reference,
                first_pass_windows=int(first_pass.sum()),
                epoch=e,
                epoch_losses=dict(zip(map(str, later.tolist()), np.round(medians, 6).tolist())),
                ratio=float(ratios[below[0]]),
                threshold=self.params["factor"],
            )
        ]
