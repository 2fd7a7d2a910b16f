"""LOOP-15 trainable-set conformance."""

from __future__ import annotations

from fnmatch import fnmatchcase

import numpy as np

from .base import AuditContext, Check, Finding
from .rolling import grad_norm_matrix, runs_of


class TrainableSetConformance(Check):
    """Trainable-set conformance (trigger point: after backward, from step 1).

    What it detects:
        A tensor that requires grad but receives no gradient (None) or an exactly-zero one for
        `min_steps` steps in a row (reentrant gradient checkpointing over frozen
        embeddings leaves the LoRA adapters inside the checkpointed layers without gradients);
        a tensor the run declared trainable (`config["trainable"]`: name patterns) that does not
        require grad, or a pattern matching no parameter; stale gradients: a tensor's
        gradient norm bit-identical to the previous step's (a reused ZeRO bucket).
    Why it matters:
        None of these makes a per-run statistic look wrong: the loss still falls through the
        tensors that do train, and the frozen or stale ones quietly train nothing (or the same
        update twice).
    Statistic:
        From the per-tensor gradient norms recorded every step (null where `grad is None`): per
        tensor with `requires_grad`, steps without a gradient or with norm 0, in runs. Norms of
        consecutive steps compared for exact equality, each equality weighed by how likely chance
        makes it in this run: a float32 norm has a relative resolution of 2^-24..2^-23 (its own
        spacing), and the tensor's own step-to-step relative change has a density near 0
        (estimated from the smallest 1% of its nonzero changes), so two independent norms agree
        with probability p = spacing x density. Equal cells on consecutive steps form one event;
        its chance is the product of its cells' p times the ways of choosing the tensors that
        start being equal at each step (a binomial coefficient), and the expected number of such
        events in a clean run of this length is the steps compared x that chance. At 10^8 norms
        single equal neighbours are expected by chance (about one per 3 million comparisons for
        a tensor varying 15% a step); a stale buffer repeats for several steps or several tensors.
        The declared patterns (fnmatch) against the parameter names and their `requires_grad`.
    Threshold:
        No or zero gradient for `min_steps` (3) consecutive recorded steps: fail at the last of
        them. Declared trainable but frozen: fail at the first step. Equal non-zero norms whose
        event is expected fewer than `chance_expected` (0.001) times in a clean run of this
        length: fail at the event's first step.
    Evidence:
        The tensors (up to `max_tensors_listed`), the steps, the norms compared, the equal
        events' expected chance count, the patterns.
    """

    code = "LOOP-15"
    name = "trainable-set conformance"
    needs = ("grad_norms",)
    defaults = {"min_steps": 3, "max_tensors_listed": 20, "chance_expected": 1e-3}

    def run(self, ctx: AuditContext) -> list[Finding]:
        params = ctx.frame(
            "SELECT idx, name, requires_grad FROM params WHERE rank = 0 AND idx IS NOT NULL "
            "AND seg = (SELECT max(seg) FROM params WHERE rank = 0) ORDER BY idx"
        )
        if params.height == 0:
            return []
        first_step = ctx.scalar("SELECT min(step) FROM steps WHERE rank = 0")
        return self._declared(ctx, params, first_step) + self._gradients(ctx, params)

    def _declared(self, ctx: AuditContext, params, first_step) -> list[Finding]:
        patterns = (ctx.manifest.get("config") or {}).get("trainable") or []
        if not patterns or first_step is None:
            return []
        names = params["name"].to_list()
        trainable = params["requires_grad"].to_list()
        frozen = [n for n, t in zip(names, trainable) if not t and any(fnmatchcase(n, p) for p in patterns)]
        unmatched = [p for p in patterns if not any(fnmatchcase(n, p) for n in names)]
        if not frozen and not unmatched:
            return []
        what = []
        if frozen:
            what.append(f"{len(frozen)} tensor(s) declared trainable do not require grad, first {frozen[0]}")
        if unmatched:
            what.append(f"pattern(s) {unmatched} match no parameter")
        return [
            self.finding(
                "fail",
                f"the trainable set differs from the declared one: {'; '.join(what)}; check the freezing code and "
                f"the adapter's target modules",
                step=first_step,
                tensors=frozen[: self.params["max_tensors_listed"]],
                tensor_count=len(frozen),
                unmatched_patterns=unmatched,
                declared=patterns,
            )
        ]

    def _gradients(self, ctx: AuditContext, params) -> list[Finding]:
        steps, _, norms = grad_norm_matrix(ctx)  # NaN where absent: a recorded NaN is told apart below
        if steps.size == 0 or norms.shape[1] == 0:
            return []
        present = ~np.isnan(norms)
        nan_cells = ctx.con.sql("SELECT step, idx FROM grad_cells WHERE rank = 0 AND isnan(norm)").fetchnumpy()
        rows = np.minimum(np.searchsorted(steps, nan_cells["step"]), steps.size - 1)
        at = (steps[rows] == nan_cells["step"]) & (nan_cells["idx"] < norms.shape[1])
        present[rows[at], nan_cells["idx"][at]] = True
        graded = present.any(axis=1)  # a step whose gradients were not recorded at all is not judged
        if not graded.all():
            steps, norms, present = steps[graded], norms[graded], present[graded]
        if steps.size == 0:
            return []
        n_params = norms.shape[1]
        names = dict(zip(params["idx"].to_list(), params["name"].to_list()))
        requires = np.zeros(n_params, dtype=bool)
        idx = params["idx"].to_numpy()
        inside = idx < n_params
        requires[idx[inside]] = params["requires_grad"].fill_null(False).to_numpy()[inside]
        findings = []

        starved = (~present | (norms == 0)) & requires[None, :]
        k = min(self.params["min_steps"], steps.size)
        first_hit = {}
        for col in np.flatnonzero(starved.any(axis=0)):
            hits = runs_of(starved[:, col], k)
            if hits.size:
                first_hit[col] = int(hits[0])
        del starved
        if first_hit:
            row = min(first_hit.values())
            cols = sorted((c for c, r in first_hit.items() if r == row), key=lambda c: c)
            none = [names[c] for c in cols if not present[row, c]]
            listed = [{"tensor": names[c], "gradient": "none" if not present[row, c] else "zero"} for c in cols]
            findings.append(
                self.finding(
                    "fail",
                    f"{len(cols)} tensor(s) that require grad got {'no' if none else 'zero'} gradient for {k} steps in a row "
                    f"(through step {steps[row]}), first {names[cols[0]]}; with gradient checkpointing use "
                    f"use_reentrant=False or enable_input_require_grads(), and check what detaches them from the loss",
                    step=int(steps[row]),
                    tensors=listed[: self.params["max_tensors_listed"]],
                    tensor_count=len(cols),
                    min_steps=k,
                    other_tensors_later=len(first_hit) - len(cols),
                )
            )
        return findings + self._stale(steps, norms, names)

    def _stale(self, steps: np.ndarray, norms: np.ndarray, names: dict) -> list[Finding]:
        """Equal norms on consecutive steps that chance does not explain in a run of this length."""
        consecutive = np.diff(steps) == 1
        with np.errstate(invalid="ignore"):
            valid = np.isfinite(norms) & (norms > 0)
        both = valid[1:] & valid[:-1] & consecutive[:, None]
        del valid
        equal = both & (norms[1:] == norms[:-1])
        if not equal.any():
            return []
        density = _change_density(norms, both, equal)
        rows, cols = np.nonzero(equal)
        cell = norms[rows + 1, cols]
        chance = np.spacing(cell.astype(np.float32)).astype(np.float64) / cell * density[cols]
        # A tensor whose changes could not be measured: p = 1 (log 0), an equal norm is no evidence.
        log_p = np.log(np.where(density[cols] > 0, np.minimum(1.0, chance), 1.0))
        new = (rows == 0) | ~equal[np.maximum(rows - 1, 0), cols]
        order, start = np.unique(rows, return_index=True)
        per_row = np.add.reduceat(log_p, start)
        from scipy.special import gammaln  # only a run with equal norms pays for scipy

        compared = both[order].sum(axis=1).astype(np.float64)
        fresh = np.add.reduceat(new.astype(np.float64), start)
        per_row += gammaln(compared + 1) - gammaln(fresh + 1) - gammaln(compared - fresh + 1)  # which tensors start
        event = np.cumsum(np.r_[True, np.diff(order) > 1])  # consecutive rows with equal cells: one event
        with np.errstate(over="ignore"):
            expected = int(both.any(axis=1).sum()) * np.exp(np.bincount(event, weights=per_row)[1:])
        firing = np.flatnonzero(expected < self.params["chance_expected"]) + 1
        if not firing.size:
            return []
        first_row = int(order[event == firing[0]][0])
        in_row = cols[rows == first_row]
        affected = int(np.isin(event, firing).sum())
        chance = float(expected[firing[0] - 1])
        return [
            self.finding(
                "fail",
                f"{in_row.size} tensor(s) had a gradient bit-identical in norm to the previous step's at step "
                f"{steps[first_row + 1]}, first {names[int(in_row[0])]} ({affected} step(s); chance would do this "
                f"{chance:.2g} times in a clean run this long): a stale gradient buffer is reused "
                f"(ZeRO bucket, a hook that caches, a missing zero_grad with a frozen graph); resume from a checkpoint "
                f"before it",
                step=int(steps[first_row + 1]),
                tensors=[
                    {"tensor": names[int(c)], "norm": float(norms[first_row + 1, c])}
                    for c in in_row[: self.params["max_tensors_listed"]]
                ],
                tensor_count=int(in_row.size),
                steps_affected=affected,
                chance_expected=chance,
                threshold=self.params["chance_expected"],
            )
        ]


def _change_density(norms: np.ndarray, both: np.ndarray, equal: np.ndarray, block: int = 256) -> np.ndarray:
    """Per tensor: the density near 0 of its step-to-step relative change |n_t / n_(t-1) - 1|, from the
    smallest 1% of its nonzero changes (k of them below h: k / (2 h count)); 0 for a tensor with too
    few (an equal norm of it is then no evidence). In column blocks, so the temporaries stay small."""
    out = np.zeros(norms.shape[1])
    for lo in range(0, norms.shape[1], block):
        sl = slice(lo, lo + block)
        usable = both[:, sl] & ~equal[:, sl]
        count = usable.sum(axis=0)
        k = max(1, int(np.ceil(0.01 * count.max())))
        with np.errstate(invalid="ignore", divide="ignore"):
            change = np.where(usable, np.abs(norms[1:, sl] / norms[:-1, sl] - 1), np.inf).astype(np.float32)
        h = (
            np.partition(change, k - 1, axis=0)[k - 1].astype(np.float64)
            if change.shape[0] >= k
            else np.full(change.shape[1], np.inf)
        )
        ok = np.isfinite(h) & (h > 0) & (count >= k)
        out[lo : lo + block][ok] = k / (2 * h[ok] * count[ok])
    return out
