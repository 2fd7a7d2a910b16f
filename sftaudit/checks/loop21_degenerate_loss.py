"""LOOP-21 degenerate loss: exactly 0, or the same value, for a stretch of logged steps."""

from __future__ import annotations

import numpy as np

from .base import AuditContext, CannotJudge, Check, Finding, count, positive, probability
from .stats.rolling import MAD_TO_SIGMA, column, log_quantum, loss_family, nonfinite_logged, step_frame


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(first row, length) of each stretch of consecutive true rows."""
    edges = np.diff(np.r_[0, mask.astype(np.int8), 0])
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return list(zip(starts.tolist(), (ends - starts).tolist()))


class DegenerateLoss(Check):
    """Degenerate loss (trigger point: every logged step).

    What it detects:
        A logged loss of exactly 0 for a stretch (0.0 from step 20 to step 1000; a DPO loss of 0 at the last two
        of four logged steps while the reward margin grows x5), one that repeats the same value for a stretch
        (10.3735 at every step): nothing is trained. And a negative cross-entropy (-0.0001): a number no
        cross-entropy can be.
    Why it matters:
        A cross-entropy of exactly 0 over real batches is no converged model: with a gradient norm of 0 beside it
        no gradient reaches the weights (every label ignored, -100, or the loss detached from them); with a
        non-finite gradient norm the loss was non-finite and the Trainer's `logging_nan_inf_filter` logged 0 in its
        place (a window whose steps were all NaN adds nothing). A preference loss of exactly 0 means the policy
        separates every pair completely (margins far past what the sigmoid can tell apart): it learns nothing
        more, and its log-probabilities drift wherever they like. The same loss on different batches means the
        model's output no longer depends on its input (saturated or non-finite weights). Either way every later
        step is wasted. A negative logged loss is not the cross-entropy the run means to minimise (a term
        subtracted from it, a loss computed in a precision that rounds below 0): its curve cannot be trusted.
    Statistic:
        Stretches of consecutive logged losses exactly 0, or exactly equal. The log's rounding step q is
        estimated from the values (1e-4 for 4 decimals). A zero stretch is rounding, not degeneracy, when the
        loss before it was one rounding step, or within `sigma` of the run's relative noise sigmas of q / 2 in
        log space (a loss converging to 0.0001 rounds to 0; one of 0.15 never falls through 0 by noise);
        unrounded, within `sigma` noise sigmas of 0.
        Equal values are chance when the run's own step-to-step noise at that level (value x 1.4826 MAD of the
        first differences of log loss / sqrt 2, outside equal stretches) is near q: the probability of two
        equal rounded values is about q / (2 sqrt(pi) sigma); a stretch is degenerate when that probability to
        the power of its length - 1, times the number of logged steps, is under `alpha` (or, with no noise
        measurable, when its value spans at least 1,000 rounding steps). A value under `min_quanta` (100)
        rounding steps is not judged: the log cannot show it move by less than 1%. The cause of a zero stretch
        is read from the gradient norm logged beside it (0, non-finite, or finite) and, for a preference loss,
        from the logged reward margin.
    Threshold:
        A degenerate stretch of at least `min_points` (3) logged steps, or of 2 at least through the end of the
        run (a short log cannot show more): fail at its first step. A negative logged loss of a cross-entropy
        (not a preference loss, some of which can be negative): warn at its first step. Policy-gradient losses
        (GRPO, PPO: 0 by construction at the start) are not judged.
    Evidence:
        The first and last step of the stretch, whether it runs through the end, the value, its length, the loss
        before it, the rounding step, the gradient norms beside it, the reward margins (preference losses).
    """

    code = "LOOP-21"
    name = "degenerate loss"
    rules = {
        "zero-loss": "the loss is exactly 0 over several logged steps",
        "constant-loss": "the loss is the same value at every logged step of a stretch",
        "negative-loss": "a cross-entropy loss logged below 0",
    }
    needs = ("steps",)
    defaults = {
        "min_points": count(3, low=2),
        "sigma": positive(6.0),
        "alpha": probability(1e-3),
        "min_quanta": count(100),
    }

    def run(self, ctx: AuditContext) -> list[Finding]:
        family, keys = loss_family(ctx)
        if family == "rl":
            raise CannotJudge(f"a policy-gradient loss (logged {', '.join(keys[:3])}) is 0 or constant by construction")
        frame = step_frame(ctx, "loss", "grad_norm")
        steps = frame["step"].to_numpy()
        loss, norm = column(frame, "loss"), column(frame, "grad_norm")
        _, _, bad_norm, has_norm = nonfinite_logged(ctx)
        keep = np.isfinite(loss)
        steps, loss, norm, bad_norm = steps[keep], loss[keep], norm[keep], (bad_norm & has_norm)[keep]
        k = self.params["min_points"]
        if loss.size < k:
            raise CannotJudge(f"{loss.size} finite logged loss value(s): a stretch needs {k}")
        self._ctx = dict(ctx=ctx, family=family, norm=norm, bad_norm=bad_norm)
        findings = [] if family == "preference" else self._negative(steps, loss)
        q = log_quantum(loss)
        same = np.r_[False, loss[1:] == loss[:-1]]  # equal to the row before
        # A stretch of equal values: its first row and every row equal to the one before.
        equal = same | np.r_[same[1:], False]
        noise = self._noise(loss, equal)
        for s, n in _runs(equal):
            through = s + n == loss.size
            if n < k and not (through and n >= 2):
                continue
            value = loss[s]
            before = loss[s - 1] if s else None
            if value == 0:
                if before is not None and self._rounds_to_zero(before, q, noise):
                    continue  # a loss converging to 0 that the log's rounding ends at 0
                return findings + [self._finding(steps, loss, s, n, q, before, noise, zero=True)]
            # A value of a few rounding steps cannot show the model moving (0.0005 at 4 decimals: 20% steps).
            resolved = q <= 0 or abs(value) >= self.params["min_quanta"] * q
            if resolved and self._chance_of_equal(value, n, q, noise, loss.size) < self.params["alpha"]:
                return findings + [self._finding(steps, loss, s, n, q, before, noise, zero=False)]
        return findings

    def _negative(self, steps, loss) -> list[Finding]:
        rows = np.flatnonzero(loss < 0)
        if not rows.size:
            return []
        i = int(rows[0])
        return [
            self.finding(
                "negative-loss",
                "warn",
                f"the logged loss is negative at step {steps[i]} ({loss[i]:.4g}; {rows.size} logged step(s) below 0, "
                f"down to {loss[rows].min():.4g}): no cross-entropy is; the logged number is not the loss the run "
                f"minimises (a term subtracted from it) or it is computed in a precision that rounds below 0; check "
                f"the loss function before reading anything from its curve",
                step=steps[i],
                value=loss[i],
                negative_steps=steps[rows].tolist()[:50],
                minimum=float(loss[rows].min()),
            )
        ]

    def _rounds_to_zero(self, before: float, q: float, noise: float | None) -> bool:
        """Whether the log's rounding can have brought a loss of `before` to exactly 0. A rounded log shows 0 for a
        loss under q / 2; the run's relative noise (log space: a loss falls by factors, never through 0 by noise)
        reaches that from `before` within `sigma` sigmas, or `before` is one rounding step. An unrounded log: the
        loss before was within `sigma` noise sigmas of 0."""
        k = self.params["sigma"] * (noise or 0.0)
        if q > 0:
            return before <= q or np.log(before / (q / 2)) <= k
        return before <= k * before

    def _noise(self, loss: np.ndarray, equal: np.ndarray) -> float | None:
        """The run's relative step-to-step noise (of log loss) outside equal stretches (None: too few to say)."""
        with np.errstate(divide="ignore", invalid="ignore"):
            d = np.diff(np.log(np.where(loss > 0, loss, np.nan)))[~(equal[1:] & equal[:-1])]
        d = d[np.isfinite(d)]
        if d.size < 5:
            return None
        return float(MAD_TO_SIGMA * np.median(np.abs(d - np.median(d))) / np.sqrt(2))

    @staticmethod
    def _chance_of_equal(value: float, n: int, q: float, noise: float | None, tests: int) -> float:
        """The chance of `n` equal rounded values in a row anywhere in the run, for noise `noise` x value."""
        if q <= 0:
            return 0.0  # unrounded floats do not repeat by chance
        sigma = abs(value) * noise if noise else 0.0
        if sigma <= 0:
            return 0.0 if abs(value) >= 1000 * q else 1.0
        p = min(1.0, q / (2 * np.sqrt(np.pi) * sigma))
        return tests * p ** (n - 1)

    def _finding(self, steps, loss, s, n, q, before, noise, zero: bool) -> Finding:
        last = s + n - 1
        through = last == loss.size - 1
        span = f"from step {steps[s]} to step {steps[last]} ({n} logged steps{', through the end of the run' if through else ''})"
        norms = self._ctx["norm"][s : last + 1]
        extra: dict = {}
        if zero:
            message, extra = self._zero_cause(steps, s, last, span, norms)
        else:
            message = (
                f"loss is {loss[s]:.6g} at every logged step {span}: the model's output no longer depends on its "
                f"input (saturated or non-finite weights); resume from a checkpoint before step {steps[s]} with "
                f"a lower learning rate"
            )
        return self.finding(
            "zero-loss" if zero else "constant-loss",
            "fail",
            message,
            step=steps[s],
            value=loss[s],
            first_step=steps[s],
            last_step=steps[last],
            through_end=through,
            logged_steps=n,
            loss_before=before,
            log_quantum=q,
            noise=noise,
            grad_norms=[None if not np.isfinite(g) else float(g) for g in norms[:50]],
            threshold=self.params["min_points"],
            **extra,
        )

    def _zero_cause(self, steps, s, last, span, norms) -> tuple[str, dict]:
        """Why the logged loss is 0, from the gradient norm beside it (and the reward margin of a preference loss)."""
        ctx, family = self._ctx["ctx"], self._ctx["family"]
        resume = f"resume from a checkpoint before step {steps[s]}"
        if family == "preference":
            margins = ctx.frame(
                "SELECT step, avg(value) AS m FROM metrics WHERE rank = 0 AND name = 'rewards/margins' "
                "AND isfinite(value) GROUP BY step ORDER BY step"
            )
            grew = ""
            extra: dict = {}
            if margins.height:
                m_steps, m = margins["step"].to_numpy(), margins["m"].to_numpy()
                inside = (m_steps >= steps[s]) & (m_steps <= steps[last])
                earlier = m_steps < steps[s]
                if inside.any():
                    top = float(m[inside].max())
                    extra = {"reward_margins": m[inside].tolist()[:50], "margin_before": None}
                    grew = f" while the reward margin grew to {top:.4g}"
                    if earlier.any() and m[earlier][-1] > 0:
                        extra["margin_before"] = float(m[earlier][-1])
                        grew += f" ({top / m[earlier][-1]:.3g}x the {m[earlier][-1]:.4g} before it)"
            tiny = f" (gradient norm {np.nanmax(norms):.3g})" if np.isfinite(norms).any() else ""
            return (
                f"the preference loss is exactly 0 {span}{grew}: the policy separates every pair completely and learns "
                f"nothing more{tiny}, while its log-probabilities drift wherever they like (over-optimised); lower the "
                f"learning rate or raise beta, stop earlier, and keep a checkpoint from before step {steps[s]}",
                extra,
            )
        finite = norms[np.isfinite(norms)]
        if norms.size and finite.size == norms.size and (finite == 0).all():
            return (
                f"loss is exactly 0 {span} and so is the gradient norm: no gradient reaches the trainable weights; "
                f"every label is ignored (-100: check the collator's masking and the chat template's assistant "
                f"markers) or the loss is detached from the trained parameters (an adapter not attached, a frozen "
                f"model); {resume}",
                {},
            )
        if self._ctx["bad_norm"][s : last + 1].all():
            return (
                f"loss is exactly 0 {span} with a non-finite gradient norm beside it: the loss was non-finite and the "
                f"Trainer's logging_nan_inf_filter logged 0 in its place; find the batch or learning rate that made it "
                f"non-finite (fp16 overflow, labels all ignored in a batch) and {resume}",
                {},
            )
        return (
            f"loss is exactly 0 {span}: nothing is trained; every label is ignored (-100), or the loss was "
            f"non-finite and the Trainer's logging_nan_inf_filter logged 0 in its place; check the labels of those "
            f"batches and the gradient norm, and {resume}",
            {},
        )
