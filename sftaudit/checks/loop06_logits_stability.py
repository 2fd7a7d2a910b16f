"""LOOP-06 logits distribution stability."""

from __future__ import annotations

import numpy as np

from .base import AuditContext, CannotJudge, Check, Finding, at_least, count, positive, share
from .stats.rolling import previous_block_stats, robust_z, warmup_end


def kl_top_k(prev_ids, prev_probs, cur_ids, cur_probs) -> float:
    """KL(prev || cur) over the union of both top-k supports plus one bucket for the rest.

    A token missing from one top-k list gets that list's smallest recorded probability (an
    upper bound on its true value), so the divergence is never inflated by truncation."""
    union = np.union1d(prev_ids, cur_ids)

    def dense(ids, probs):
        p = np.full(union.size, min(probs))
        p[np.searchsorted(union, ids)] = probs
        rest = max(1.0 - p.sum(), 1e-12)
        return np.append(p, rest) / (p.sum() + rest)

    p, q = dense(np.asarray(prev_ids), np.asarray(prev_probs)), dense(np.asarray(cur_ids), np.asarray(cur_probs))
    return float(np.sum(p * np.log(p / q)))


# Log-scale sigma floor: a history flatter than this (e = 1.5x) does not make ordinary wobbles alarms.
LOG_SIGMA_FLOOR = np.log(1.5)


def own_history(values: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Robust z of log(value) against the previous block of probes, and value / baseline median."""
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.log(np.where(values > 0, values, np.nan))
    median, sigma = previous_block_stats(y, window)
    with np.errstate(invalid="ignore"):
        return robust_z(y, median, sigma, LOG_SIGMA_FLOOR), np.exp(y - median)


class LogitsStability(Check):
    """Logits distribution stability (trigger point: probe steps).

    What it detects:
        The next-token distribution on the fixed probe prompts jumping between consecutive probe
        steps, its top-1 probability swinging, or its entropy collapsing: the model's answers to
        the same questions changing abruptly (after as little as 1% of gibberish samples, or a collapse
        onto a template).
    Why it matters:
        The probes see degradation before the loss does (at the step it starts,
        not at the end of an epoch), because they measure what the model would say, not how well it
        fits the batch in front of it.
    Statistic:
        Ten passes with dropout off would give ten identical answers, so the spread here
        is across time: per prompt, the std of the top-1 probability over the last `spread_window`
        (5) probe steps, averaged over prompts. KL(previous || current) per prompt on the recorded
        top-k (missing tokens get the list's smallest probability; the rest is one bucket),
        averaged over prompts. Both are judged against the run's own probe-to-probe history, as
        LOOP-05 judges gradient norms: y = log(value), baseline = median and 1.4826 x MAD of y over
        the previous block of `window` probe steps, z = (y - median) / max(sigma, log 1.5). Ordinary
        learning at a high learning rate moves the distributions a lot, but steadily; a jump is
        a value far outside what this run's probes did just before. Entropy: mean over prompts
        against the median of the previous block. Warmup excluded.
    Threshold:
        Fewer than 3 probe steps with finite distributions: not judged (a probe step whose
        distribution is NaN, after a non-finite model, is left out and the check says it ran on
        part of the probes).
        KL: z >= `sigma` (6), KL >= `min_ratio` (10) x its baseline median and KL >= `min_kl`
        (0.02 nats, below which top-k rounding dominates): warn. Spread: z >= `sigma` and spread >
        `max_top1_std` (0.08, an absolute value kept as a floor): warn. Entropy <
        `entropy_collapse` (0.5) x its previous-block median: warn. Each at the first probe step
        it holds.
    Evidence:
        The value and threshold at that step, per-prompt values and the top tokens before/after.
    """

    code = "LOOP-06"
    name = "logits distribution stability"
    rules = {
        "spread": "the top-1 probability on the probe prompts swung beyond its own history",
        "kl": "the next-token distribution on the probe prompts jumped from the previous probe",
        "entropy": "next-token entropy on the probe prompts collapsed",
    }
    needs = ("probes",)
    defaults = {
        "max_top1_std": positive(0.08),
        "spread_window": count(5, low=2),
        "sigma": positive(6.0),
        "min_ratio": at_least(10.0, 1),
        "min_kl": at_least(0.02, 0),
        "entropy_collapse": share(0.5),
        "window": count(4, low=2),
    }

    def run(self, ctx: AuditContext) -> list[Finding]:
        rows = ctx.con.execute(
            "SELECT step, prompt, entropy, top_ids, top_probs FROM probes ORDER BY step, prompt"
        ).fetchall()
        recorded = sorted({r[0] for r in rows})
        # A probe whose distribution is not finite (the model's outputs were NaN) says nothing of its drift.
        rows = [
            r
            for r in rows
            if r[2] is not None and np.isfinite(r[2]) and r[4] and np.isfinite(np.asarray(r[4], dtype=float)).all()
        ]
        steps = np.array(sorted({r[0] for r in rows}))
        prompts = sorted({r[1] for r in rows})
        at = {(r[0], r[1]): r for r in rows}
        if any((s, p) not in at for s in steps for p in prompts):  # a probe step with a missing prompt: keep full ones
            steps = np.array([s for s in steps if all((s, p) in at for p in prompts)])
        unjudged = sorted(set(recorded) - set(steps.tolist()))
        if steps.size < 3:
            raise CannotJudge(
                f"{len(recorded)} probe step(s) recorded"
                + (f", {steps.size} of them with finite distributions" if unjudged else "")
                + ": a drift between probes needs 3 (probe more often, or at each checkpoint with `sftaudit probe`)"
            )
        if unjudged:
            ctx.partly_judged[self.code] = (
                f"{len(unjudged)} of {len(recorded)} probe steps (from step {unjudged[0]}) were not judged: their "
                f"next-token distributions are not finite (the model's outputs were NaN or infinite there)"
            )
        entropy = np.array([[at[s, p][2] for p in prompts] for s in steps]).mean(axis=1)
        top1 = np.array([[at[s, p][4][0] for p in prompts] for s in steps])
        kl = np.array(
            [0.0]
            + [
                np.mean([kl_top_k(at[a, p][3], at[a, p][4], at[b, p][3], at[b, p][4]) for p in prompts])
                for a, b in zip(steps, steps[1:])
            ]
        )
        w = self.params["spread_window"]
        # std over each trailing window of (up to) w probes, from running sums
        sums = np.concatenate([np.zeros((1, 2, top1.shape[1])), np.cumsum(np.stack([top1, top1**2], axis=1), axis=0)])
        hi = np.arange(1, steps.size + 1)
        lo = np.maximum(0, hi - w)
        n = (hi - lo)[:, None]
        mean = (sums[hi, 0] - sums[lo, 0]) / n
        spread = np.sqrt(np.maximum((sums[hi, 1] - sums[lo, 1]) / n - mean**2, 0.0)).mean(axis=1)
        lr = ctx.frame("SELECT step, lr FROM steps WHERE rank = 0 ORDER BY step")
        judged_from = lr["step"][warmup_end(lr["lr"].fill_null(0).to_numpy())] if lr.height else steps[0]
        judged = steps >= judged_from

        ctx.add_series(
            self.code,
            "top-1 probability std over recent probes",
            steps.tolist(),
            spread.tolist(),
            self.params["max_top1_std"],
        )
        ctx.add_series(self.code, "KL(previous || current probe)", steps.tolist(), kl.tolist(), self.params["min_kl"])
        ctx.add_series(self.code, "mean next-token entropy", steps.tolist(), entropy.tolist())

        findings = []
        kl_z, kl_ratio = own_history(kl, self.params["window"])
        spread_z, _ = own_history(spread, self.params["window"])
        e_median, _ = previous_block_stats(entropy, self.params["window"])
        with np.errstate(invalid="ignore"):
            rules = [
                (
                    "spread",
                    judged & (spread_z >= self.params["sigma"]) & (spread > self.params["max_top1_std"]),
                    spread,
                    self.params["max_top1_std"],
                    "the top-1 probability on the probe prompts swung by std {v:.3f} over the last {w} probes at step {s}",
                ),
                (
                    "kl",
                    judged
                    & (kl_z >= self.params["sigma"])
                    & (kl_ratio >= self.params["min_ratio"])
                    & (kl >= self.params["min_kl"]),
                    kl,
                    self.params["min_kl"],
                    "the next-token distribution on the probe prompts jumped (KL {v:.3g} nats from the previous probe) at step {s}",
                ),
                (
                    "entropy",
                    judged & (entropy < self.params["entropy_collapse"] * e_median),
                    entropy,
                    self.params["entropy_collapse"],
                    "next-token entropy on the probe prompts collapsed to {v:.3g} at step {s}",
                ),
            ]
        for rule, hit, values, threshold, text in rules:
            if not hit.any():
                continue
            i = int(np.flatnonzero(hit)[0])
            s = int(steps[i])
            before = at[steps[i - 1], prompts[0]] if i else at[s, prompts[0]]
            findings.append(
                self.finding(
                    rule,
                    "warn",
                    text.format(v=values[i], w=w, s=s)
                    + "; inspect the batches since the previous probe for corrupt or templated samples",
                    step=s,
                    rule=rule,
                    value=values[i],
                    threshold=threshold,
                    top_tokens={
                        "prompt": prompts[0],
                        "before_step": int(before[0]),
                        "before_ids": before[3][:5],
                        "before_probs": before[4][:5],
                        "after_ids": at[s, prompts[0]][3][:5],
                        "after_probs": at[s, prompts[0]][4][:5],
                    },
                    per_prompt_top1=top1[i].tolist(),
                )
            )
        return findings
