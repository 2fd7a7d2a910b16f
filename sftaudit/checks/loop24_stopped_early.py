"""LOOP-24 a run that ended before its plan."""

from __future__ import annotations

import json

from .base import AuditContext, CannotJudge, Check, Finding
from .stats.rolling import positive, run_config


class StoppedEarly(Check):
    """Run ended before its plan (trigger point: the end of the evidence).

    What it detects:
        A run whose last record (a logged or recorded step, a metric, a checkpoint) is short of its planned
        length by more than one logging interval: a DPO log that ends at step 202 of 5,100 planned, a shim run
        killed at step 3 of 80 with no close record.
    Why it matters:
        A run that stopped early is not the model its plan describes: its learning rate never decayed, it saw a
        fraction of the data, and what it left may be a checkpoint from the middle of an epoch. A truncated run
        is never a plain pass, and it is not a step where training went wrong either (a risk, not an anomaly):
        find out why it stopped, and resume it or accept the shorter run deliberately.
    Statistic:
        Planned length: the manifest's `max_steps` (the Trainer's, LLaMA-Factory's `total_steps`), else
        `num_train_epochs` x steps per epoch (from the logged `epoch`). Last step: the highest step of any
        record. Tolerance: one logging interval (`logging_steps`, else the smallest gap between logged steps).
        A shim run that closed cleanly (a `close` event) ended on purpose (an early stop), unless its close says the
        shim's guard stopped it (`halted`: a non-finite loss or gradient, or a stop request); so did an imported run
        whose newest trainer state says the Trainer was told to stop (`should_training_stop`: early stopping, a
        callback). An imported run whose only log is a checkpoint's trainer state (the import's
        `log_ends_at_checkpoint` note) may have gone on after it: that is said, not a crash.
    Threshold:
        Planned - last > tolerance: warn (info when the shim recorded a clean close, or the Trainer was told to
        stop; warn again when the guard stopped it). No planned length recorded: not judged.
    Evidence:
        The last step, the planned length and where it came from, the share done, whether the run closed; what
        stopped it (the guard's `halted` record), or the checkpoint the log ends with.
    """

    code = "LOOP-24"
    name = "run ended before its plan"
    needs = (("steps", "metrics", "checkpoints"),)

    def run(self, ctx: AuditContext) -> list[Finding]:
        config = run_config(ctx.manifest)
        last = ctx.scalar(
            "SELECT max(step) FROM (SELECT max(step) AS step FROM steps WHERE rank = 0 "
            "UNION ALL SELECT max(step) FROM metrics WHERE rank = 0 "
            "UNION ALL SELECT max(step) FROM checkpoints WHERE rank = 0)"
        )
        if last is None:
            raise CannotJudge("no step recorded")
        planned, source = self._planned(ctx, config)
        if planned is None:
            raise CannotJudge("no planned length recorded (max_steps, total_steps or num_train_epochs)")
        interval = (
            positive(config.get("logging_steps"))
            or ctx.scalar(
                "SELECT min(d) FROM (SELECT step - lag(step) OVER (ORDER BY step) AS d FROM steps WHERE rank = 0) WHERE d > 0"
            )
            or 1
        )
        if planned - last <= interval:
            return []
        closed = not ctx.manifest.get("imported") and bool(
            ctx.scalar("SELECT count(*) FROM events WHERE rank = 0 AND kind = 'close'")
        )
        share = last / planned
        evidence = {
            "step": last,
            "category": "risk",
            "last_step": last,
            "planned": planned,
            "planned_from": source,
            "share": share,
            "closed": closed,
            "resolution": self._where(last),
        }
        halted = self._halted(ctx) if closed else None
        if halted:
            kept = f"; {halted['kept_from']} was kept as {halted['kept']}" if halted.get("kept") else ""
            return [
                self.finding(
                    "warn",
                    f"sftaudit's guard stopped the run at step {last:,} of {planned:,} planned ({share:.0%}): "
                    f"{halted.get('reason')}{kept}; it did not complete: fix the cause and resume from a checkpoint "
                    "before the first bad step",
                    halted=halted,
                    **evidence,
                )
            ]
        if closed:
            return [
                self.finding(
                    "info",
                    f"the run closed at step {last:,} of {planned:,} planned ({share:.0%}): it was stopped on purpose "
                    "(an early stop or a shortened run)",
                    **evidence,
                )
            ]
        imported = bool(ctx.manifest.get("imported"))
        if imported:
            found = self._imported(ctx, last, planned, share, interval, evidence)
            if found:
                return found
        return [
            self.finding(
                "warn",
                f"the run stopped at step {last:,} of {planned:,} planned ({share:.0%})"
                + (" and did not close" if not imported else "")
                + ": it crashed, was killed or was interrupted; find why, and resume it from its last checkpoint or "
                "accept the shorter run deliberately (its learning rate never finished its schedule)",
                tolerance=interval,
                **evidence,
            )
        ]

    def _imported(self, ctx: AuditContext, last, planned, share, interval, evidence) -> list[Finding]:
        """What an imported run's files say of its end: the Trainer told to stop (a callback: early stopping), or
        a log that ends with a checkpoint's state (nothing written after it is in the folder)."""
        trainer = (ctx.manifest.get("config") or {}).get("trainer_state") or {}
        early = trainer.get("early_stopping") or {}
        if trainer.get("should_training_stop"):
            patience, counter = early.get("patience"), early.get("counter")
            by = (
                f"early stopping: {counter} evaluation(s) in a row without improvement, patience {patience}"
                if isinstance(patience, int) and isinstance(counter, int) and counter >= patience
                else "a callback set should_training_stop"
            )
            return [
                self.finding(
                    "info",
                    f"the run stopped at step {last:,} of {planned:,} planned ({share:.0%}) because the Trainer was told "
                    f"to ({by}): it was stopped on purpose",
                    stopped_by=by,
                    **evidence,
                )
            ]
        notes = {n.get("key"): n for n in ctx.manifest.get("notes") or [] if isinstance(n, dict)}
        at = notes.get("log_ends_at_checkpoint")
        if at is None:
            return []
        return [
            self.finding(
                "warn",
                f"the log ends at step {last:,} of {planned:,} planned ({share:.0%}), with {at['checkpoint']}: this folder "
                "holds no log written after that checkpoint (no trainer_state.json at its top, no trainer_log.jsonl or "
                f"event file), so whether the run stopped there or went on is not on disk; find its later log or "
                f"checkpoints, or take {at['checkpoint']} as the run's end (its learning rate had not finished its "
                "schedule)",
                tolerance=interval,
                log_ends_with=at["checkpoint"],
                **evidence,
            )
        ]

    @staticmethod
    def _halted(ctx: AuditContext) -> dict | None:
        """Why the guard stopped the run, from the latest close record (a resumed run's own close decides)."""
        row = ctx.row("SELECT halted FROM events WHERE rank = 0 AND kind = 'close' ORDER BY seg DESC LIMIT 1")
        try:
            halted = json.loads(row[0]) if row and row[0] else None
        except (TypeError, ValueError):
            return None
        return halted if isinstance(halted, dict) else None

    @staticmethod
    def _where(last: int) -> dict:
        # The step is the last record itself, not a logging window it stands for.
        return {"kind": "last record", "first_step": last, "last_step": last}

    @staticmethod
    def _planned(ctx: AuditContext, config: dict) -> tuple[int | None, str | None]:
        for key in ("max_steps", "total_steps"):
            v = positive(config.get(key))
            if v is not None:
                return int(v), key
        epochs = positive(config.get("num_train_epochs"))
        if epochs is None or epochs > 1e6:  # sys.maxsize: the Trainer's "no epoch limit"
            return None, None
        row = ctx.row(
            "SELECT arg_max(step, value), max(value) FROM metrics WHERE rank = 0 AND name = 'epoch' AND value > 0"
        )
        if not row or row[0] is None or not row[1]:
            return None, None
        return int(round(epochs * row[0] / row[1])), "num_train_epochs x steps per epoch"
