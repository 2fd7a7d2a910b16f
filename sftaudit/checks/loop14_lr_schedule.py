"""LOOP-14 learning-rate schedule conformance."""

from __future__ import annotations

import json

import numpy as np

from .base import AuditContext, Check, Finding, at_least, count
from .stats.rolling import positive, run_config, skipped_updates

SPEEDS = (2, 3, 4, 5, 6, 8)  # how many times too fast (or slow) a mis-stepped scheduler may run


class LRScheduleConformance(Check):
    """Learning-rate schedule conformance (trigger point: every optimizer step).

    What it detects:
        The learning rate each step trained with departing from the schedule the run configured:
        running k x ahead (a scheduler stepped several times per optimizer step, e.g.
        accelerate's wrapper stepping it once per process) or behind; reaching its floor early;
        restarting its warmup (a resume with a fresh scheduler); 0 while gradients flow. A run imported from its
        logs has no traced schedule; its logged LR is judged by its shape: a warm-up that lasts the whole run
        (warmup_steps >= max_steps), and at each resume a schedule that did not go on where it was (restarted,
        dropped to 0, jumped), told apart from a resume that changed the run's plan (another max_steps).
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
        Imported: at a resume (a new segment) the first LR after it against the last before, relative, within
        max(`resume_tolerance`, 2 x the largest relative per-step change of the `resume_window` logs before);
        a departure is "restarted" when the LR fell to <= 1% of the peak and rises over the next `resume_window`
        logs. Within a segment (a resume whose log simply goes on), in a run that warmed up: a cliff (from >= 10%
        of the peak to <= 5% of it in one log) followed by `resume_window` rising logs, at any pace (a fresh
        scheduler built for another length warms up at another). The whole-run warm-up: the last segment's LR never falls from
        its first log to its peak, rises at
        at least half of those logs, peaks at the last log or the one before it, and the run reached its plan
        (within one logging interval).
    Threshold:
        Any step outside the tolerance: fail at the first one. LR exactly 0 while the gradient
        norm is non-zero and the schedule says otherwise: part of the same finding (evidence). Imported: a
        departure at a resume is a warn at the resume step (configuration when the segments' max_steps differ,
        else an anomaly: the scheduler's state was not restored); a warm-up climbed again within a
        segment: an anomaly warn at the cliff; a whole-run warm-up is a configuration warn.
    Evidence:
        The first departing step with recorded and configured LR, the diagnosis (k x ahead/behind,
        warmup restarted at step r, floor reached at step s instead of m), the number of steps
        affected, the scheduler's class and its traced arguments. Imported: the LR before, at and after the
        resume with each plan's max_steps; the warm-up's first and peak LR and steps, the planned length.
    """

    code = "LOOP-14"
    name = "learning-rate schedule conformance"
    rules = {
        "not-traced": "the learning-rate schedule could not be traced (no horizon)",
        "off-schedule": "the learning rate left its configured schedule",
        "plan-changed-on-resume": "a resume changed the run's plan and the schedule with it",
        "scheduler-not-restored": "at a resume the scheduler's state was not restored",
        "schedule-restarted": "the schedule started over at a resume",
        "endless-warmup": "the learning-rate warm-up lasted the whole run",
    }
    needs = ("steps",)
    defaults = {"tolerance": at_least(0.01, 0), "resume_window": count(3), "resume_tolerance": at_least(0.1, 0)}

    def run(self, ctx: AuditContext) -> list[Finding]:
        scheduler = self._scheduler(ctx)
        if scheduler is None:
            return self._logged(ctx) if ctx.manifest.get("imported") else []
        if not scheduler.get("lr"):
            return [
                self.finding(
                    "not-traced",
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
        skips = np.cumsum(skipped_updates(bad, logged, ctx.manifest))
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
                "off-schedule",
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

    # ------------------------------------------------------------------ a run imported from its logs: no trace

    def _logged(self, ctx: AuditContext) -> list[Finding]:
        """The logged learning rate judged by its shape alone: at each resume, and over the whole run."""
        frame = ctx.frame(
            "SELECT step, seg, lr FROM steps WHERE rank = 0 AND lr IS NOT NULL AND isfinite(lr) ORDER BY step"
        )
        if frame.height < 3:
            return []
        steps, segs = frame["step"].to_numpy(), frame["seg"].to_numpy()
        lr = frame["lr"].to_numpy().astype(float)
        return (
            self._at_resumes(ctx, steps, segs, lr)
            + self._replayed_warmups(steps, segs, lr)
            + self._whole_run_warmup(ctx, steps, segs, lr)
        )

    def _at_resumes(self, ctx: AuditContext, steps, segs, lr) -> list[Finding]:
        plans = {
            seg: (json.loads(m).get("config") or {}).get("max_steps")
            for seg, m in ctx.con.execute("SELECT seg, manifest FROM manifest WHERE rank = 0").fetchall()
        }
        window = self.params["resume_window"]
        findings = []
        for i in np.flatnonzero(segs[1:] != segs[:-1]) + 1:
            before, at = float(lr[i - 1]), float(lr[i])
            peak = float(lr[:i].max())
            if peak <= 0:
                continue
            recent = lr[max(i - 1 - window, 0) : i]
            with np.errstate(divide="ignore", invalid="ignore"):
                pace = np.abs(np.diff(recent)) / np.where(recent[:-1] > 0, recent[:-1], np.inf)
            tolerance = max(self.params["resume_tolerance"], 2 * float(pace.max(initial=0.0)))
            after = lr[i + 1 : i + 1 + window]
            rises = bool(after.size and after.max() > at * (1 + tolerance) and after.max() > 0.01 * peak)
            # Past its warm-up a schedule does not climb again: an LR above the last one before the resume is not
            # it going on, even where the step right after the resume looks continuous (a decay ending at 0).
            warming = i >= 2 and lr[i - 1] > lr[i - 2]
            level = max(before, 0.01 * peak)  # a schedule that had reached 0 goes on at 0
            climbs = not warming and bool(after.size and after.max() > level * (1 + tolerance))
            if abs(at - before) <= tolerance * level and not climbs:
                continue  # the schedule went on where it was
            planned = (plans.get(int(segs[i - 1])), plans.get(int(segs[i])))
            replanned = None not in planned and planned[0] != planned[1]
            s = int(steps[i])
            shape = f"{before:.3g} at step {steps[i - 1]}, {at:.3g} at step {s}"
            if rises:
                j = i + 1 + int(np.argmax(after))
                shape += f", {lr[j]:.3g} at step {steps[j]} ({lr[j] / peak:.0%} of the peak {peak:.3g})"
            dropped = at <= 0.01 * peak
            fell = at < before * (1 - tolerance)
            what = (
                "restarted"  # it fell, then climbed: the warm-up again
                if fell and rises
                else "dropped to 0"
                if dropped
                else "dropped"
                if fell
                else "jumped"
            )
            evidence = dict(
                step=s,
                resume_step=s,
                lr_before=before,
                lr_at_resume=at,
                value=abs(at - before) / level,
                threshold=tolerance,
                diagnosis=what,
                max_steps_before=planned[0],
                max_steps_after=planned[1],
            )
            if replanned:
                findings.append(
                    self.finding(
                        "plan-changed-on-resume",
                        "warn",
                        f"the resume at step {s} changed the run's plan (max_steps {planned[0]:,} -> {planned[1]:,}) and "
                        f"the learning rate with it ({shape}): a schedule rebuilt for the new length starts from the "
                        "last LR of the old one, then follows the new one"
                        + (", so the LR rose again late in training" if rises else "")
                        + "; plan the run's whole length at its start, or warm up again deliberately",
                        category="configuration",
                        **evidence,
                    )
                )
                continue
            cause = (
                "the schedule started over (warm-up again)"
                if what == "restarted"
                else f"the learning rate {what} where the schedule should have gone on"
            )
            findings.append(
                self.finding(
                    "scheduler-not-restored",
                    "warn",
                    f"at the resume at step {s} {cause} ({shape}): the scheduler's state was not restored from the "
                    "checkpoint; resume with its scheduler.pt (resume_from_checkpoint restores it)",
                    **evidence,
                )
            )
        return findings

    def _replayed_warmups(self, steps, segs, lr) -> list[Finding]:
        """Within a segment (a resume no saved state shows: the resumed run's log goes on from the checkpoint's),
        the warm-up run again: the LR falls at once from a working level to near 0 and climbs again, at the run's
        first warm-up's pace or another (a fresh scheduler built for another length, or warming up over a share of
        it, climbs at another). A cyclic schedule descends to its floor gradually; one with hard restarts jumps
        back to its peak at once: neither climbs again after a cliff."""
        stops = np.flatnonzero(np.diff(lr) <= 0)
        end = int(stops[0]) if stops.size else lr.size - 1  # the first warm-up's last log
        if end < 2 or lr[end] <= lr[0]:
            return []
        slope = np.median(np.diff(lr[: end + 1]) / np.diff(steps[: end + 1]))
        peak = float(lr.max())
        cliffs = np.flatnonzero(
            (lr[1:] <= 0.05 * peak) & (lr[:-1] >= 0.1 * peak) & (segs[1:] == segs[:-1]) & (np.arange(1, lr.size) > end)
        )
        findings = []
        for i in cliffs + 1:
            climb = lr[i : i + 1 + self.params["resume_window"]]
            gaps = np.diff(steps[i : i + climb.size])
            if climb.size < 3 or (np.diff(climb) <= 0).any():
                continue
            again = float(np.median(np.diff(climb) / gaps))
            s = int(steps[i])
            findings.append(
                self.finding(
                    "schedule-restarted",
                    "warn",
                    f"the learning rate fell at once from {lr[i - 1]:.3g} at step {steps[i - 1]} to {lr[i]:.3g} at step "
                    f"{s} and climbed again ({again:.3g} per step; the run's first warm-up {slope:.3g}): the "
                    "schedule started over at a resume whose scheduler's state was not restored; resume with the "
                    "checkpoint's scheduler.pt (resume_from_checkpoint restores it)",
                    step=s,
                    resume_step=s,
                    lr_before=float(lr[i - 1]),
                    lr_at_resume=float(lr[i]),
                    warmup_slope=float(slope),
                    slope_again=again,
                    diagnosis="restarted",
                )
            )
        return findings

    def _whole_run_warmup(self, ctx: AuditContext, steps, segs, lr) -> list[Finding]:
        """A warm-up as long as the run (warmup_steps >= max_steps): the LR rises from the first log to its peak at
        the run's end, after it at most the last log (where a linear schedule reaches 0)."""
        last = segs == segs[-1]  # the segment the run ended in
        steps, lr = steps[last], lr[last]
        config = run_config(ctx.manifest)
        planned = positive(config.get("max_steps"))
        interval = positive(config.get("logging_steps")) or 1
        peak = int(np.argmax(lr))
        rise = np.diff(lr[: peak + 1])
        if (
            planned is None
            or steps[-1] < planned - interval  # a run that stopped early: LOOP-24's
            or lr.size - 1 - peak > 1
            or rise.size < 2
            or (rise < 0).any()
            or (rise > 0).sum() < max(2, rise.size // 2)
        ):
            return []
        end = f", then {lr[-1]:.3g} at the last step {steps[-1]:,}" if peak < lr.size - 1 else ""
        return [
            self.finding(
                "endless-warmup",
                "warn",
                f"the learning-rate warm-up lasted the whole run: the LR rose from {lr[0]:.3g} at step {steps[0]:,} to "
                f"its peak {lr[peak]:.3g} at step {steps[peak]:,}{end}, of {int(planned):,} planned steps, so the run never "
                "trained at a settled learning rate nor decayed from it (warmup_steps >= max_steps); make the warm-up a "
                "small part of the run (warmup_ratio 0.03-0.1, or warmup_steps well below max_steps)",
                category="configuration",
                peak_step=int(steps[peak]),
                peak_lr=float(lr[peak]),
                first_lr=float(lr[0]),
                last_step=int(steps[-1]),
                planned=int(planned),
                diagnosis="warmup over the whole run",
            )
        ]
