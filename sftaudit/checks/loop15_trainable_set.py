"""LOOP-15 trainable-set conformance."""

from __future__ import annotations

from fnmatch import fnmatchcase

import numpy as np

from .base import AuditContext, Check, Finding, count, probability
from .gradient_columns import ABSENT, gradient_columns


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
    rules = {
        "trainable-set-differs": "the trainable set differs from the declared one",
        "no-gradient": "tensors that require grad got no or zero gradient for several steps",
        "stale-gradient": "tensors had a gradient bit-identical in norm to the previous step's",
    }
    needs = ("grad_norms",)
    defaults = {"min_steps": count(3), "max_tensors_listed": count(20), "chance_expected": probability(1e-3)}

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
                "trainable-set-differs",
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
        columns = gradient_columns(ctx)
        n_params = len(columns.names)
        graded = columns.graded  # a step whose gradients were not recorded at all is not judged
        if n_params == 0 or not graded.any():
            return []
        steps = columns.steps[graded]
        keep = None if graded.all() else np.flatnonzero(graded)
        names = dict(zip(params["idx"].to_list(), params["name"].to_list()))
        requires = np.zeros(n_params, dtype=bool)
        idx = params["idx"].to_numpy()
        inside = idx < n_params
        requires[idx[inside]] = params["requires_grad"].fill_null(False).to_numpy()[inside]
        k = min(self.params["min_steps"], steps.size)
        consecutive = np.diff(steps) == 1
        starved_at = np.full(n_params, -1)  # per tensor: the step row ending its first run of k starved steps
        none_at = np.zeros(n_params, dtype=bool)  # whether it had no gradient there (else a zero one)
        stale = _StaleCells(steps.size)

        def judge(first: int, norms: np.ndarray):  # NaN: recorded non-finite; ABSENT: no gradient
            if keep is not None:
                norms = norms[:, keep]
            present = norms != ABSENT
            at = _first_run((~present | (norms == 0)) & requires[first : first + len(norms), None], k)
            hit = np.flatnonzero(at >= 0)
            return first, at, hit, ~present[hit, at[hit]], _stale_cells(first, norms, consecutive)

        for first, at, hit, none, cells in columns.map(judge, absent=ABSENT):
            starved_at[first : first + len(at)] = at
            none_at[first + hit] = none
            stale.add(*cells)
        findings = []
        if (starved_at >= 0).any():
            row = int(starved_at[starved_at >= 0].min())
            cols = np.flatnonzero(starved_at == row)
            none = none_at[cols].any()
            listed = [{"tensor": names[c], "gradient": "none" if none_at[c] else "zero"} for c in cols]
            findings.append(
                self.finding(
                    "no-gradient",
                    "fail",
                    f"{len(cols)} tensor(s) that require grad got {'no' if none else 'zero'} gradient for {k} steps in a row "
                    f"(through step {steps[row]}), first {names[cols[0]]}; with gradient checkpointing use "
                    f"use_reentrant=False or enable_input_require_grads(), and check what detaches them from the loss",
                    step=int(steps[row]),
                    tensors=listed[: self.params["max_tensors_listed"]],
                    tensor_count=len(cols),
                    min_steps=k,
                    other_tensors_later=int((starved_at >= 0).sum()) - len(cols),
                )
            )
        return findings + self._stale(steps, stale, names)

    def _stale(self, steps: np.ndarray, stale: _StaleCells, names: dict) -> list[Finding]:
        """Equal norms on consecutive steps that chance does not explain in a run of this length."""
        if not stale.rows:
            return []
        rows, cols, cell = (np.concatenate(part) for part in (stale.rows, stale.cols, stale.norms))
        order = np.unique(rows)  # the step pairs with equal cells
        from scipy.special import gammaln  # only a run with equal norms pays for scipy

        compared, fresh = stale.compared[order].astype(np.float64), stale.fresh[order]
        per_row = stale.log_p[order] + gammaln(compared + 1) - gammaln(fresh + 1) - gammaln(compared - fresh + 1)
        event = np.cumsum(np.r_[True, np.diff(order) > 1])  # consecutive rows with equal cells: one event
        with np.errstate(over="ignore"):
            expected = int((stale.compared > 0).sum()) * np.exp(np.bincount(event, weights=per_row)[1:])
        firing = np.flatnonzero(expected < self.params["chance_expected"]) + 1
        if not firing.size:
            return []
        first_row = int(order[event == firing[0]][0])
        in_row = np.flatnonzero(rows == first_row)
        in_row = in_row[np.argsort(cols[in_row], kind="stable")]
        affected = int(np.isin(event, firing).sum())
        chance = float(expected[firing[0] - 1])
        first_name = names[int(cols[in_row[0]])]
        return [
            self.finding(
                "stale-gradient",
                "fail",
                f"{in_row.size} tensor(s) had a gradient bit-identical in norm to the previous step's at step "
                f"{steps[first_row + 1]}, first {first_name} ({affected} step(s); chance would do this "
                f"{chance:.2g} times in a clean run this long): a stale gradient buffer is reused "
                f"(ZeRO bucket, a hook that caches, a missing zero_grad with a frozen graph); resume from a checkpoint "
                f"before it",
                step=int(steps[first_row + 1]),
                tensors=[
                    {"tensor": names[int(cols[i])], "norm": float(cell[i])}
                    for i in in_row[: self.params["max_tensors_listed"]]
                ],
                tensor_count=int(in_row.size),
                steps_affected=affected,
                chance_expected=chance,
                threshold=self.params["chance_expected"],
            )
        ]


def _first_run(mask: np.ndarray, length: int) -> np.ndarray:
    """Per row of `mask` (series x steps): the index of the step ending its first run of `length` true
    steps, or -1."""
    if mask.shape[1] < length or length < 1:
        return np.full(len(mask), -1)
    total = np.cumsum(mask, axis=1, dtype=np.int32)
    window = total[:, length - 1 :].copy()
    window[:, 1:] -= total[:, :-length]
    hit = window >= length
    return np.where(hit.any(axis=1), hit.argmax(axis=1) + length - 1, -1)


class _StaleCells:
    """Equal non-zero norms on consecutive steps, gathered a block of tensors at a time, with what the chance
    of each needs: per step pair, the tensors compared, the sum of the equal cells' log-chances and how many
    of them start being equal there."""

    def __init__(self, steps: int):
        pairs = max(steps - 1, 0)
        self.compared = np.zeros(pairs, dtype=np.int64)
        self.log_p, self.fresh = np.zeros(pairs), np.zeros(pairs)
        self.rows: list[np.ndarray] = []
        self.cols: list[np.ndarray] = []
        self.norms: list[np.ndarray] = []

    def add(self, compared: np.ndarray, rows: np.ndarray, cols: np.ndarray, cell: np.ndarray, log_p, new) -> None:
        self.compared += compared
        if rows.size:
            self.log_p += np.bincount(rows, weights=log_p, minlength=self.log_p.size)
            self.fresh += np.bincount(rows, weights=new, minlength=self.fresh.size)
            self.rows.append(rows)
            self.cols.append(cols)
            self.norms.append(cell)


def _stale_cells(first: int, norms: np.ndarray, consecutive: np.ndarray) -> tuple:
    """One block of tensors' part of `_StaleCells`: per step pair the tensors compared, and each equal cell's
    step pair, tensor, norm, log-chance and whether it starts being equal there."""
    with np.errstate(invalid="ignore"):
        valid = np.isfinite(norms) & (norms > 0)
    both = valid[:, 1:] & valid[:, :-1] & consecutive
    del valid
    compared = both.sum(axis=0)
    equal = both & (norms[:, 1:] == norms[:, :-1])
    tensors = np.flatnonzero(equal.any(axis=1))
    if not tensors.size:
        none = np.zeros(0, dtype=np.intp)
        return compared, none, none, np.zeros(0, np.float32), np.zeros(0), np.zeros(0, bool)
    equal, both, norms = equal[tensors], both[tensors], norms[tensors]
    density = _change_density(norms, both, equal)
    cols, rows = np.nonzero(equal)
    cell = norms[cols, rows + 1]
    chance = np.spacing(cell).astype(np.float64) / cell * density[cols]
    # A tensor whose changes could not be measured: p = 1 (log 0), an equal norm is no evidence.
    log_p = np.log(np.where(density[cols] > 0, np.minimum(1.0, chance), 1.0))
    new = (rows == 0) | ~equal[cols, np.maximum(rows - 1, 0)]
    return compared, rows, tensors[cols] + first, cell, log_p, new


def _change_density(norms: np.ndarray, both: np.ndarray, equal: np.ndarray) -> np.ndarray:
    """Per tensor (row): the density near 0 of its step-to-step relative change |n_t / n_(t-1) - 1|, from
    the smallest 1% of its nonzero changes (k of them below h: k / (2 h count)); 0 for a tensor with too
    few (an equal norm of it is then no evidence)."""
    usable = both & ~equal
    count = usable.sum(axis=1)
    k = np.maximum(1, np.ceil(0.01 * count).astype(np.int64))
    with np.errstate(invalid="ignore", divide="ignore"):
        change = np.where(usable, np.abs(norms[:, 1:] / norms[:, :-1] - 1), np.inf).astype(np.float32)
    h = np.full(len(norms), np.inf)
    if change.shape[1]:
        kth = np.minimum(k, change.shape[1]) - 1
        h = np.take_along_axis(np.partition(change, np.unique(kth), axis=1), kth[:, None], axis=1)[:, 0]
        h = h.astype(np.float64)
    ok = np.isfinite(h) & (h > 0) & (count >= k)
    return np.where(ok, k / (2 * np.where(ok, h, 1.0) * np.maximum(count, 1)), 0.0)
