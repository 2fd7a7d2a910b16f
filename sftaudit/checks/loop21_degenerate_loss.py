"""LOOP-21 degenerate loss: exactly 0, or the same value, for a stretch of logged steps."""

from __future__ import annotations

import numpy as np

from .base import AuditContext, CannotJudge, Check, Finding, count, positive, probability
from .stats.rolling import MAD_TO_SIGMA, column, log_quantum, loss_family, step_frame


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(first row, length) of each stretch of consecutive true rows."""
    edges = np.diff(np.r_[0, mask.astype(np.int8), 0])
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return list(zip(starts.tolist(), (ends - starts).tolist()))


class DegenerateLoss(Check):
    """Degenerate loss (trigger point: every logged step).

    What it detects:
        A logged loss of exactly 0 for a stretch (0.0 from step 20 to step 1000), or one that repeats the
        same value for a stretch (10.3735 at every step): nothing is trained.
    Why it matters:
        A cross-entropy of exactly 0 over real batches is no converged model: every label is ignored (-100),
        or the loss was non-finite and the Trainer's `logging_nan_inf_filter` logged 0 in its place (a window
        whose steps were all NaN adds nothing). The same loss on different batches means the model's output no
        longer depends on its input (saturated or non-finite weights). Either way every later step is wasted.
    Statistic:
        Stretches of consecutive logged losses exactly 0, or exactly equal. The log's rounding step q is
        estimated from the values (1e-4 for 4 decimals). A zero stretch is rounding, not degeneracy, when the
        loss before it was within `sigma` noise sigmas (or q) of 0: a loss converging to 0.0001 rounds to 0.
        Equal values are chance when the run's own step-to-step noise at that level (value x 1.4826 MAD of the
        first differences of log loss / sqrt 2, outside equal stretches) is near q: the probability of two
        equal rounded values is about q / (2 sqrt(pi) sigma); a stretch is degenerate when that probability to the power of its length - 1,
        times the number of logged steps, is under `alpha` (or, with no noise measurable, when its value spans
        at least 1,000 rounding steps). A value under `min_quanta` (100) rounding steps is not judged: the log
        cannot show it move by less than 1%.
    Threshold:
        A degenerate stretch of at least `min_points` (3) logged steps: fail at its first step. Policy-gradient
        losses (GRPO, PPO: 0 by construction at the start) are not judged.
    Evidence:
        The first and last step of the stretch, the value, its length, the loss before it, the rounding step.
    """

    code = "LOOP-21"
    name = "degenerate loss"
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
        frame = step_frame(ctx, "loss")
        steps = frame["step"].to_numpy()
        loss = column(frame, "loss")
        keep = np.isfinite(loss)
        steps, loss = steps[keep], loss[keep]
        k = self.params["min_points"]
        if loss.size < k:
            raise CannotJudge(f"{loss.size} finite logged loss value(s): a stretch needs {k}")
        q = log_quantum(loss)
        same = np.r_[False, loss[1:] == loss[:-1]]  # equal to the row before
        # A stretch of equal values: its first row and every row equal to the one before.
        equal = same | np.r_[same[1:], False]
        noise = self._noise(loss, equal)
        for s, n in _runs(equal):
            if n < k:
                continue
            value = loss[s]
            before = loss[s - 1] if s else None
            if value == 0:
                if before is not None and before <= max(self.params["sigma"] * (noise or 0.0) * before, q):
                    continue  # a loss converging to 0 that the log's rounding ends at 0
                return [self._finding(steps, loss, s, n, q, before, noise, zero=True)]
            # A value of a few rounding steps cannot show the model moving (0.0005 at 4 decimals: 20% steps).
            resolved = q <= 0 or abs(value) >= self.params["min_quanta"] * q
            if resolved and self._chance_of_equal(value, n, q, noise, loss.size) < self.params["alpha"]:
                return [self._finding(steps, loss, s, n, q, before, noise, zero=False)]
        return []

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
        span = f"from step {steps[s]} to step {steps[last]} ({n} logged steps)"
        if zero:
            message = (
                f"loss is exactly 0 {span}: nothing is trained; every label is ignored (-100), or the loss was "
                f"non-finite and the Trainer's logging_nan_inf_filter logged 0 in its place; check the labels "
                f"of those batches and the gradient norm, and resume from a checkpoint before step {steps[s]}"
            )
        else:
            message = (
                f"loss is {loss[s]:.6g} at every logged step {span}: the model's output no longer depends on its "
                f"input (saturated or non-finite weights); resume from a checkpoint before step {steps[s]} with "
                f"a lower learning rate"
            )
        return self.finding(
            "fail",
            message,
            step=steps[s],
            value=loss[s],
            first_step=steps[s],
            last_step=steps[last],
            logged_steps=n,
            loss_before=before,
            log_quantum=q,
            noise=noise,
            threshold=self.params["min_points"],
        )
