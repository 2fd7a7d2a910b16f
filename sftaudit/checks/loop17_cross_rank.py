"""LOOP-17 cross-rank consistency."""

from __future__ import annotations

import numpy as np

from .base import AuditContext, Check, Finding, at_least, count, positive
from .stats.rolling import adaptive_window, previous_block_stats, robust_z

# The inter-rank loss spread's sigma is the median over this many previous blocks (as LOOP-05's).
SIGMA_BLOCKS = 4


class CrossRankConsistency(Check):
    """Cross-rank consistency of a distributed run (trigger points: every step, every save).

    What it detects:
        A rank that stops recording while the others go on (dead, hung or desynchronised), and
        the gradient norms its missing pieces leave incomplete; replicated gradients (DDP, FSDP
        NO_SHARD) that differ between ranks, from step 1 when gradients are not synchronised at
        all; data-parallel replicas whose weights differ at a checkpoint (silent data corruption:
        DDP never re-broadcasts weights, so the divergence is permanent); data-parallel ranks
        training the same sample ids at the same step (an unsharded sampler or
        IterableDataset); a framework total gradient norm (the Trainer's logged `grad_norm`, a
        loop's `clip_grad_norm_` return) that is not the whole model's (FSDP clipped
        with the plain `clip_grad_norm_`, which sees each rank's shards only); a non-finite local
        loss on some ranks while the others' is finite, pinned to its rank; a finite local loss on
        one rank far outside the usual spread between the ranks (a bad batch or a bad device on that
        rank), pinned to its rank. Per-rank token counts against the loss averaging are LOOP-13's.
    Why it matters:
        After the all-reduce every rank sees the same NaN or the same corrupted gradient; only the
        per-rank records taken before it say which rank (device, data shard) it came from. A
        replica that diverged or a rank that trains its neighbour's samples leaves every
        single-process statistic looking normal.
    Statistic:
        From each rank's records (the shim writes each parameter's local piece and its layout, see
        `sftaudit.store.ingest`): recorded steps per rank; per replicated tensor and step, the distinct
        gradient norms across ranks (float32 norms of identical tensors are bit-identical); per
        replicated tensor at each save, the integer bit-sum fingerprint of the weights per rank
        (exact, independent of summation order); per step, the sample ids that more than one rank
        trained; per step and rank, |logged total / reduced total - 1|, where under post-clip
        recording (the Trainer) the reduced total is compared with
        logged x min(1, max_grad_norm / (logged + 1e-6)); the first step with a non-finite loss.
        Outlying local loss: per step, the spread s = max over ranks of |log loss_r - median over
        ranks of log loss| (with two ranks a cross-section cannot say which rank is off, so s is
        judged against the run's own history of it): z = (s - median) / max(sigma, `loss_spread_floor`),
        median and sigma (1.4826 x MAD, the median over the previous 4 blocks) of s over the
        previous block of `window` steps (default: run length / 16, at least 8); the rank named is
        the one whose loss is furthest (ratio) from its own median over that block.
    Threshold:
        Any rank stopping before the last recorded step: fail at the first step it missed.
        Replicated gradients differing: fail at the first step (message says "not synchronised"
        when it is step 1 of the run). Fingerprints differing at a save: fail at that save's step.
        Shared sample ids at a step: fail at the first such step. Total gradient norm off by more
        than `total_norm_rtol` (1e-3): fail at the first step. Non-finite local loss on a strict
        subset of the ranks: fail at that step, naming the ranks. Outlying local loss: z >=
        `loss_sigma` (6) and the rank's loss >= `loss_min_ratio` (3) times, or <= 1/3 of, its own
        median: warn at the first such step, naming the rank and the samples it trained there.
    Evidence:
        Steps recorded per rank; the tensors, ranks and values that differ; the shared sample ids
        (up to `max_ids_listed`); logged and reduced totals; the losses of every rank at that step;
        for an outlying loss, its rank's baseline, the ratio, z and the sample ids it trained.
    """

    code = "LOOP-17"
    name = "cross-rank consistency"
    rules = {
        "rank-missing": "a rank stopped or missed steps while the others went on",
        "gradients-differ": "replicated gradients differ across ranks",
        "weights-differ": "data-parallel replicas hold different weights at a save",
        "data-not-sharded": "ranks trained the same samples",
        "clip-norm-local": "the framework clipped by a norm it did not compute over all shards",
        "rank-non-finite-loss": "one rank's local loss became non-finite while the others' stayed finite",
        "rank-loss-outlier": "one rank's local loss stood far outside the usual spread between ranks",
    }
    needs = ("steps",)
    defaults = {
        "total_norm_rtol": at_least(1e-3, 0),
        "max_ids_listed": count(10),
        "max_tensors_listed": count(20),
        "loss_sigma": positive(6.0),
        "loss_min_ratio": at_least(3.0, 1),
        "loss_spread_floor": at_least(float(np.log(1.05)), 0),
        "window": count(None, low=2),
    }

    def run(self, ctx: AuditContext) -> list[Finding]:
        if (ctx.scalar("SELECT count(DISTINCT rank) FROM manifest") or 0) < 2:
            return []
        return (
            self._stopped_ranks(ctx)
            + self._replicated_gradients(ctx)
            + self._replica_weights(ctx)
            + self._shared_samples(ctx)
            + self._framework_total(ctx)
            + self._local_loss(ctx)
            + self._outlying_loss(ctx)
        )

    def _stopped_ranks(self, ctx: AuditContext) -> list[Finding]:
        rows = ctx.con.execute("""
            WITH ranks AS (SELECT DISTINCT rank FROM manifest),
                 all_steps AS (SELECT DISTINCT step FROM steps)
            SELECT r.rank, min(a.step) AS first_missing, count(*) AS missing,
                   (SELECT max(step) FROM steps s WHERE s.rank = r.rank) AS last
            FROM ranks r CROSS JOIN all_steps a
            WHERE NOT EXISTS (SELECT 1 FROM steps s WHERE s.rank = r.rank AND s.step = a.step)
            GROUP BY r.rank ORDER BY first_missing, r.rank""").fetchall()
        if not rows:
            return []
        per_rank = dict(ctx.con.execute("SELECT rank, count(*) FROM steps GROUP BY rank").fetchall())
        incomplete = ctx.row("""
            SELECT count(DISTINCT step), min(step) FROM grad_pieces p
            WHERE NOT EXISTS (SELECT 1 FROM grad_norms g WHERE g.rank = p.rank AND g.seg = p.seg
                              AND g.step = p.step AND g.idx = p.idx)""")
        rank, first, missing, last = rows[0]
        stopped = last is not None and last < first
        names = ", ".join(str(r[0]) for r in rows)
        return [
            self.finding(
                "rank-missing",
                "fail",
                f"rank {rank} {'stopped recording after step ' + str(last) if stopped else 'missed step ' + str(first)} "
                f"while other ranks went on ({missing} step(s) missing; ranks affected: {names}); a dead, hung or "
                f"desynchronised rank: check its log at step {first}"
                + (
                    f"; {incomplete[0]} step(s) from step {incomplete[1]} have sharded gradient norms with pieces missing, "
                    f"left unjudged"
                    if incomplete and incomplete[0]
                    else ""
                ),
                step=first,
                rank=rank,
                last_step=last,
                steps_per_rank={str(k): v for k, v in per_rank.items()},
                ranks=[{"rank": r, "first_missing": f, "missing": m, "last_step": lst} for r, f, m, lst in rows],
                incomplete_steps=incomplete[0] if incomplete else 0,
            )
        ]

    def _replicated_gradients(self, ctx: AuditContext) -> list[Finding]:
        rows = ctx.con.execute("""
            WITH p AS (SELECT g.rank, g.step, g.tensor, g.norm FROM grad_pieces g
                       JOIN params l ON l.rank = g.rank AND l.seg = g.seg AND l.idx = g.idx
                       WHERE l.kind = 'replicated'),
                 ref AS (SELECT step, tensor, arg_min(norm, rank) AS reference, min(rank) AS reference_rank
                         FROM p GROUP BY step, tensor)
            SELECT p.step, p.tensor, p.rank, p.norm, ref.reference, ref.reference_rank
            FROM p JOIN ref USING (step, tensor)
            WHERE p.norm IS DISTINCT FROM ref.reference
            ORDER BY p.step, p.rank, p.tensor""").fetchall()
        if not rows:
            return []
        first = rows[0][0]
        at_first = [r for r in rows if r[0] == first]
        run_start = ctx.scalar("SELECT min(step) FROM steps")
        ranks = sorted({r[2] for r in at_first})
        cause = (
            "gradients are not synchronised across ranks (no DDP wrapper, or each process training alone)"
            if first == run_start
            else "a replica's gradient changed after the all-reduce: silent data corruption "
            "on that rank's device, or a rank-local update"
        )
        return [
            self.finding(
                "gradients-differ",
                "fail",
                f"replicated gradients differ across ranks at step {first}: rank(s) {', '.join(map(str, ranks))} differ "
                f"from rank {at_first[0][5]} in {len(at_first)} tensor(s), first {at_first[0][1]}; {cause}",
                step=first,
                ranks=ranks,
                steps_affected=len({r[0] for r in rows}),
                tensors=[
                    {"tensor": t, "rank": r, "norm": n, "reference_norm": ref, "reference_rank": rr}
                    for _, t, r, n, ref, rr in at_first[: self.params["max_tensors_listed"]]
                ],
            )
        ]

    def _replica_weights(self, ctx: AuditContext) -> list[Finding]:
        rows = ctx.con.execute("""
            WITH saves AS (SELECT rank, seg, step, path, unnest(param_fingerprints) AS fp,
                                  generate_subscripts(param_fingerprints, 1) - 1 AS idx
                           FROM checkpoints WHERE event = 'saved' AND param_fingerprints IS NOT NULL),
                 p AS (SELECT s.*, l.name FROM saves s JOIN params l USING (rank, seg, idx) WHERE l.kind = 'replicated'),
                 ref AS (SELECT step, path, idx, arg_min(fp, rank) AS reference, min(rank) AS reference_rank
                         FROM p GROUP BY ALL)
            SELECT p.step, p.path, p.name, p.rank, ref.reference_rank FROM p JOIN ref USING (step, path, idx)
            WHERE p.fp <> ref.reference ORDER BY p.step, p.rank, p.idx""").fetchall()
        if not rows:
            return []
        step, path = rows[0][0], rows[0][1]
        at_first = [r for r in rows if r[0] == step and r[1] == path]
        ranks = sorted({r[3] for r in at_first})
        return [
            self.finding(
                "weights-differ",
                "fail",
                f"data-parallel replicas hold different weights at the save of step {step} ({path}): rank(s) "
                f"{', '.join(map(str, ranks))} differ from rank {at_first[0][4]} in {len(at_first)} tensor(s), first "
                f"{at_first[0][2]}; the replicas diverged (silent data corruption or a rank-local update, which DDP "
                f"never repairs): resume every rank from a checkpoint saved before the divergence",
                step=step,
                path=path,
                ranks=ranks,
                saves_affected=len({(r[0], r[1]) for r in rows}),
                tensors=[{"tensor": n, "rank": r} for _, _, n, r, _ in at_first[: self.params["max_tensors_listed"]]],
            )
        ]

    def _shared_samples(self, ctx: AuditContext) -> list[Finding]:
        rows = ctx.con.execute("""
            WITH ids AS (SELECT DISTINCT rank, step, unnest(sample_ids) AS id FROM batches),
                 shared AS (SELECT step, id, list(rank ORDER BY rank) AS ranks FROM ids GROUP BY step, id
                            HAVING count(*) > 1)
            SELECT step, count(*) AS n, list(id ORDER BY id), any_value(ranks),
                   (SELECT count(DISTINCT id) FROM ids i WHERE i.step = shared.step) AS total
            FROM shared GROUP BY step ORDER BY step""").fetchall()
        if not rows:
            return []
        step, n, ids, ranks, total = rows[0]
        return [
            self.finding(
                "data-not-sharded",
                "fail",
                f"ranks {', '.join(map(str, ranks))} trained the same {n} of {total} sample(s) at step {step} "
                f"({len(rows)} step(s) affected): the data is not sharded across data-parallel ranks (a "
                f"sampler without the rank, or an IterableDataset every rank reads whole); use a DistributedSampler or "
                f"split the stream by rank",
                step=step,
                ranks=ranks,
                shared=n,
                samples=total,
                steps_affected=len(rows),
                sample_ids=ids[: self.params["max_ids_listed"]],
            )
        ]

    def _framework_total(self, ctx: AuditContext) -> list[Finding]:
        max_norm = ((ctx.manifest.get("config") or {}).get("training_args") or {}).get("max_grad_norm")
        post_clip = ctx.manifest.get("grad_norm_source") == "post_clip"
        if post_clip and not max_norm:
            return []
        expected = "m.value * least(1.0, ? / (m.value + 1e-6))" if post_clip else "m.value"
        rows = ctx.con.execute(
            f"""
            SELECT m.step, m.rank, m.value AS logged, s.grad_norm AS reduced, {expected} AS expected
            FROM metrics m JOIN steps s ON s.rank = m.rank AND s.step = m.step
            WHERE m.name = 'grad_norm' AND isfinite(m.value) AND isfinite(s.grad_norm)
              AND abs({expected} / s.grad_norm - 1) > ?
            ORDER BY m.step, m.rank""",
            ([max_norm, max_norm] if post_clip else []) + [self.params["total_norm_rtol"]],
        ).fetchall()
        if not rows:
            return []
        step, rank, logged, reduced, _ = rows[0]
        return [
            self.finding(
                "clip-norm-local",
                "fail",
                f"the framework's total gradient norm at step {step} on rank {rank} was {logged:.4g}, but the whole "
                f"model's gradient norm (its ranks' pieces reduced) was {reduced:.4g}: the framework clipped by a norm "
                f"it did not compute over all shards (FSDP with the plain torch.nn.utils.clip_grad_norm_); clip "
                f"with the wrapper's own clip_grad_norm_ (FSDP1) or a DTensor-aware one",
                step=step,
                rank=rank,
                logged=logged,
                reduced=reduced,
                steps_affected=len({r[0] for r in rows}),
                threshold=self.params["total_norm_rtol"],
                value=abs(logged / reduced - 1),
            )
        ]

    def _local_loss(self, ctx: AuditContext) -> list[Finding]:
        row = ctx.row("""
            WITH per_step AS (SELECT step, list(rank ORDER BY rank) FILTER (WHERE NOT isfinite(loss)) AS bad,
                                     count(*) AS n, list({'rank': rank, 'loss': loss::VARCHAR} ORDER BY rank) AS losses
                              FROM steps WHERE loss IS NOT NULL GROUP BY step)
            SELECT step, bad, losses FROM per_step WHERE len(bad) > 0 ORDER BY step LIMIT 1""")
        if row is None:
            return []
        step, bad, losses = row
        if len(bad) == len(losses):
            return []  # every rank at once: nothing to pin to a rank (LOOP-05 reports the non-finite loss)
        return [
            self.finding(
                "rank-non-finite-loss",
                "fail",
                f"the local loss of rank(s) {', '.join(map(str, bad))} became non-finite at step {step} while the other "
                f"ranks' stayed finite: inspect the batch rank {bad[0]} trained at step {step} and its device; the "
                f"all-reduce then spread the non-finite gradient to every rank",
                step=step,
                ranks=bad,
                losses=losses,
            )
        ]

    def _outlying_loss(self, ctx: AuditContext) -> list[Finding]:
        rows = ctx.con.execute("""
            SELECT step, list(rank ORDER BY rank), list(loss ORDER BY rank) FROM steps GROUP BY step
            HAVING count(loss) = (SELECT count(DISTINCT rank) FROM manifest) AND bool_and(isfinite(loss) AND loss > 0)
            ORDER BY step""").fetchall()
        window = self.params["window"] or adaptive_window(len(rows))
        if len(rows) <= window:
            return []  # no history to judge the spread against
        steps = np.array([r[0] for r in rows])
        ranks = rows[0][1]
        y = np.log(np.array([r[2] for r in rows], dtype=float))  # steps x ranks; every rank at every step
        spread = np.abs(y - np.median(y, axis=1, keepdims=True)).max(axis=1)
        median, sigma = previous_block_stats(spread, window, SIGMA_BLOCKS)
        z = robust_z(spread, median, sigma, self.params["loss_spread_floor"])
        own_median, _ = previous_block_stats(y, window)
        off = np.abs(y - own_median)  # log ratio of each rank's loss to its own running median
        worst = np.nanargmax(np.where(np.isnan(off), -1.0, off), axis=1)
        effect = off[np.arange(len(rows)), worst]
        flagged = np.flatnonzero((z >= self.params["loss_sigma"]) & (effect >= np.log(self.params["loss_min_ratio"])))
        if not flagged.size:
            return []
        i = flagged[0]
        step, rank = int(steps[i]), ranks[worst[i]]
        loss, baseline = float(np.exp(y[i, worst[i]])), float(np.exp(own_median[i, worst[i]]))
        ids = (
            ctx.scalar(
                "SELECT flatten(list(sample_ids ORDER BY micro)) FROM batches WHERE rank = ? AND step = ?", [rank, step]
            )
            or []
        )
        others = ", ".join(f"rank {r}'s {np.exp(v):.4g}" for j, (r, v) in enumerate(zip(ranks, y[i])) if j != worst[i])
        return [
            self.finding(
                "rank-loss-outlier",
                "warn",
                f"the local loss of rank {rank} at step {step} was {loss:.4g}, {loss / baseline:.3g}x its own running "
                f"median ({baseline:.4g}), against {others}: far outside the usual spread between the "
                f"ranks (z = {z[i]:.0f}); inspect the batch rank {rank} trained at step {step}"
                + (f" (samples {', '.join(map(str, ids[:3]))}{', ...' if len(ids) > 3 else ''})" if ids else "")
                + " and that rank's device",
                step=step,
                rank=rank,
                loss=loss,
                baseline=baseline,
                ratio=loss / baseline,
                z=float(z[i]),
                threshold=self.params["loss_sigma"],
                steps_affected=int(flagged.size),
                losses=[{"rank": r, "loss": float(np.exp(v))} for r, v in zip(ranks, y[i])],
                sample_ids=ids[: self.params["max_ids_listed"]],
            )
        ]
