"""LOOP-25 non-finite logged values (the loss, the gradient norm, any other logged key); steps the fp16 loss
scaler skipped."""

from __future__ import annotations

import numpy as np

from ..schema.records import STEP_METRICS
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
        that reached the weights (every later gradient norm non-finite); a streak of skipped steps; a NaN or
        infinite value of any other logged number: an eval metric (eval_loss NaN at one evaluation), a
        preference or RL statistic (rewards/margins, logps/*, logits/*, kl, reward NaN at three steps while the
        loss stays finite). From the logs alone: no checkpoint or per-tensor gradient is needed.
    Why it matters:
        One non-finite update makes every weight it touches non-finite, and every later step is wasted; the
        Trainer's `logging_nan_inf_filter` then logs a finite (or 0) loss, so the loss curve hides it and only
        the gradient norm shows it. A few skipped fp16 steps are the loss scaler finding its scale and cost
        nothing; a streak of them means the gradients are non-finite at any scale (a bad batch, an overflow in
        the forward pass): nothing is trained while it lasts. A non-finite statistic beside a finite loss is a
        batch or an evaluation that produced garbage the mean hid: a sequence with no completion tokens left
        after truncation (0 / 0), an overflow in one forward pass; the eval numbers of that step mean nothing,
        and a statistic non-finite to the end means what it measures is broken.
    Statistic:
        Per logged step: loss and gradient norm finite or not. A non-finite gradient norm followed later by a
        finite one was not applied (weights it had reached would keep every later norm non-finite): a skipped
        update. Consecutive logged skips form a streak; at the start of the run (before any finite gradient
        norm) the scaler is calibrating and halves its scale per skip. Every other logged number (the `metrics`
        table: eval_*, rewards/*, logps/*, logits/*, kl, reward, ...): non-finite or not, per key and step.
    Threshold:
        Non-finite loss: fail at its first step. Non-finite gradient norm through the end of the run: fail
        (warn when only the last logged step is). Skipped updates: info with their count; `skip_streak` (5)
        consecutive logged skips: fail, `start_skips` (16, the halvings from GradScaler's initial 2^16) at the
        start of the run. On shim runs with per-tensor gradient norms, LOOP-05 reports a non-finite loss and
        names the tensors of a non-finite gradient that was applied: those are left to it. Any other logged key
        non-finite: warn at each logged step where one is, naming the keys (at most `max_steps_listed` (20)
        findings, the last one counting the rest); a key non-finite at every logged step from some step through
        the end (2 at least): fail at its first.
    Evidence:
        First and last step, how many logged steps, the logged loss beside the first non-finite gradient norm,
        whether the learning rate was held, the skipped steps; the non-finite keys and their values at a step.
    """

    code = "LOOP-25"
    name = "non-finite logged values"
    rules = {
        "non-finite-loss": "the logged loss became non-finite",
        "skipped-streak": "the optimizer skipped several logged steps in a row (non-finite at any loss scale)",
        "skipped-steps": "the fp16 loss scaler skipped steps whose gradient norm was non-finite",
        "last-grad-norm-non-finite": "the gradient norm logged at the last step is non-finite",
        "non-finite-grad-norm": "the gradient norm is non-finite from a step through the end",
        "non-finite-metric-to-end": "a logged metric is non-finite from a step through the end",
        "non-finite-metric": "a logged metric (eval or preference statistic) is non-finite at a step",
    }
    needs = ("steps",)
    uses = ("metrics",)
    defaults = {"skip_streak": count(5), "start_skips": count(16, low=0), "max_steps_listed": count(20)}

    def run(self, ctx: AuditContext) -> list[Finding]:
        return self._loss_and_norm(ctx) + self._other_keys(ctx)

    def _loss_and_norm(self, ctx: AuditContext) -> list[Finding]:
        steps, bad_loss, bad_norm, has_norm = nonfinite_logged(ctx)
        if not (bad_loss.any() or bad_norm.any()):
            return []
        frame = step_frame(ctx, "loss", "lr")
        loss, lr = column(frame, "loss"), column(frame, "lr")
        # With per-tensor gradient norms (the shim) LOOP-05 reports a non-finite loss beside the tensors it hit.
        findings = [] if ctx.has_rows("grad_norms") else self._loss(steps, loss, bad_loss)
        skipped = skipped_updates(bad_norm, has_norm, ctx.manifest)
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
                "non-finite-loss",
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
                        "skipped-streak",
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
                "skipped-steps",
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
                    "last-grad-norm-non-finite",
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
                "non-finite-grad-norm",
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

    def _other_keys(self, ctx: AuditContext) -> list[Finding]:
        """Every other logged number: a warn per logged step where some are non-finite, a fail per key that is
        non-finite through the end."""
        others = f"""metrics WHERE rank = 0 AND name NOT IN ({", ".join(f"'{k}'" for k in STEP_METRICS)})"""
        if not ctx.scalar(f"SELECT EXISTS (SELECT 1 FROM {others} AND NOT isfinite(value))"):
            return []  # every other logged number finite (most runs): the queries below would find nothing
        # A key's tail through the end is what follows its last finite step: aggregates and joins, no window
        # (DuckDB ran a filtered window over every row per row: 15 s for the 4 keys of a 10^5-step log).
        keyed = f"""WITH logged AS (
                SELECT name, step, bool_or(NOT isfinite(value)) AS bad,
                       any_value(value) FILTER (NOT isfinite(value)) AS value
                FROM {others}
                GROUP BY name, step),
            last_finite AS (SELECT name, max(step) FILTER (NOT bad) AS step FROM logged GROUP BY name),
            tails AS (
                SELECT name, logged.step, bad, value, last_finite.step IS NULL OR logged.step > last_finite.step AS tail
                FROM logged JOIN last_finite USING (name)),
            tail_sizes AS (SELECT name, count(*) FILTER (tail) AS size FROM tails GROUP BY name),
            keys AS (SELECT name, step, bad, value, tail AND size >= 2 AS bad_to_end FROM tails JOIN tail_sizes USING (name))
            """
        ends = ctx.frame(
            keyed + "SELECT name, min(step) AS first, max(step) AS last, count(*) AS n FROM keys "
            "WHERE bad_to_end GROUP BY name ORDER BY first, name"
        )
        ended = {r["name"]: r["first"] for r in ends.iter_rows(named=True)}
        per_step = ctx.frame(
            keyed
            + "SELECT step, list(name ORDER BY name) AS names, list(CAST(value AS VARCHAR) ORDER BY name) AS vals "
            "FROM keys WHERE bad AND NOT bad_to_end GROUP BY step ORDER BY step"
        )
        findings = [
            self.finding(
                "non-finite-metric-to-end",
                "fail",
                f"the logged {r['name']} is non-finite at every logged step from step {r['first']} through the end "
                f"({r['n']} logged steps, last at step {r['last']}): {_what_broke(r['name'])}; resume from a "
                f"checkpoint before step {r['first']}",
                step=r["first"],
                key=r["name"],
                first_step=r["first"],
                last_step=r["last"],
                steps_affected=int(r["n"]),
            )
            for r in ends.iter_rows(named=True)
        ]
        limit = self.params["max_steps_listed"]
        rows = list(per_step.head(limit).iter_rows(named=True))
        for i, r in enumerate(rows):
            names = r["names"]
            more = (
                f" ({per_step.height - limit} more logged step(s) with non-finite keys after it)"
                if i == limit - 1 and per_step.height > limit
                else ""
            )
            findings.append(
                self.finding(
                    "non-finite-metric",
                    "warn",
                    f"logged {_listed(names)} {'is' if len(names) == 1 else 'are'} non-finite at step {r['step']} "
                    f"({', '.join(f'{n} {v}' for n, v in zip(names[:4], r['vals'][:4]))}): {_what_broke(names[0])}"
                    f"{more}",
                    step=r["step"],
                    keys=names[:50],
                    values=r["vals"][:50],
                    earlier_keys_to_end=sorted(k for k, first in ended.items() if first <= r["step"]),
                )
            )
        return findings

    @staticmethod
    def _named_by_loop05(ctx: AuditContext, step: int) -> bool:
        """LOOP-05 reports a non-finite gradient with its tensors when per-tensor norms were recorded there."""
        return bool(
            ctx.scalar("SELECT count(*) FROM grad_norms WHERE rank = 0 AND step = ? AND NOT isfinite(norm)", [step])
        )


def _listed(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _what_broke(name: str) -> str:
    """What a non-finite value of a logged key means, by the kind of key."""
    base = name.removeprefix("eval_")
    if name.startswith("eval_"):
        return (
            "the evaluation there produced non-finite values (a sample whose labels are all ignored gives 0 / 0, an "
            "overflow in the eval forward pass in fp16): its numbers mean nothing; check the eval set's labels and "
            "the eval precision"
        )
    if base.startswith(("rewards/", "logps/", "logits/")):
        return (
            "a batch's log-probabilities were non-finite (a sequence with no completion tokens left after "
            "truncation gives 0 / 0, an overflow in one forward pass) and the mean loss hid it: that batch trained "
            "on garbage; check max_length / max_prompt_length truncation and the precision"
        )
    if base in ("kl", "reward", "reward_std", "entropy") or base.startswith(("objective/", "completions/")):
        return (
            "the policy's statistics were non-finite there (a log-probability of -inf under the reference model, an "
            "overflow): the update at that step was computed from garbage; check the generation settings and the "
            "precision"
        )
    return "the value logged there is not a number; find what computed it"
