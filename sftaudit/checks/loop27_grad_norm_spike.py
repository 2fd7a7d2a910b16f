"""LOOP-27 logged global gradient-norm spike, judged against the run's own noise from the first logged steps."""

from __future__ import annotations

import numpy as np

from .base import AuditContext, CannotJudge, Check, Finding, at_least, count, positive
from .carried_curve import carried_excursions
from .stats.rolling import column, step_frame

# The first logged norm is compared with the norms logged right after it (not the whole run: a run that
# memorises its data ends with norms a thousand times smaller, for good reason).
FIRST_COMPARED = 5


class LoggedGradientNormSpike(Check):
    """Logged gradient-norm spike (trigger point: every logged step).

    What it detects:
        An isolated spike of the logged global gradient norm (the Trainer's `grad_norm`, the shim's global norm):
        a step whose norm is many times the norms logged around it and that comes back down (9.49 at step 27 of
        a per-step log whose neighbours sit at 0.6-0.7); and a first logged gradient norm orders of magnitude
        above the rest of the run (1,628 at step 1 of a DPO run whose later norms are 0.01 and below).
    Why it matters:
        A gradient norm many times its neighbours is one batch the model reacts to violently: a corrupt or
        unusual sample (very long, another language, mislabelled), an fp16 overflow the loss scaler did not
        catch. Gradient clipping bounds the update, not the direction: the step still moved the weights toward
        that batch. The per-tensor rule (LOOP-05) needs a history of each tensor; a log has one global norm,
        and a spike in the first few hundred steps of a run deserves the same judgement as a later one.
    Statistic:
        On log(gradient norm), exactly as the loss is judged (LOOP-10): each logged norm's residual from the
        median of the 5 norms before it (at least 3), over the run's own noise where it lies (the robust sigma of second
        differences of log norm pooled over at least 32 logged values, available from the second logged step),
        with the run's upper-tail factor; one-sided. The first logged norm has no norms before it: it is
        compared with the median of the 5 norms logged after it (not the whole run: a run that memorises its
        data ends with norms a thousand times smaller, for good reason).
    Threshold:
        z >= `sigma` (6) x tail factor and at least `min_effect` (10) x the running level (the same effect
        LOOP-05 asks of a global norm), back below that bar within `diverge_steps` (5) logged steps: warn at its
        step (a norm that stays up is a drift, not a spike; not judged here). First logged norm >=
        `first_factor` (100) x the median of the next 5: warn. A non-finite norm is LOOP-25's. Fewer than 3
        positive finite logged norms (an older Trainer logs none): not judged.
    Evidence:
        The norm, its running level, the effect size, z, the logged steps it stayed up, the loss logged beside
        it and the loss's own running level.
    """

    code = "LOOP-27"
    name = "logged gradient-norm spike"
    rules = {
        "spike": "the logged gradient norm spiked against its running level and came back down",
        "first-norm": "the first logged gradient norm is far above the rest",
    }
    needs = ("steps",)
    defaults = {
        "sigma": positive(6.0),
        "min_effect": at_least(10.0, 1),
        "diverge_steps": count(5),
        "first_factor": at_least(100.0, 1),
        "max_listed": count(20),
    }

    def run(self, ctx: AuditContext) -> list[Finding]:
        frame = step_frame(ctx, "grad_norm", "loss")
        norm, loss = column(frame, "grad_norm"), column(frame, "loss")
        usable = np.isfinite(norm) & (norm > 0)
        if usable.sum() < 3:
            raise CannotJudge(
                f"{int(usable.sum())} positive finite logged gradient norm(s): too few to judge (an older Trainer "
                "logs none)"
            )
        steps, norm, loss = frame["step"].to_numpy()[usable], norm[usable], loss[usable]
        p = self.params
        found = carried_excursions(ctx, "grad_norm", norm, p["sigma"], p["diverge_steps"], p["min_effect"])
        ctx.add_series(
            self.code,
            "log gradient norm z vs its own step-to-step noise",
            steps,
            np.nan_to_num(found["z"], posinf=0.0, neginf=0.0),
            found["threshold"],
            sole_condition=False,
        )
        findings = self._first(steps, norm)
        for s, length, sustained in found["episodes"]:
            if sustained or len(findings) >= p["max_listed"]:
                continue
            level = float(np.exp(found["level"][s]))
            effect = float(norm[s] / level)
            beside = (
                f"; the loss beside it: {loss[s]:.4g} against {float(np.nanmedian(loss[max(s - 5, 0) : s])):.4g} before"
                if s > 0 and np.isfinite(loss[s]) and np.isfinite(loss[max(s - 5, 0) : s]).any()
                else ""
            )
            findings.append(
                self.finding(
                    "spike",
                    "warn",
                    f"the logged gradient norm spiked at step {steps[s]} to {norm[s]:.4g}, {effect:.3g}x its running level "
                    f"of {level:.4g} (z {found['z'][s]:.1f} against the run's own step-to-step noise, threshold "
                    f"{found['threshold']:.1f}), back within {length} logged step(s){beside}: one batch the model reacted "
                    f"to violently (a corrupt, very long or unusual sample, an fp16 overflow the scaler did not catch); "
                    f"inspect the batch of step {steps[s]}",
                    step=steps[s],
                    value=norm[s],
                    baseline_median=level,
                    effect_size=effect,
                    z=found["z"][s],
                    threshold=found["threshold"],
                    min_effect=p["min_effect"],
                    tail_factor=found["tail"],
                    steps_up=length,
                    loss=loss[s] if np.isfinite(loss[s]) else None,
                )
            )
        return findings

    def _first(self, steps, norm) -> list[Finding]:
        rest = float(np.median(norm[1 : 1 + FIRST_COMPARED]))
        ratio = norm[0] / rest if rest > 0 else np.inf
        if ratio < self.params["first_factor"]:
            return []
        return [
            self.finding(
                "first-norm",
                "warn",
                f"the gradient norm logged at step {steps[0]} ({norm[0]:.4g}) is {_times(ratio)} the median of the "
                f"{min(FIRST_COMPARED, norm.size - 1)} logged after it ({rest:.3g}): the first updates' gradients were outsized (an fp16 overflow, labels or a "
                f"reference model that do not match the model trained, a loss summed where it should be averaged); "
                f"clipping bounds such a step, not its direction: check the first batches and how the loss is built",
                step=steps[0],
                value=norm[0],
                median_after=rest,
                compared=min(FIRST_COMPARED, norm.size - 1),
                effect_size=ratio,
                threshold=self.params["first_factor"],
            )
        ]


def _times(ratio: float) -> str:
    return f"{ratio:,.0f}x" if ratio < 1e6 else f"{ratio:.1e}x"
