"""LOOP-05 gradient-norm anomaly."""

from __future__ import annotations

from .base import AuditContext, Check, Finding


class GradientNormAnomaly(Check):
    """Gradient-norm anomaly (seed trigger point: after backward).

    What it detects:
        Non-finite training: the first step whose loss is NaN/inf, and the first step
        whose gradients hold NaN/inf, with the parameter tensors that carry them.
    Why it matters:
        One non-finite gradient poisons every weight the optimizer touches at that step;
        from then on the run trains nothing, while a loss logger that filters NaN (the HF
        Trainer's `logging_nan_inf_filter`) keeps the curve looking smooth.
    Statistic:
        `isfinite(loss)` per step; `isfinite(norm)` of each tensor's L2 gradient norm
        (a tensor's norm is non-finite exactly when one of its elements is, or it overflows).
    Threshold:
        Any non-finite value is a fail at its first step.
    Evidence:
        First and last affected step, number of affected steps, the tensors at the first
        step with their non-finite element counts, the last finite loss before it.
    """

    code = "LOOP-05"
    name = "gradient-norm anomaly"
    defaults = {"max_tensors_listed": 20}

    def run(self, ctx: AuditContext) -> list[Finding]:
        return self._nonfinite_loss(ctx) + self._nonfinite_grads(ctx)

    def _nonfinite_loss(self, ctx: AuditContext) -> list[Finding]:
        row = ctx.row(
            """
            SELECT min(step), max(step), count(*),
                   (SELECT arg_max(loss, step) FROM steps s2
                     WHERE isfinite(s2.loss) AND s2.step < min(s.step)) AS last_finite
            FROM steps s WHERE loss IS NOT NULL AND NOT isfinite(loss)
            """
        )
        first, last, n, last_finite = row
        if first is None:
            return []
        return [self.finding(
            "fail",
            f"loss became non-finite at step {first} ({n} step(s) through {last}); resume from a checkpoint "
            f"before step {first} and find the batch or learning rate that caused it",
            step=first, first_step=first, last_step=last, steps_affected=n, last_finite_loss=last_finite,
        )]

    def _nonfinite_grads(self, ctx: AuditContext) -> list[Finding]:
        first = ctx.scalar("SELECT min(step) FROM grad_norms WHERE NOT isfinite(norm)")
        if first is None:
            return []
        last, n = ctx.row("SELECT max(step), count(DISTINCT step) FROM grad_norms WHERE NOT isfinite(norm)")
        tensors = ctx.frame(
            """
            SELECT g.tensor, g.norm, s.nonfinite_grads[g.tensor] AS nonfinite_elements
            FROM grad_norms g JOIN steps s USING (rank, seg, step)
            WHERE g.step = ? AND NOT isfinite(g.norm)
            ORDER BY g.idx
            """,
            [first],
        )
        names = tensors["tensor"].to_list()
        shown = names[: self.params["max_tensors_listed"]]
        return [self.finding(
            "fail",
            f"gradients became non-finite at step {first} in {len(names)} tensor(s), first {names[0]}; "
            f"resume from a checkpoint before step {first} and skip or inspect that step's batch",
            step=first, first_step=first, last_step=last, steps_affected=n, tensor_count=len(names),
            tensors=tensors.head(self.params["max_tensors_listed"]).to_dicts(), tensors_truncated=len(names) > len(shown),
        )]
