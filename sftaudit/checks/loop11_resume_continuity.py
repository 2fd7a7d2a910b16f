"""LOOP-11 resume continuity."""

from __future__ import annotations

from pathlib import PurePosixPath

from .base import AuditContext, Check, Finding
from .loop09_checkpoint_integrity import CheckpointIntegrity, saved_checkpoints


class ResumeContinuity(Check):
    """Resume continuity (seed 003, 3.3 and 7.1: resume must restore seed, data position and scheduler).

    What it detects:
        A resumed run (a new recorder segment whose first step continues an earlier one) that
        did not resume cleanly: from a checkpoint that was never saved or fails LOOP-09; with
        the data order restarted (samples of the current epoch trained again right after the
        resume); with the learning-rate schedule restarted (its warmup run again); with a jump
        up in the loss curve (weights or optimizer state not restored).
    Why it matters:
        "I forgot to restore the data position and re-read a stretch of already-trained data,
        a small overfitting experiment" (seed 003). A restarted warmup or lost weights waste the
        steps since the checkpoint and quietly change the run's recipe.
    Statistic:
        Resume point c = the new segment's first step - 1. Data: sample ids trained in the
        `data_window` steps after c that the run already trained at a step <= c in the same
        epoch (epoch length = dataset rows / rows per step, from the manifest and batches).
        LR: relative change between the last LR before c and the first after, against the
        schedule's own largest relative per-step change in the `lr_window` steps before c.
        Loss: median of the first `loss_window` losses after c minus the median of the last
        `loss_window` before it.
    Threshold:
        No checkpoint at step c, or one that fails LOOP-09: fail. Any re-read sample: fail.
        LR change above max(`lr_tolerance`, 2 x the schedule's recent per-step change): fail.
        Loss rising by more than `loss_jump_fraction` of its level: warn (a fall is what
        training does, sometimes fast: not a finding).
    Evidence:
        The resume step and checkpoint, `sample_ids` re-read with the steps they were first
        trained and re-read at, LR before/after and the tolerance, loss before/after.
    """

    code = "LOOP-11"
    name = "resume continuity"
    defaults = {"data_window": 50, "lr_window": 10, "lr_tolerance": 0.1, "loss_window": 3,
                "loss_jump_fraction": 0.05, "max_ids_listed": 50}

    def run(self, ctx: AuditContext) -> list[Finding]:
        resumes = ctx.con.execute(
            """SELECT seg, min(step) FROM steps WHERE rank = 0 GROUP BY seg HAVING min(step) > 1 AND seg > 0
               ORDER BY seg""").fetchall()
        if not resumes:
            return []
        checkpoints = saved_checkpoints(ctx)
        findings = []
        for seg, first in resumes:
            findings += self._source(ctx, checkpoints, seg, first)
            findings += self._data(ctx, seg, first)
            findings += self._lr(ctx, seg, first)
            findings += self._loss(ctx, seg, first)
        return findings

    def _source(self, ctx: AuditContext, checkpoints: list[dict], seg: int, first: int) -> list[Finding]:
        config = ctx.scalar("SELECT manifest->'$.config.resume_from' FROM manifest WHERE rank = 0 AND seg = ?", [seg])
        named = PurePosixPath(str(config).strip('"').replace("\\", "/")).name if config not in (None, "null") else None
        source = next((c for c in checkpoints if c["name"] == named), None) if named else \
            next((c for c in checkpoints if c["step"] == first - 1), None)
        if source is None:
            return [self.finding("fail", f"the run resumed at step {first} but no checkpoint "
                                 f"{named or f'at step {first - 1}'} was recorded; it cannot have resumed exactly",
                                 step=first, resume_step=first, checkpoint_name=named)]
        inspection = CheckpointIntegrity().inspect(ctx, source)
        if inspection.passes:
            return []
        problem = next(msg for sev, msg, _ in inspection.problems if sev in ("warn", "fail"))
        return [self.finding("fail", f"the run resumed at step {first} from {source['name']}, which fails "
                             f"LOOP-09 ({problem})", step=first, resume_step=first, source_checkpoint=source["name"])]

    def _data(self, ctx: AuditContext, seg: int, first: int) -> list[Finding]:
        rows = ctx.scalar("SELECT manifest->>'$.dataset.rows' FROM manifest WHERE rank = 0 AND seg = ?", [seg])
        per_step = ctx.scalar("""SELECT median(r) FROM (SELECT step, sum(rows) AS r FROM batches
                                 WHERE rank = 0 AND seg = ? GROUP BY step)""", [seg])
        epoch = int(rows) // int(per_step) if rows and per_step else None
        epoch = epoch or 1 << 62  # unknown dataset size: one long epoch
        reread = ctx.frame(
            """
            WITH history AS (
                SELECT step, unnest(sample_ids) AS id FROM (
                    SELECT step, sample_ids FROM batches WHERE rank = 0 AND seg < $seg AND step < $first)),
            resumed AS (
                SELECT step, micro, unnest(sample_ids) AS id, generate_subscripts(sample_ids, 1) AS pos
                FROM batches WHERE rank = 0 AND seg = $seg AND step < $first + $window)
            SELECT r.id AS sample_id, r.step AS reread_at, min(h.step) AS first_trained_at
            FROM resumed r JOIN history h ON r.id = h.id AND (r.step - 1) // $epoch = (h.step - 1) // $epoch
            GROUP BY r.id, r.step, r.micro, r.pos
            QUALIFY row_number() OVER (PARTITION BY r.id ORDER BY r.step) = 1
            ORDER BY r.step, r.micro, r.pos
            """, {"seg": seg, "first": first, "window": self.params["data_window"], "epoch": epoch})
        if reread.is_empty():
            return []
        steps = sorted(set(reread["reread_at"].to_list()))
        ids = reread["sample_id"].to_list()
        return [self.finding(
            "fail", f"after resuming at step {first} the run trained {len(ids)} sample(s) again that it had already "
            f"trained this epoch (steps {steps[0]}-{steps[-1]}); the data position was not restored",
            step=steps[0], resume_step=first, sample_ids=ids[: self.params["max_ids_listed"]], count=len(ids),
            steps=steps, reread=reread.head(self.params["max_ids_listed"]).to_dicts())]

    def _lr(self, ctx: AuditContext, seg: int, first: int) -> list[Finding]:
        before = ctx.frame(
            """SELECT step, lr FROM steps WHERE rank = 0 AND seg < ? AND step < ? AND lr IS NOT NULL
               ORDER BY step DESC LIMIT ?""",
            [seg, first, self.params["lr_window"] + 1])
        after = ctx.row("SELECT lr FROM steps WHERE rank = 0 AND seg = ? AND step = ? AND lr IS NOT NULL", [seg, first])
        if before.is_empty() or after is None or not before["lr"][0]:
            return []
        lrs = before["lr"].to_numpy()[::-1]
        last, now = float(lrs[-1]), float(after[0])
        pace = float(max((abs(b - a) / a for a, b in zip(lrs, lrs[1:]) if a), default=0.0))
        tolerance = max(self.params["lr_tolerance"], 2 * pace)
        change = abs(now - last) / last
        if change <= tolerance:
            return []
        what = "restarting its schedule (warmup run again)" if now < last else "jumping ahead of its schedule"
        return [self.finding(
            "fail", f"the learning rate went from {last:.3g} at step {first - 1} to {now:.3g} at step {first} on "
            f"resume, {what}; restore the scheduler state from the checkpoint", step=first, resume_step=first,
            lr_before=last, lr_after=now, value=change, threshold=tolerance)]

    def _loss(self, ctx: AuditContext, seg: int, first: int) -> list[Finding]:
        k = self.params["loss_window"]
        row = ctx.row(
            """SELECT (SELECT median(loss) FROM (SELECT loss FROM steps WHERE rank = 0 AND seg < $seg AND step < $first
                         AND isfinite(loss) ORDER BY step DESC LIMIT $k)),
                      (SELECT median(loss) FROM (SELECT loss FROM steps WHERE rank = 0 AND seg = $seg
                         AND isfinite(loss) ORDER BY step LIMIT $k))""", {"seg": seg, "first": first, "k": k})
        before, after = row
        if before is None or after is None:
            return []
        # Upward only: training lowers the loss, fast at times; a resume that lost state raises it.
        threshold = self.params["loss_jump_fraction"] * abs(before)
        jump = after - before
        if jump <= threshold:
            return []
        return [self.finding(
            "warn", f"the loss jumped from {before:.3f} to {after:.3f} when the run resumed at step {first} (median of "
            f"{k} steps each side); check that weights and optimizer state were restored", step=first,
            resume_step=first, loss_before=before, loss_after=after, value=jump, threshold=threshold)]

