"""LOOP-11 resume continuity."""

from __future__ import annotations

from pathlib import PurePosixPath

import numpy as np

from .base import AuditContext, Check, Finding, at_least, count
from .resume_state import inspected, missing_state, saved_checkpoints


class ResumeContinuity(Check):
    """Resume continuity (a resume must restore the random seed, data position and scheduler).

    What it detects:
        A resumed run (a new recorder segment whose first step continues an earlier one) that did
        not restore what it resumed: from a checkpoint that was never saved or fails LOOP-09; the
        data position (samples already trained this epoch trained again, the order restarted at
        an epoch's or the dataset's start, another shuffle than the run's); the learning-rate
        schedule (warmup run again, LR dropped to 0); the weights (not the checkpoint's); the
        optimizer state (Adam's step count back to 0).
    Why it matters:
        Forgetting to restore the data position re-reads a stretch of already-trained data: a small,
        unplanned overfitting experiment. A restarted warmup, lost weights or fresh
        optimizer moments waste the steps since the checkpoint and quietly change the run's recipe.
    Statistic:
        Resume point: the new segment's first step r. Data, on the stream of sample ids in training
        order: epochs are inferred from the ids trained before r (an epoch ends where an id comes
        back; epoch length = the median completed epoch, else the dataset's rows), so epochs may
        start mid-batch and the dataset need not fill whole batches. Compared: the ids of the first
        `data_window` resumed steps with the abandoned segment's ids at the same steps (what the
        run would have trained), and those due before the current epoch ends with the ids it
        already trained. Where a re-read begins, the recorded order is searched for the longest
        match to name where the order restarted. LR: relative change between the last LR before r
        and the first after, against the schedule's own largest relative per-step change in the
        `lr_window` steps before r. Weights: per-tensor float64 norms recorded at the segment's
        first step against those recorded when the checkpoint was saved. Optimizer: its step
        count at the segment's first step (Adam-style state). Without a weight fingerprint: the
        median of the first `loss_window` losses after r minus that of the last before it.
    Threshold:
        No checkpoint at step r - 1, or one that fails LOOP-09: fail. Any sample re-read before its
        epoch ends: fail. Another order than the abandoned segment's with nothing re-read: warn;
        the abandoned order further on (batches skipped on purpose, as `replay` lists them): info.
        LR change above max(`lr_tolerance`, 2 x the schedule's recent per-step change): fail. Any
        tensor norm off by more than `weight_tolerance` (relative): fail. Optimizer step count 0
        after a checkpoint of step > 0: fail. Loss rising by more than `loss_jump_fraction` of its
        level (no fingerprint only): warn. Any warn or fail above on a resume from a checkpoint that
        lacks parts of the training state the run needs (as LOOP-09 judges it): one more warn
        (a risk that bit) naming those parts. A run imported from its logs (resumes placed by them: a branch
        abandoned, a plan changed between saved states; two runs sharing a folder are never one resumed run):
        no checkpoint on disk to resume from, or one that now fails LOOP-09, is info (a risk: what the resume
        loaded is not on disk); its learning rate at a resume is LOOP-14's, which knows each segment's plan.
    Evidence:
        The resume step and checkpoint; for data the re-read `sample_ids` with the steps they were
        last trained and re-trained at, the count, the current epoch's start and length, where the order
        restarted; LR before/after and the tolerance; tensors whose weights differ; the optimizer's
        step count; loss before/after; the source checkpoint's `missing_state` and what `broke`.
    """

    code = "LOOP-11"
    name = "resume continuity"
    rules = {
        "resumed-from-incomplete-state": "a resume broke and its checkpoint lacks training state",
        "source-not-on-disk": "no checkpoint the run could have resumed from is on disk",
        "source-not-recorded": "no checkpoint was recorded where the run resumed",
        "source-now-fails-integrity": "the checkpoint the logs place the resume at now fails LOOP-09",
        "source-fails-integrity": "the run resumed from a checkpoint that fails LOOP-09",
        "data-skipped": "the resumed run skipped samples of its order",
        "data-reordered": "the resumed run trained another order than the abandoned run",
        "data-replayed": "the resumed run trained again samples it had already trained in the epoch",
        "scheduler-not-restored": "the learning rate jumped on resume: the scheduler state was not restored",
        "weights-not-restored": "the weights after the resume are not those of the checkpoint",
        "optimizer-not-restored": "the optimizer state was not restored on resume",
        "loss-jump": "the loss jumped when the run resumed",
    }
    needs = ("steps",)
    defaults = {
        "data_window": count(50),
        "lr_window": count(2),
        "lr_tolerance": at_least(0.1, 0),
        "weight_tolerance": at_least(1e-9, 0),
        "loss_window": count(3),
        "loss_jump_fraction": at_least(0.05, 0),
        "max_ids_listed": count(50),
    }

    def run(self, ctx: AuditContext) -> list[Finding]:
        resumes = ctx.con.execute(
            """SELECT seg, min(step) FROM steps WHERE rank = 0 GROUP BY seg HAVING min(step) > 1 AND seg > 0
               ORDER BY seg"""
        ).fetchall()
        if not resumes:
            return []
        checkpoints = saved_checkpoints(ctx)
        # An imported run's logged learning rate at a resume is LOOP-14's: it knows each segment's plan.
        imported = bool(ctx.manifest.get("imported"))
        findings = []
        for seg, first in resumes:
            source, problems = self._source(ctx, checkpoints, seg, first)
            findings += problems
            broke = []
            for what, found in (
                ("data position", self._data(ctx, seg, first)),
                ("learning rate", [] if imported else self._lr(ctx, seg, first)),
                ("weights", self._weights(ctx, seg, first, source)),
                ("optimizer state", self._optimizer(ctx, seg, first, source)),
            ):
                findings += found
                broke += [what] if any(f.severity != "info" for f in found) else []
            findings += self._state_that_bit(ctx, checkpoints, source, first, broke)
        return findings

    def _state_that_bit(
        self, ctx: AuditContext, checkpoints: list[dict], source: dict | None, first: int, broke: list[str]
    ) -> list[Finding]:
        """LOOP-09 states a checkpoint that cannot resume exactly as info (a risk); a resume from it that
        broke is where it bit: a warn naming the parts to save. A continuous resume needs no word about it."""
        if source is None or not broke:
            return []
        lacking = missing_state(ctx, inspected(ctx, checkpoints)).get(source["name"])
        if not lacking:
            return []
        return [
            self.finding(
                "resumed-from-incomplete-state",
                "warn",
                f"the resume at step {first} from {source['name']} broke ({', '.join(broke)}), and "
                f"{source['name']} cannot resume exactly: its training state lacks {', '.join(lacking)}; save them "
                f"with every checkpoint",
                step=first,
                category="risk",
                resume_step=first,
                source_checkpoint=source["name"],
                missing_state=lacking,
                broke=broke,
            )
        ]

    def _source(
        self, ctx: AuditContext, checkpoints: list[dict], seg: int, first: int
    ) -> tuple[dict | None, list[Finding]]:
        config = ctx.scalar("SELECT manifest->'$.config.resume_from' FROM manifest WHERE rank = 0 AND seg = ?", [seg])
        named = PurePosixPath(str(config).strip('"').replace("\\", "/")).name if config not in (None, "null") else None
        # Imported logs place the resume's first step only to its logging window: the source is the last
        # checkpoint saved in the window before it.
        imported = bool(ctx.manifest.get("imported"))
        window = int((ctx.manifest.get("granularity") or {}).get("logging_steps") or 1) if imported else 1
        before = [c for c in checkpoints if first - 1 - window < c["step"] <= first - 1]
        source = (
            next((c for c in checkpoints if c["name"] == named), None)
            if named
            else (max(before, key=lambda c: c["step"]) if before else None)
        )
        if source is None and imported:
            # A folder holding logs and only some checkpoints is no evidence the resume was inexact.
            return None, [
                self.finding(
                    "source-not-on-disk",
                    "info",
                    f"the run resumed at step {first}, but no checkpoint it could have "
                    f"resumed from is on disk; its state cannot be checked",
                    step=first,
                    category="risk",
                    resume_step=first,
                    checkpoint_name=named,
                )
            ]
        if source is None:
            return None, [
                self.finding(
                    "source-not-recorded",
                    "fail",
                    f"the run resumed at step {first} but no checkpoint "
                    f"{named or f'at step {first - 1}'} was recorded; it cannot have resumed "
                    f"exactly",
                    step=first,
                    resume_step=first,
                    checkpoint_name=named,
                )
            ]
        [inspection] = inspected(ctx, [source])
        if inspection.passes:
            return source, []
        problem = next(msg for _, sev, msg, _ in inspection.problems if sev in ("warn", "fail"))
        if imported:
            # The folder as it is now (a copy may leave weights out) says nothing of what the resume loaded.
            return source, [
                self.finding(
                    "source-now-fails-integrity",
                    "info",
                    f"the run resumed at step {first}, from {source['name']} as the logs place it, which now fails "
                    f"LOOP-09 ({problem}); what the resume loaded cannot be checked",
                    step=first,
                    category="risk",
                    resume_step=first,
                    source_checkpoint=source["name"],
                )
            ]
        return source, [
            self.finding(
                "source-fails-integrity",
                "fail",
                f"the run resumed at step {first} from {source['name']}, which fails LOOP-09 ({problem})",
                step=first,
                resume_step=first,
                source_checkpoint=source["name"],
            )
        ]

    # ------------------------------------------------------------------ data position

    def _data(self, ctx: AuditContext, seg: int, first: int) -> list[Finding]:
        window = self.params["data_window"]
        stream = """SELECT step, unnest(sample_ids) AS id, generate_subscripts(sample_ids, 1) AS pos, micro
                    FROM {table} WHERE rank = 0 AND {where}"""
        order = " ORDER BY step, micro, pos"
        history = ctx.frame(stream.format(table="batches", where="step < $first") + order, {"first": first})
        resumed = ctx.frame(
            stream.format(table="batches", where="seg = $seg AND step < $first + $window") + order,
            {"seg": seg, "first": first, "window": window},
        )
        if history.is_empty() or resumed.is_empty():
            return []
        abandoned = self._abandoned(ctx, first, window, stream + order)
        ids, codes = np.unique(
            np.concatenate([history["id"].to_numpy(), resumed["id"].to_numpy(), abandoned["id"].to_numpy()]),
            return_inverse=True,
        )
        past, now = codes[: len(history)], codes[len(history) : len(history) + len(resumed)]
        then = codes[len(history) + len(resumed) :]
        past_steps, now_steps = history["step"].to_numpy(), resumed["step"].to_numpy()

        # Same ids at the same steps as the abandoned segment: the order was restored exactly.
        overlap = min(len(then), len(now))
        differs = np.flatnonzero(then[:overlap] != now[:overlap])
        if overlap and not differs.size:
            return []
        # Duplicate rows (same id or content hash) come back within an epoch: number their occurrences.
        numbered = numbered_occurrences(np.concatenate([past, now]), len(past))
        past_n, now_n = numbered[: len(past)], numbered[len(past) :]
        starts = epoch_starts(past_n)
        lengths = np.diff(starts)
        rows = ctx.scalar("SELECT manifest->>'$.dataset.rows' FROM manifest WHERE rank = 0 AND seg = ?", [seg])
        epoch_length = int(np.median(lengths)) if lengths.size else int(rows) if rows else None
        begun = int(starts[-1])
        left_in_epoch = max(epoch_length - (len(past) - begun), 0) if epoch_length else len(now)
        reread = np.flatnonzero(np.isin(now_n[:left_in_epoch], past_n[begun:]))
        epoch = {
            "current_epoch": len(starts),
            "epoch_started_at_step": int(past_steps[begun]),
            "epoch_length": epoch_length,
        }
        if not reread.size:
            if not differs.size:
                return []
            skipped = skipped_ahead(then, now)
            if skipped:  # the abandoned order, further on: batches skipped on purpose (as `replay` advises)
                left = abandoned["step"].to_numpy()
                return [
                    self.finding(
                        "data-skipped",
                        "info",
                        f"the run resumed at step {first} {skipped} sample(s) further in its order than the "
                        f"abandoned run (the batches of steps {left[0]}-{left[skipped - 1]} skipped)",
                        step=first,
                        resume_step=first,
                        skipped=skipped,
                        skipped_steps=np.unique(left[:skipped]).tolist(),
                    )
                ]
            at = int(differs[0])
            return [
                self.finding(
                    "data-reordered",
                    "warn",
                    f"after resuming at step {first} the run trained another order than the abandoned run did "
                    f"at the same steps (from step {now_steps[at]}: {ids[now[at]]} instead of {ids[then[at]]}); "
                    f"restore the sampler's seed and state",
                    step=int(now_steps[at]),
                    resume_step=first,
                    differing=int(differs.size),
                    compared=overlap,
                    **epoch,
                )
            ]
        restart = self._restart(past, now[reread[0] :], starts, past_steps)
        # A restarted order trains the whole matched stretch again, past the epoch's end too.
        reread = np.union1d(reread, np.arange(reread[0], reread[0] + restart["length"]))
        trained_at = last_occurrence(past)
        listed = reread[: self.params["max_ids_listed"]]
        steps = np.unique(now_steps[reread]).tolist()
        return [
            self.finding(
                "data-replayed",
                "fail",
                f"after resuming at step {first} the run trained {reread.size} sample(s) again that it had "
                f"already trained in epoch {len(starts)} (begun at step {epoch['epoch_started_at_step']}), at steps "
                f"{steps[0]}-{steps[-1]}; {restart['text']}: restore the data position (epoch, index in the epoch, "
                f"sampler seed)",
                step=steps[0],
                resume_step=first,
                sample_ids=ids[now[listed]].tolist(),
                count=int(reread.size),
                steps=steps,
                restarted_at_step=restart["step"],
                restarted_at=restart["where"],
                trained_this_epoch=len(past) - begun,
                differing_from_abandoned=int(differs.size),
                **epoch,
                reread=[
                    {
                        "sample_id": ids[now[k]],
                        "reread_at": int(now_steps[k]),
                        "last_trained_at": int(past_steps[trained_at[now[k]]]),
                    }
                    for k in listed
                ],
            )
        ]

    def _abandoned(self, ctx: AuditContext, first: int, window: int, sql: str):
        """What the segment the resume left trained at the resumed steps (empty if it stopped at the checkpoint)."""
        if not ctx.scalar("SELECT count(*) FROM information_schema.tables WHERE table_name = 'superseded_batches'"):
            return ctx.frame("SELECT 0::BIGINT AS step, ''::VARCHAR AS id WHERE false")
        left = ctx.scalar("SELECT max(seg) FROM batches WHERE rank = 0 AND step < ?", [first])
        return ctx.frame(
            sql.format(table="superseded_batches", where="seg = $left AND step >= $first AND step < $first + $window"),
            {"left": left, "first": first, "window": window},
        )

    @staticmethod
    def _restart(past: np.ndarray, replayed: np.ndarray, starts: np.ndarray, steps: np.ndarray) -> dict:
        """Where in the recorded order the re-read stretch comes from: the longest exact match."""
        candidates = np.flatnonzero(past == replayed[0])  # one per epoch at most: a short loop
        spans = [min(len(replayed), len(past) - q) for q in candidates]
        matches = [int(np.argmin(np.append(past[q : q + n] == replayed[:n], False))) for q, n in zip(candidates, spans)]
        # The stretch matched furthest (relative to what could match); ties go to the latest epoch.
        scores = [(m / n if m >= 2 else 0.0, q) for m, n, q in zip(matches, spans, candidates)]
        best = max(range(len(scores)), key=lambda i: scores[i]) if scores else None
        if best is None or not scores[best][0]:
            return {
                "text": "its order is another shuffle than the run's",
                "step": None,
                "where": "other order",
                "length": 0,
            }
        q = int(candidates[best])
        step = int(steps[q])
        if q == 0:
            where = "the dataset's start"
        elif q in starts:
            where = f"the start of epoch {int(np.searchsorted(starts, q)) + 1}"
        else:
            where = f"the order of step {step}"
        return {
            "text": f"the order restarted at {where} (step {step})" if q in starts else f"it picked up {where} again",
            "step": step,
            "where": where,
            "length": matches[best],
        }

    # ------------------------------------------------------------------ schedule, weights, optimizer

    def _lr(self, ctx: AuditContext, seg: int, first: int) -> list[Finding]:
        before = ctx.frame(
            """SELECT step, lr FROM steps WHERE rank = 0 AND seg < ? AND step < ? AND lr IS NOT NULL
               ORDER BY step DESC LIMIT ?""",
            [seg, first, self.params["lr_window"] + 1],
        )
        after = ctx.row("SELECT lr FROM steps WHERE rank = 0 AND seg = ? AND step = ? AND lr IS NOT NULL", [seg, first])
        if before.is_empty() or after is None or not before["lr"][0]:
            return []
        lrs = before["lr"].to_numpy()[::-1]
        last, now = float(lrs[-1]), float(after[0])
        steps = np.abs(np.diff(lrs)) / np.where(lrs[:-1] != 0, lrs[:-1], np.inf)
        pace = float(steps.max(initial=0.0))
        tolerance = max(self.params["lr_tolerance"], 2 * pace)
        change = abs(now - last) / last
        if change <= tolerance:
            return []
        what = (
            "dropping to 0"
            if now == 0
            else "restarting its schedule (warmup run again)"
            if now < last
            else "jumping ahead of its schedule"
        )
        return [
            self.finding(
                "scheduler-not-restored",
                "fail",
                f"the learning rate went from {last:.3g} at step {first - 1} to {now:.3g} at step {first} on "
                f"resume, {what}; the scheduler state was not restored from the checkpoint",
                step=first,
                resume_step=first,
                lr_before=last,
                lr_after=now,
                value=change,
                threshold=tolerance,
            )
        ]

    def _segment_start(self, ctx: AuditContext, seg: int) -> tuple | None:
        return ctx.row(
            """SELECT param_norms, optimizer_step FROM events WHERE rank = 0 AND seg = ?
                          AND kind = 'segment_start' ORDER BY step LIMIT 1""",
            [seg],
        )

    def _weights(self, ctx: AuditContext, seg: int, first: int, source: dict | None) -> list[Finding]:
        start = self._segment_start(ctx, seg)
        saved = (
            ctx.row(
                """SELECT param_norms FROM checkpoints WHERE rank = 0 AND event = 'saved' AND path = ?
                           ORDER BY seg DESC LIMIT 1""",
                [source["path"]],
            )
            if source
            else None
        )
        if not (start and start[0] and saved and saved[0]) or len(start[0]) != len(saved[0]):
            return self._loss(ctx, seg, first)
        now, then = np.asarray(start[0], dtype=float), np.asarray(saved[0], dtype=float)
        off = np.abs(now - then) / np.maximum(np.abs(then), 1e-12)
        differing = np.flatnonzero(off > self.params["weight_tolerance"])
        if not differing.size:
            return []
        names = dict(
            ctx.con.execute(
                "SELECT idx, name FROM params WHERE rank = 0 AND seg = ? AND idx IS NOT NULL", [seg]
            ).fetchall()
        )
        worst = differing[np.argsort(-off[differing])][: self.params["max_ids_listed"]]
        return [
            self.finding(
                "weights-not-restored",
                "fail",
                f"the weights at step {first} are not those of {source['name']}, which the run resumed from: "
                f"{differing.size} of {len(now)} tensors differ (e.g. {names.get(int(worst[0]), int(worst[0]))}, norm "
                f"{now[worst[0]]:.6g} vs {then[worst[0]]:.6g} saved); the checkpoint's weights were not loaded",
                step=first,
                resume_step=first,
                source_checkpoint=source["name"],
                count=int(differing.size),
                tensors=[names.get(int(i), str(int(i))) for i in worst],
                value=float(off.max()),
                threshold=self.params["weight_tolerance"],
            )
        ]

    def _optimizer(self, ctx: AuditContext, seg: int, first: int, source: dict | None) -> list[Finding]:
        start = self._segment_start(ctx, seg)
        if not start or start[1] is None or source is None or start[1] > 0 or source["step"] == 0:
            return []
        return [
            self.finding(
                "optimizer-not-restored",
                "fail",
                f"the optimizer state was not restored at step {first}: its step count is 0 although "
                f"{source['name']} was saved after {source['step']} steps, so Adam's moments start empty and the first "
                f"updates are full-size; load the optimizer state from the checkpoint",
                step=first,
                resume_step=first,
                source_checkpoint=source["name"],
                optimizer_step=int(start[1]),
                checkpoint_step=source["step"],
            )
        ]

    def _loss(self, ctx: AuditContext, seg: int, first: int) -> list[Finding]:
        k = self.params["loss_window"]
        row = ctx.row(
            """SELECT (SELECT median(loss) FROM (SELECT loss FROM steps WHERE rank = 0 AND seg < $seg AND step < $first
                         AND isfinite(loss) ORDER BY step DESC LIMIT $k)),
                      (SELECT median(loss) FROM (SELECT loss FROM steps WHERE rank = 0 AND seg = $seg
                         AND isfinite(loss) ORDER BY step LIMIT $k))""",
            {"seg": seg, "first": first, "k": k},
        )
        before, after = row
        if before is None or after is None:
            return []
        # Upward only: training lowers the loss, fast at times; a resume that lost state raises it.
        threshold = self.params["loss_jump_fraction"] * abs(before)
        jump = after - before
        if jump <= threshold:
            return []
        return [
            self.finding(
                "loss-jump",
                "warn",
                f"the loss jumped from {before:.3f} to {after:.3f} when the run resumed at step {first} (median of "
                f"{k} steps each side); check that weights and optimizer state were restored",
                step=first,
                resume_step=first,
                loss_before=before,
                loss_after=after,
                value=jump,
                threshold=threshold,
            )
        ]


def skipped_ahead(abandoned: np.ndarray, resumed: np.ndarray) -> int:
    """How many samples of the abandoned order the resumed one starts past (0 if it is not that order)."""
    for offset in np.flatnonzero(abandoned == resumed[0])[:1]:  # ids are unique within an epoch
        n = min(len(abandoned) - offset, len(resumed))
        if offset and np.array_equal(abandoned[offset : offset + n], resumed[:n]):
            return int(offset)
    return 0


def numbered_occurrences(codes: np.ndarray, known: int) -> np.ndarray:
    """Ids made unique within an epoch: an id the first `known` positions hold m times as often as
    an epoch's share (a duplicated row, or its content hash) becomes m ids, taken in turn."""
    counts = np.bincount(codes[:known], minlength=int(codes.max(initial=0)) + 1)
    epochs = max(known / max(int(np.count_nonzero(counts)), 1), 1.0)
    copies = np.maximum(np.rint(counts / epochs), 1).astype(np.int64)
    order = np.argsort(codes, kind="stable")
    ordered = codes[order]
    group_start = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    occurrence = np.empty(len(codes), dtype=np.int64)
    occurrence[order] = np.arange(len(codes)) - np.repeat(group_start, np.diff(np.r_[group_start, len(codes)]))
    return codes * int(copies.max(initial=1)) + occurrence % copies[codes]


def epoch_starts(codes: np.ndarray) -> np.ndarray:
    """Where each epoch of a stream of sample ids starts: an epoch ends where one of its ids comes back."""
    previous = previous_occurrence(codes)
    starts = [0]
    while True:  # one pass per epoch
        back = np.flatnonzero(previous[starts[-1] :] >= starts[-1])
        if not back.size:
            return np.asarray(starts)
        starts.append(starts[-1] + int(back[0]))


def previous_occurrence(codes: np.ndarray) -> np.ndarray:
    """For each position, the position where the same id was last seen before it (-1 if never)."""
    order = np.argsort(codes, kind="stable")
    ordered = codes[order]
    same = ordered[1:] == ordered[:-1]
    previous = np.full(len(codes), -1)
    previous[order[1:][same]] = order[:-1][same]
    return previous


def last_occurrence(codes: np.ndarray) -> np.ndarray:
    """Per id code, the last position where it occurs (-1 if never), indexable by code."""
    out = np.full(int(codes.max(initial=-1)) + 1, -1)
    out[codes] = np.arange(len(codes))  # repeated indices: the last assignment stands
    return out
