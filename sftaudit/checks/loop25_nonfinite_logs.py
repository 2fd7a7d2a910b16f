"""LOOP-25 non-finite logged loss and gradient norm; steps the fp16 loss scaler skipped."""

from __future__ import annotations

import numpy as np

from .base import AuditContext, Check, Finding, count
from .stats.rolling import column, nonfinite_logged, skipped_updates, step_frame


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(first row, length) of each stretch of consecutive true rows."""
    edges = np.diff(np.r_[0, np.asarray(mask, bool).astype(np.int8), 0])
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return list(zip(starts.tolist(), (ends - starts).tolist()))


class NonFiniteLogs(Check):
    """Non-finite logged values (trigger point: every logged step).

    What it detects:
        A NaN or infinite logged loss; a non-finite logged gradient norm, either an update the optimizer
        skipped (the fp16 GradScaler: gradient norm inf or NaN, learning rate held, training goes on) or one
        that reached the weights (every later gradient norm non-finite); a streak of skipped steps. From the
        logs alone: no checkpoint or per-tensor gradient is needed.
    Why it matters:
        One non-finite update makes every weight it touches non-finite, and every later step is wasted; the
        Trainer's `logging_nan_inf_filter` then logs a finite (or 0) loss, so the loss curve hides it and only
        the gradient norm shows it. A few skipped fp16 steps are the loss scaler finding its scale and cost
        nothing; a streak of them means the gradients are non-finite at any scale (a bad batch, an overflow in
        the forward pass): nothing is trained while it lasts.
    Statistic:
        Per logged step: loss and gradient norm finite or not. A non-finite gradient norm followed later by a
        finite one was not applied (weights it had reached would keep every later norm non-finite): a skipped
        update. Consecutive logged skips form a streak; at the start of the run (before any finite gradient
        norm) the scaler is calibrating and halves its scale per skip.
    Threshold:
        Non-finite loss: fail at its first step. Non-finite gradient norm through the end of the run: fail
        (warn when only the last logged step is). Skipped updates: info with their count; `skip_streak` (5)
        consecutive logged skips: fail, `start_skips` (16, the halvings from GradScaler's initial 2^16) at the
        start of the run. On shim runs with per-tensor gradient norms, LOOP-05 reports a non-finite loss and
        names the tensors of a non-finite gradient that was applied: those are left to it.
    Evidence:
        First and last step, how many logged steps, the logged loss beside the first non-finite gradient norm,
        whether the learning rate was held, the skipped steps.
    """

    code = "LOOP-25"
    name = "non-finite logged values"
    needs = ("steps",)
    defaults = {"skip_streak": count(5), "start_skips": count(16, low=0)}

    def run(self, ctx: AuditContext) -> list[Finding]:
        steps, bad_loss, bad_norm, has_norm = nonfinite_logged(ctx)
        if not (bad_loss.any() or bad_norm.any()):
            return []
        frame = step_frame(ctx, "loss", "lr")
        loss, lr = column(frame, "loss"), column(frame, "lr")
        # With per-tensor gradient norms (the shim) LOOP-05 reports a non-finite loss beside the tensors it hit.
        findings = [] if ctx.has_rows("grad_norms") else self._loss(steps, loss, bad_loss)
        skipped = skipped_updates(bad_norm, has_norm)
        findings += self._skips(steps, lr, skipped, bad_norm, has_norm)
        applied = bad_norm & ~skipped
        if applied.any() and not self._named_by_loop05(ctx, int(steps[np.flatnonzero(applied)[0]])):
            findings += self._applied(steps, loss, applied)
        return findings

    def _loss(self, steps, loss, bad_loss) -> list[Finding]:
        if not bad_loss.any():
            return []
        rows = np.flatnonzero(bad_loss)
        first = int(rows[0])
        finite_before = loss[:first][np.isfinite(loss[:first])]
        recovered = bool(np.isfinite(loss[first:]).any())
        return [
            self.finding(
                "fail",
                f"loss became non-finite at step {steps[first]} ({rows.size} logged step(s) through {steps[rows[-1]]}"
                + ("; finite again later: those updates were skipped or the loss alone overflowed" if recovered else "")
                + f"); resume from a checkpoint before step {steps[first]} and find the batch or learning rate that caused it",
                step=steps[first],
                first_step=steps[first],
                last_step=steps[rows[-1]],
                steps_affected=int(rows.size),
                last_finite_loss=float(finite_before[-1]) if finite_before.size else None,
                recovered=recovered,
            )
        ]

    def _skips(self, steps, lr, skipped, bad_norm, has_norm) -> list[Finding]:
        if not skipped.any():
            return []
        rows = np.flatnonzero(skipped)
        with np.errstate(invalid="ignore"):
            held = np.r_[False, lr[1:] == lr[:-1]] & skipped
        findings = []
        first_finite = np.flatnonzero(has_norm & ~bad_norm)
        calibrated_from = int(first_finite[0]) if first_finite.size else steps.size
        for s, n in _runs(skipped):
            limit = self.params["start_skips"] if s < calibrated_from else self.params["skip_streak"]
            if n >= limit:
                findings.append(
                    self.finding(
                        "fail",
                        f"the optimizer skipped {n} logged steps in a row from step {steps[s]} to {steps[s + n - 1]} (gradient "
                        f"norm non-finite at each, finite again after): nothing was trained there, and the gradients are "
                        f"non-finite at any loss scale; inspect those batches and the forward pass for an overflow (bf16 "
                        f"instead of fp16, a lower learning rate), and resume from a checkpoint before step {steps[s]}",
                        step=steps[s],
                        first_step=steps[s],
                        last_step=steps[s + n - 1],
                        streak=n,
                        threshold=limit,
                    )
                )
        share = rows.size / steps.size
        findings.append(
            self.finding(
                "info",
                f"the optimizer skipped {rows.size} logged step(s) whose gradient norm was non-finite (first at step "
                f"{steps[rows[0]]}; {int(held.sum())} with the learning rate held): the fp16 loss scaler lowering its scale; "
                "the run trained on after each",
                step=steps[rows[0]],
                skipped_steps=steps[rows].tolist()[:50],
                count=int(rows.size),
                share=share,
                lr_held=int(held.sum()),
            )
        )
        return findings

    def _applied(self, steps, loss, applied) -> list[Finding]:
        rows = np.flatnonzero(applied)
        first = int(rows[0])
        if first == steps.size - 1:
            return [
                self.finding(
                    "warn",
                    f"the gradient norm logged at the last step ({steps[first]}) is non-finite: the log cannot tell whether "
                    f"that update reached the weights; check the saved weights for NaN before using them",
                    step=steps[first],
                    first_step=steps[first],
                    logged_loss=loss[first],
                )
            ]
        hidden = bool(np.isfinite(loss[first]))
        why = (
            f" while the logged loss stays finite ({loss[first]:.4g}: the Trainer's logging_nan_inf_filter logs "
            "the running mean, or 0, in place of a non-finite loss)"
            if hidden
            else ""
        )
        return [
            self.finding(
                "fail",
                f"the gradient norm is non-finite from step {steps[first]} through the end ({rows.size} logged steps){why}: "
                f"that update reached the weights, which are non-finite from then on; resume from a checkpoint before "
                f"step {steps[first]} and find the batch or learning rate that caused it",
                step=steps[first],
                first_step=steps[first],
                last_step=steps[rows[-1]],
                steps_affected=int(rows.size),
                logged_loss=loss[first],
                hidden_by_logging_filter=hidden,
            )
        ]

    @staticmethod
    def _named_by_loop05(ctx: AuditContext, step: int) -> bool:
        """LOOP-05 reports a non-finite gradient with its tensors when per-tensor norms were recorded there."""
        return bool(
            ctx.scalar("SELECT count(*) FROM grad_norms WHERE rank = 0 AND step = ? AND NOT isfinite(norm)", [step])
        )
