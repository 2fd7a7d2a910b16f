"""LOOP-19 loss divergence: a sustained rise of the logged loss."""

from __future__ import annotations

import numpy as np

from .base import AuditContext, CannotJudge, Check, Finding, count, positive
from .stats.rolling import (
    MAD_TO_SIGMA,
    adaptive_window,
    column,
    loss_excursions,
    loss_family,
    nonfinite_logged,
    skipped_updates,
    step_frame,
    warmup_end,
)


class LossDivergence(Check):
    """Loss divergence (trigger point: every logged step).

    What it detects:
        A loss that rose and stayed up: above its own running level for `diverge_steps` logged steps in a row
        (or through the end of the run), or above the run's own start through the end of the run (a QLoRA run
        at learning rate 5 whose loss goes 1.64 -> 11.8 at step 2 and sticks; a loss climbing 1.0 -> 29.6).
    Why it matters:
        Fine-tuning lowers the loss on its own data from the first step; a loss that ends above where the run
        started made the model worse at everything the run exists to teach, and every step after the rise is
        wasted. The usual cause is a learning rate too high for the optimizer (or a jump in it).
    Statistic:
        On log(loss): each logged value's residual from the median of the 5 values before it, judged against
        the robust sigma (1.4826 MAD) of those residuals over the run's previous 4 blocks (the run's own
        step-to-step noise at its logging resolution; blocks of run length / 16, 8..128 logged steps), floored
        at one rounding step of the log at that level, with the run's upper-tail factor (see LOOP-10). Against
        the start: log(loss) - log(first logged loss) over the run's noise from second differences of log loss
        (1.4826 MAD / sqrt 6: a smooth trend, even a steep climb, leaves them out), floored likewise.
    Threshold:
        Running level: z >= `sigma` (6) x tail factor for `diverge_steps` (5) logged steps, or through the end
        (2 at least): fail. Start: every logged loss from some step through the end above the first logged one
        by `sigma` x tail factor x noise, over at least min(`diverge_steps`, half the logged steps): fail.
        Fewer than 3 finite logged losses, or a policy-gradient loss (GRPO/PPO, named from the log's keys):
        not judged.
    Evidence:
        The first elevated step, its loss, the level or start it rose from, z, how many logged steps it stayed
        up, the peak learning rate, the loss family.
    """

    code = "LOOP-19"
    name = "loss divergence"
    needs = ("steps",)
    defaults = {"sigma": positive(6.0), "diverge_steps": count(5), "window": count(None, low=2)}

    def run(self, ctx: AuditContext) -> list[Finding]:
        from scipy import stats  # here, not at module level: preflight and --help import every check and need no scipy

        frame = step_frame(ctx, "loss", "lr")
        loss = column(frame, "loss")
        finite = np.isfinite(loss)
        if finite.sum() < 3:
            raise CannotJudge(f"{int(finite.sum())} finite logged loss value(s): too few to tell a rise from noise")
        family, _ = loss_family(ctx)
        if family == "rl":
            raise CannotJudge(
                "a policy-gradient loss (GRPO/PPO, named from the logged kl/reward keys) is no fit of "
                "the data: its level does not say whether training diverged"
            )
        steps = frame["step"].to_numpy()
        lr = column(frame, "lr")
        _, _, bad_norm, has_norm = nonfinite_logged(ctx)
        first = warmup_end(np.nan_to_num(lr), skipped_updates(bad_norm, has_norm))
        window = self.params["window"] or adaptive_window(steps.size)
        found = loss_excursions(loss, window, first, self.params["sigma"], self.params["diverge_steps"])
        peak_lr = float(np.nanmax(lr)) if np.isfinite(lr).any() else None
        advice = f"lower the learning rate (peak {peak_lr:.3g})" if peak_lr else "lower the learning rate"
        episode = next(((s, n) for s, n, sustained in found["episodes"] if sustained), None)
        start = self._against_start(loss, found)
        if start is not None and (episode is None or start <= episode[0]):
            i = start
            rise = int(finite[i:].sum())
            z = float(self._start_z(loss, found)[i])
            return [
                self.finding(
                    "fail",
                    f"loss diverged from step {steps[i]}: {loss[i]:.4g} against {loss[0]:.4g} at the start of the run, and it "
                    f"stayed above the start through the end ({rise} logged steps, last {loss[finite][-1]:.4g}); the run "
                    f"made the model worse on its own data: {advice} and restart, or resume from a checkpoint before step "
                    f"{steps[i]}",
                    step=steps[i],
                    value=loss[i],
                    start_loss=loss[0],
                    last_loss=float(loss[finite][-1]),
                    steps_up=rise,
                    z=z,
                    p_value=float(stats.norm.sf(z)),
                    threshold=found["threshold"],
                    peak_lr=peak_lr,
                    family=family,
                )
            ]
        if episode is None:
            return []
        s, n = episode
        level = float(np.exp(found["level"][s]))
        return [
            self.finding(
                "fail",
                f"loss diverged at step {steps[s]} ({loss[s]:.3g} against a running level of {level:.3g}) and stayed up for "
                f"{n} logged step(s); resume from a checkpoint before step {steps[s]} and {advice}",
                step=steps[s],
                value=loss[s],
                baseline_median=level,
                z=found["z"][s],
                p_value=float(stats.norm.sf(found["z"][s])),
                effect_size=loss[s] / level,
                threshold=found["threshold"],
                steps_up=n,
                spike_steps=steps[s : s + n].tolist()[:50],
                peak_lr=peak_lr,
                family=family,
            )
        ]

    def _start_z(self, loss, found) -> np.ndarray:
        """Each logged loss's rise over the first one, in units of the run's own noise: from second differences of
        log loss (1.4826 MAD / sqrt 6), which a smooth trend, even a steep climb, leaves out."""
        x = found["x"]
        d2 = np.diff(x[np.isfinite(x)], 2)
        noise = MAD_TO_SIGMA * float(np.median(np.abs(d2 - np.median(d2)))) / np.sqrt(6) if d2.size else 0.0
        quantum = np.log1p(found["quantum"] / loss[0]) if found["quantum"] and loss[0] > 0 else 0.0
        scale = max(noise, quantum)
        with np.errstate(invalid="ignore", divide="ignore"):
            return (x - x[0]) / scale if scale > 0 else np.where(x > x[0], np.inf, 0.0)

    def _against_start(self, loss, found) -> int | None:
        """The first row from which every finite logged loss stays above the start by the threshold (None: none)."""
        if not np.isfinite(found["x"][0]):
            return None
        z = self._start_z(loss, found)
        finite = np.isfinite(found["x"])
        with np.errstate(invalid="ignore"):
            up = ~finite | (z >= found["threshold"])
        # The rows from which every later row is up: a suffix of `up`.
        suffix = np.flip(np.logical_and.accumulate(np.flip(up)))
        rows = np.flatnonzero(suffix & finite)
        if not rows.size or rows[0] == 0:
            return None
        needed = min(self.params["diverge_steps"], -(-int(finite.sum()) // 2))
        return int(rows[0]) if rows.size >= needed else None
