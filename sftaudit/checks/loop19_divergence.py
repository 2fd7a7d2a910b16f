"""LOOP-19 loss divergence: a sustained rise of the logged loss, and a slower climb from its best level."""

from __future__ import annotations

import numpy as np

from .base import AuditContext, CannotJudge, Check, Finding, at_least, count, positive
from .carried_curve import carried_curve, carried_excursions
from .stats.curve import LEVEL_POINTS, rise_from_minimum, rising_trend, rows_above
from .stats.rolling import MAD_TO_SIGMA, column, loss_family, normal_sf, step_frame


class LossDivergence(Check):
    """Loss divergence (trigger point: every logged step).

    What it detects:
        A loss that rose and stayed up: above its own running level for `diverge_steps` logged steps in a row
        (or through the end of the run), or above the run's own start through the end of the run (a QLoRA run
        at learning rate 5 whose loss goes 1.64 -> 11.8 at step 2 and sticks; a loss climbing 1.0 -> 29.6; a x3
        jump that takes five logged steps to come back down). And a slower climb from the loss's best level: a
        loss that creeps up for epochs after its minimum while the learning rate decays (0.0018 -> 0.032), or
        that rises while the learning rate warms up (0.12 -> 0.31).
    Why it matters:
        Fine-tuning lowers the loss on its own data from the first step; a loss that ends above where the run
        started made the model worse at everything the run exists to teach, and every step after the rise is
        wasted. The usual cause is a learning rate too high for the optimizer (or a jump in it). A training loss
        that climbs from its minimum is no over-fitting (that lowers the training loss): the optimizer is
        leaving the minimum it found (a learning rate too high as it warms up, fp16 overflow, a later part of
        the data that is broken).
    Statistic:
        On log(loss): each logged value's residual from the median of the 5 values before it, judged against the
        run's own noise where the value lies (the robust sigma of second differences of log loss, pooled over
        at least 32 logged values, available from the first step), floored at one rounding step of the log,
        with the run's upper-tail factor (see LOOP-10); one-sided. Against the start: log(loss) - log(first
        logged loss) over the run's noise from second differences of log loss (1.4826 MAD / sqrt 6: a smooth
        trend, even a steep climb, leaves them out), floored likewise. Climb: the centred running median of log
        loss over run length / 10 logged values against its own running minimum, in units of that median's
        noise (the run's noise x sqrt(pi / (2 x the values in it))). Trend: from that median's minimum to the
        end, the one-sided Mann-Kendall z of log loss (ranks: no model of the noise, so a noisy low loss or heavy
        tails do not widen it) and the rise of its Theil-Sen slope (the median pairwise slope) over the stretch.
    Threshold:
        Running level: z >= `sigma` (6) x tail factor and >= `min_effect` (1.2) x the level, for
        `diverge_steps` (5) logged steps, or through the end (2 at least), staying above the highest running
        level of the 5 logged steps before (the loss coming back from a dip it fell into is no rise): fail. Start: every logged loss from
        some step through the end above the first logged one by `sigma` x tail factor x noise, over at least
        min(`diverge_steps`, half the logged steps): fail. Climb: the running median >= `rise_factor` (1.3) x
        its minimum and >= `rise_sigmas` (8) x its own noise above it: warn (a fail when it ends above
        the start, by the start rule), at the first logged step over that bar, naming the learning rate's
        course over the climb. Trend: z >= `trend_sigmas` (4, one test a run) and a rise >= `rise_factor` (a
        multi-epoch loss drifting up a few percent within its last epoch is a trend, not a climb): warn, in the
        climb's stead when it is dated no later, and beside the start rule's fail when dated before it (a creep
        crosses its start late), at the first logged step from which the median of its last run length / 40
        values stays 3 of its own sigmas above the minimum to the end (the climb under way: a trailing median,
        never ahead of the climb), naming the learning rate's course to the end. Fewer than 3 finite logged
        losses (8 for a climb, 10 from the minimum for a trend), or a policy-gradient loss (GRPO/PPO, named from
        the log's keys): not judged.
    Evidence:
        The first elevated step, its loss, the level or start it rose from, z, how many logged steps it stayed
        up, the peak learning rate, the loss family; for a climb the minimum, its step, the peak and the end
        level, the learning rate at each; for a trend its z, rise and the values tested.
    """

    code = "LOOP-19"
    name = "loss divergence"
    rules = {
        "worse-than-start": "the loss rose above its start and stayed there through the end",
        "diverged": "the loss diverged from its running level and stayed up",
        "climb": "the loss climbed from its best level (a creep while the LR decays, a rise with the LR warm-up)",
        "trend": "the loss trended up from its best level to the end, against the ranks of its own values",
    }
    needs = ("steps",)
    defaults = {
        "sigma": positive(6.0),
        "diverge_steps": count(5),
        "min_effect": at_least(1.2, 1),
        "rise_factor": at_least(1.3, 1),
        "rise_sigmas": positive(8.0),
        "trend_sigmas": positive(4.0),
    }

    def run(self, ctx: AuditContext) -> list[Finding]:
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
        p = self.params
        found = carried_excursions(ctx, "loss", loss, p["sigma"], p["diverge_steps"], p["min_effect"])
        peak_lr = float(np.nanmax(lr)) if np.isfinite(lr).any() else None
        advice = f"lower the learning rate (peak {peak_lr:.3g})" if peak_lr else "lower the learning rate"
        episode = next(self._sustained_past_dips(found), None)
        start = self._against_start(loss, found)
        if start is not None and (episode is None or start <= episode[0]):
            worse = self._from_start(steps, loss, finite, start, found, advice, peak_lr, family)
            # A creep that ends above the start crosses it late; its trend dates the climb where it got under way.
            trend = rising_trend(
                loss, p["rise_factor"], p["trend_sigmas"], noise=carried_curve(ctx, "loss", loss).noise
            )
            if trend is not None and trend["crossing"] < start:
                return [self._trend(steps, lr, trend, family), worse]
            return [worse]
        if episode is not None:
            return [self._from_level(steps, loss, episode, found, advice, peak_lr, family)]
        return self._climb(steps, loss, lr, family, carried_curve(ctx, "loss", loss).noise)

    def _from_start(self, steps, loss, finite, i, found, advice, peak_lr, family) -> Finding:
        rise = int(finite[i:].sum())
        z = float(self._start_z(loss, found)[i])
        return self.finding(
            "worse-than-start",
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
            p_value=normal_sf(z),
            threshold=found["threshold"],
            peak_lr=peak_lr,
            family=family,
        )

    def _from_level(self, steps, loss, episode, found, advice, peak_lr, family) -> Finding:
        s, n = episode
        level = float(np.exp(found["level"][s]))
        through = s + n == steps.size
        course = "through the end of the run" if through else f"for {n} logged steps before it came back down"
        return self.finding(
            "diverged",
            "fail",
            f"loss diverged at step {steps[s]} ({loss[s]:.4g}, {loss[s] / level:.3g}x its running level of {level:.4g}) "
            f"and stayed up {course}; resume from a checkpoint before step {steps[s]} and {advice}",
            step=steps[s],
            value=loss[s],
            baseline_median=level,
            z=found["z"][s],
            p_value=normal_sf(found["z"][s]),
            effect_size=loss[s] / level,
            threshold=found["threshold"],
            steps_up=n,
            through_end=through,
            spike_steps=steps[s : s + n].tolist()[:50],
            peak_lr=peak_lr,
            family=family,
        )

    def _climb(self, steps, loss, lr, family, noise) -> list[Finding]:
        """`noise`: the loss's `point_noise`, carried (`carried_curve`): a pass over every logged value otherwise."""
        p = self.params
        rise = rise_from_minimum(loss, p["rise_factor"], p["rise_sigmas"], noise=noise)
        trend = rising_trend(loss, p["rise_factor"], p["trend_sigmas"], noise=noise)
        # The trend test uses every value after the minimum, so it tells a climb sooner and in noisier logs; the
        # level's climb also finds one that came back down before the end.
        if trend is not None and (rise is None or trend["crossing"] <= rise["crossing"]):
            return [self._trend(steps, lr, trend, family)]
        if rise is None:
            return []
        lo, at, top = rise["minimum"], rise["crossing"], rise["peak"]
        level = rise["level"]
        end = (
            "and it is still there at the end of the run"
            if rise["to_end"]
            else f"then came back to {level[-1]:.4g} at the end"
        )
        return [
            self.finding(
                "climb",
                "warn",
                f"loss climbed {rise['factor']:.3g}x from its best level ({level[lo]:.4g} around step {steps[lo]}) to "
                f"{level[top]:.4g} around step {steps[top]}, {end}; it rose {self._why(steps, lr, lo, top, at)}",
                step=steps[at],
                value=float(level[at]),
                minimum=float(level[lo]),
                minimum_step=steps[lo],
                peak=float(level[top]),
                peak_step=steps[top],
                factor=rise["factor"],
                end_factor=rise["end_factor"],
                to_end=rise["to_end"],
                threshold=rise["bar_factor"],
                noise=rise["noise"],
                smoothing_points=rise["width"],
                lr_at_minimum=lr[lo],
                lr_at_peak=lr[top],
                family=family,
            )
        ]

    def _trend(self, steps, lr, trend, family) -> Finding:
        lo, at, last = trend["minimum"], trend["crossing"], steps.size - 1
        level = trend["level"]
        return self.finding(
            "trend",
            "warn",
            f"loss trended up from its best level ({level[lo]:.4g} around step {steps[lo]}) to the end: "
            f"{trend['factor']:.3g}x over the {trend['values']} logged steps since, by the median of the pairwise "
            f"slopes of {trend['tested']} of them evenly spaced (Mann-Kendall z {trend['z']:.1f}, threshold "
            f"{self.params['trend_sigmas']:g}), under way by step "
            f"{steps[at]}; it rose {self._why(steps, lr, lo, last, at)}",
            step=steps[at],
            value=float(level[at]),
            minimum=float(level[lo]),
            minimum_step=steps[lo],
            last_level=float(level[last]),
            factor=trend["factor"],
            z=trend["z"],
            p_value=normal_sf(trend["z"]),
            threshold=self.params["trend_sigmas"],
            min_factor=self.params["rise_factor"],
            values_since_minimum=trend["values"],
            values_tested=trend["tested"],
            noise=trend["noise"],
            smoothing_points=trend["width"],
            lr_at_minimum=lr[lo],
            lr_at_end=lr[last],
            to_end=True,
            family=family,
        )

    @staticmethod
    def _why(steps, lr, lo, top, at) -> str:
        """The learning rate's course from the minimum (row `lo`) to row `top`, and what it points at."""
        lr_lo, lr_top = lr[lo], lr[top]
        if np.isfinite(lr_lo) and np.isfinite(lr_top) and lr_top >= 1.5 * lr_lo:
            return (
                f"while the learning rate rose from {lr_lo:.3g} to {lr_top:.3g}: the peak learning rate is too high for "
                f"this run; lower it (or lengthen the warm-up) and restart from a checkpoint before step {steps[at]}"
            )
        if np.isfinite(lr_lo) and np.isfinite(lr_top) and lr_top <= lr_lo / 1.5:
            return (
                f"while the learning rate decayed from {lr_lo:.3g} to {lr_top:.3g}: no schedule explains it and "
                "over-fitting lowers the training loss; check fp16 overflow (T5 and other models pretrained in bf16 "
                "overflow in fp16), a later part of the data that is broken or mislabelled, and weight decay"
            )
        return (
            "at a steady learning rate: the optimizer is leaving the minimum it found; lower the learning rate, "
            f"and keep a checkpoint from before step {steps[at]}"
        )

    def _sustained_past_dips(self, found):
        """The sustained episodes as (first row, rows up), less those where the loss only came back from a dip: the
        running level (the median of the 5 values before) sinks into a dip of 3 or more logged steps, so the loss
        returning to where it was stands above it. An episode stays up only while above the highest running
        level of the rows just before it (the level before the dip), by the same threshold."""
        x, level, scale = found["x"], found["level"], found["scale"]
        for s, _, sustained in found["episodes"]:
            if not sustained:
                continue
            before = level[max(0, s - LEVEL_POINTS) : s + 1]
            reference = np.nanmax(before) if np.isfinite(before).any() else level[s]
            bar = reference + max(found["threshold"] * scale[s], np.log(self.params["min_effect"]))
            length = rows_above(x, s, bar)
            through_end = s + length == x.size and length >= 2
            if length >= self.params["diverge_steps"] or through_end:
                yield s, length

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
