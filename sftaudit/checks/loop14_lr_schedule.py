"""LOOP-14 learning-rate schedule conformance."""

from __future__ import annotations

import json

import numpy as np

from .base import AuditContext, Check, Finding
from .stats.rolling import skipped_updates

SPEEDS = (2, 3, 4, 5, 6, 8)  # how many times too fast (or slow) a mis-stepped scheduler may run


class LRScheduleConformance(Check):
    """Learning-rate schedule conformance (trigger point: every optimizer step).

    What it detects:
        The learning rate each step trained with departing from the schedule the run configured:
        running k x ahead (a scheduler stepped several times per optimizer step, e.g.
        accelerate's wrapper stepping it once per process) or behind; reaching its floor early;
        restarting its warmup (a resume with a fresh scheduler); 0 while gradients flow.
    Why it matters:
        A schedule compressed k x ends its warmup and decays k x early: the rest of the run trains
        at a learning rate near 0 while the loss curve merely looks converged. Nothing else in
        the run looks wrong: the gradients are normal, the updates just vanish.
    Statistic:
        The configured schedule is the one the shim traced at start from the scheduler itself
        (`Recorder(scheduler=...)`; the Trainer's `lr_scheduler` through the callback): the LR after
        0, 1, 2, ... scheduler steps. The recorded LR of step s is compared with the trace at
        s - 1 (the LR in use during the step, as the Trainer callback records it) or s (after the
        scheduler stepped, as a plain loop passing `get_last_lr()` records it), each less the steps the
        optimizer skipped before (an fp16 loss-scaler skip does not step the scheduler: non-finite gradient
        norm, finite again later): the alignment that matches more steps is the run's convention. A step matches when |recorded - configured| <=
        `tolerance` (1%) x max(configured, 0.001 x peak). A departure is then characterised: the
        trace at k x (or 1/k x) the step index for k in 2..8, a restart from the trace's start at
        a resume, the floor (the trace's minimum) reached early, LR 0 at steps with a non-zero
        gradient norm.
    Threshold:
        Any step outside the tolerance: fail at the first one. LR exactly 0 while the gradient
        norm is non-zero and the schedule says otherwise: part of the same finding (evidence).
    Evidence:
        The first departing step with recorded and configured LR, the diagnosis (k x ahead/behind,
        warmup restarted at step r, floor reached at step s instead of m), the number of steps
        affected, the scheduler's class and its traced arguments.
    """

    code = "LOOP-14"
    name = "learning-rate schedule conformance"
    needs = ("steps",)
    defaults = {"tolerance": 0.01}

    def run(self, ctx: AuditContext) -> list[Finding]:
        scheduler = self._scheduler(ctx)
        if scheduler is None:
            return []
        if not scheduler.get("lr"):
            return [
                self.finding(
                    "info",
                    f"learning-rate schedule not judged: the {scheduler.get('class')} schedule could not be traced "
                    "at start (no horizon: pass the run's max_steps in the Recorder's config)",
                )
            ]
        frame = ctx.frame("SELECT step, seg, lr, grad_norm FROM steps WHERE rank = 0 AND lr IS NOT NULL ORDER BY step")
        if frame.height == 0:
            return []
        steps = frame["step"].to_numpy()
        lr = frame["lr"].to_numpy().astype(float)
        trace = np.asarray(scheduler["lr"], dtype=float)
        start = int(scheduler.get("trace_start") or 0)
        peak = float(np.nanmax(np.abs(trace))) or 1.0

        def configured(index: np.ndarray) -> np.ndarray:
            """The trace at (fractional) scheduler positions; NaN outside it."""
            i = np.asarray(index, dtype=float) - start
            inside = (i >= 0) & (i <= trace.size - 1)
            return np.where(inside, np.interp(np.clip(i, 0, trace.size - 1), np.arange(trace.size), trace), np.nan)

        def matches(expected: np.ndarray) -> np.ndarray:
            with np.errstate(invalid="ignore"):
                return np.abs(lr - expected) <= self.params["tolerance"] * np.maximum(np.abs(expected), 1e-3 * peak)

        # A step the optimizer skipped (the fp16 loss scaler) does not step the scheduler either (the Trainer,
        # accelerate): after it the LR runs one scheduler step behind the step count, by design.
        logged = frame["grad_norm"].is_not_null().to_numpy()
        bad = logged & ~np.isfinite(frame["grad_norm"].cast(float).fill_null(0.0).to_numpy())
        skips = np.cumsum(skipped_updates(bad, logged))
        behind = {(o, a): (skips - (skips - np.r_[0, skips[:-1]]) * (o == 0)) * a for o in (0, 1) for a in (0, 1)}
        candidates = {key: configured(steps - 1 + key[0] - behind[key]) for key in behind}
        key = max(candidates, key=lambda k: (matches(candidates[k]).sum(), -k[1], -k[0]))
        offset = key[0]
        expected = candidates[key]
        judged = np.isfinite(expected)
        ok = matches(expected) | ~judged
        ctx.add_series(
            self.code,
            "recorded / configured learning rate",
            steps.tolist(),
            np.where(judged & (expected != 0), lr / np.where(expected != 0, expected, 1), np.nan).tolist(),
        )
        if ok.all():
            return []
        first = int(np.flatnonzero(~ok)[0])
        s = int(steps[first])
        diagnosis = self._diagnose(frame, steps, lr, configured, matches, first, offset)
        # The floor: the schedule's minimum after its peak (a warmup starting at 0 is not the floor).
        top = int(np.nanargmax(trace))
        floor = float(np.nanmin(trace[top:]))
        near = self.params["tolerance"] * max(abs(floor), 1e-3 * peak)
        at_floor = np.flatnonzero(np.abs(lr - floor) <= near)
        floor_info = {}
        if at_floor.size and floor < peak:
            reached = int(steps[at_floor[0]])
            scheduled = top + np.flatnonzero(np.abs(trace[top:] - floor) <= near)
            planned = int(scheduled[0] + start + 1 - offset) if scheduled.size else None
            if planned is None or reached < planned:
                floor_info = {"floor": floor, "reached_at": reached, "scheduled_at": planned}
        with np.errstate(invalid="ignore"):
            zero = (lr == 0) & (frame["grad_norm"].fill_null(0).to_numpy() > 0) & (np.nan_to_num(expected) > 0)
        text = diagnosis["text"]
        if floor_info:
            text += f"; it reached its floor {floor:.3g} at step {floor_info['reached_at']}" + (
                f" instead of step {floor_info['scheduled_at']}" if floor_info["scheduled_at"] else ""
            )
        if zero.any():
            text += f"; {int(zero.sum())} step(s) trained at LR 0 while gradients flowed"
        return [
            self.finding(
                "fail",
                f"the learning rate left its configured schedule at step {s} ({lr[first]:.3g} instead of {expected[first]:.3g}): "
                f"{text}; check how often scheduler.step() runs per optimizer step and that a resume restores the "
                f"scheduler's state",
                step=s,
                recorded=float(lr[first]),
                configured=float(expected[first]),
                value=float(lr[first]),
                threshold=self.params["tolerance"],
                diagnosis=diagnosis["kind"],
                speed=diagnosis.get("speed"),
                steps_affected=int((~ok).sum()),
                floor=floor_info or None,
                zero_lr_steps=steps[zero].tolist()[:50],
                scheduler={k: scheduler.get(k) for k in ("class", "lr_lambda")},
            )
        ]

    def _scheduler(self, ctx: AuditContext) -> dict | None:
        """The configured schedule: of the segments' traces (each resumed segment traces its own
        fresh scheduler up to its own max_steps), the longest, earliest first among equals."""
        found = [
            json.loads(m).get("scheduler")
            for (m,) in ctx.con.execute("SELECT manifest FROM manifest WHERE rank = 0 ORDER BY seg").fetchall()
        ]
        found = [s for s in found if s]
        return max(found, key=lambda s: len(s.get("lr") or []), default=None)

    def _diagnose(self, frame, steps, lr, configured, matches, first, offset) -> dict:
        tail = slice(first, None)
        for k in SPEEDS:
            for o in (0, 1):
                for factor, word in ((k, "ahead"), (1 / k, "behind")):
                    expected = configured((steps - 1 + o) * factor)
                    ok = matches(expected)[tail]
                    judged = np.isfinite(expected)[tail]
                    if judged.sum() >= 2 and ok[judged].mean() >= 0.9:
                        return {
                            "kind": f"{word}",
                            "speed": k,
                            "text": f"it runs {k}x {word} of the schedule (the scheduler is stepped "
                            + (
                                f"{k} times per optimizer step"
                                if word == "ahead"
                                else f"once every {k} optimizer steps"
                            )
                            + ")",
                        }
        segs = frame["seg"].to_numpy()
        s = int(steps[first])
        if first and segs[first] != segs[first - 1]:
            restarted = configured(steps - steps[first] + offset)  # a fresh scheduler from the resumed step
            if matches(restarted)[first : first + 3].all():
                return {
                    "kind": "restarted",
                    "text": f"the schedule restarted from its beginning at the resume at step {s}"
                    " (warmup again: the scheduler's state was not restored)",
                }
        return {"kind": "departed", "text": "it does not follow the configured schedule from there"}
