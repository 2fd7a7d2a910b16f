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
        names = dict(zip(params["idx"].to_list(), params["name"].to_list()))
        requires = np.zeros(n_params, dtype=bool)
        idx = params["idx"].to_numpy()
        inside = idx < n_params
        requires[idx[inside]] = params["requires_grad"].fill_null(False).to_numpy()[inside]
        k = min(self.params["min_steps"], steps.size)
        key = {"format": 2, "min_steps": k, "requires": np.packbits(requires).tobytes().hex()}
        carried = columns.carried(self.code, key)
        judged = self._judge(columns, requires, k, carried)
        if judged is None:  # the run outgrew the changes carried for its change densities: judged whole
            carried = None
            judged = self._judge(columns, requires, k, None)
        starved_at, none_at, stale = judged
        if carried is None or carried["rows"] != columns.closing_rows:  # else what it carried is what it would
            closing = int(columns.graded[: columns.closing_rows].sum())
            columns.carry(self.code, key, columns.closing_rows, stale.carried(starved_at, none_at, closing))
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

    def _judge(self, columns, requires: np.ndarray, k: int, carried: dict | None):
        """Per tensor the graded step row ending its first run of `k` starved steps (-1: none) and whether it had
        no gradient there (else a zero one), and the stale cells; the rows carried taken as they were, the rows
        after them read from the earliest one a starved run or a stale cell past them may start at."""
        graded, n_params = columns.graded, len(columns.names)
        rows_of = np.flatnonzero(graded)  # the copy's row of each graded step
        steps = columns.steps[graded]
        since = int(graded[: carried["rows"]].sum()) if carried else 0  # graded rows carried
        closing = int(graded[: columns.closing_rows].sum())  # graded rows the next audit takes as they are
        stale = _StaleCells(steps.size, n_params, carried, since)
        starved_at = carried["starved_at"].copy() if carried else np.full(n_params, -1)
        none_at = carried["none_at"].copy() if carried else np.zeros(n_params, dtype=bool)
        starved_from = max(0, since - (k - 1))  # a run of k starved steps ending past `since` starts here at most
        lo = min(starved_from, max(0, since - 2))  # and a stale cell's pair, with the pair before it
        if lo >= steps.size:
            stale.finish()
            return starved_at, none_at, stale
        first_row = int(rows_of[lo])
        keep = rows_of[lo:] - first_row
        keep = None if keep.size == columns.steps.size - first_row else keep
        consecutive = np.diff(steps[lo:]) == 1

        def judge(first: int, norms: np.ndarray):  # NaN: recorded non-finite; ABSENT: no gradient
            if keep is not None:
                norms = norms[:, keep]
            present = norms != ABSENT
            starved = (~present | (norms == 0)) & requires[first : first + len(norms), None]
            at = _first_run(starved[:, starved_from - lo :], k)
            hit = np.flatnonzero(at >= 0)
            at[hit] += starved_from - lo
            before = (
                (stale.carried_count[first : first + len(norms)], stale.smallest[first : first + len(norms)])
                if carried
                else (np.zeros(len(norms), dtype=np.int64), np.zeros((len(norms), 0), dtype=np.float32))
            )
            cells = _stale_cells(first, norms, consecutive, max(0, since - 1 - lo), closing - 1 - lo, before)
            return first, at, hit, ~present[hit, at[hit]], cells

        for first, at, hit, none, cells in columns.map(judge, absent=ABSENT, first_row=first_row):
            open_ = starved_at[first : first + len(at)] < 0  # a first run carried stays the first
            starved_at[first + hit[open_[hit]]] = at[hit[open_[hit]]] + lo
            none_at[first + hit[open_[hit]]] = none[open_[hit]]
            stale.add(lo, *cells, first)
        if stale.short:
            return None
        stale.finish()
        return starved_at, none_at, stale

    def _stale(self, steps: np.ndarray, stale: _StaleCells, names: dict) -> list[Finding]:
        """Equal norms on consecutive steps that chance does not explain in a run of this length."""
        if not stale.rows.size:
            return []
        rows, cols, cell = stale.rows, stale.cols, stale.norms
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
    """Equal non-zero norms on consecutive graded steps, gathered a block of tensors at a time, with what the
    chance of each needs: per step pair the tensors compared; per tensor the density of its step-to-step changes
    near 0; per step pair, once `finish`ed, the sum of the equal cells' log-chances and how many of them start
    being equal there. Carried: the pairs before graded row `since` - 1 (their cells and counts), and per
    tensor the count of its changes there and the smallest of them, sorted (enough for the k-th smallest of a
    longer run; `short` when not)."""

    def __init__(self, steps: int, tensors: int, carried: dict | None, since: int):
        pairs = max(steps - 1, 0)
        self.compared = np.zeros(pairs, dtype=np.int64)
        self.density = np.zeros(tensors)
        # Each block's own rows replaced once it is judged (every block keeps as many smallest).
        self.closed_count = carried["count"].copy() if carried else np.zeros(tensors, dtype=np.int64)
        self.closed_smallest = carried["smallest"] if carried else None
        self.short = False
        self.cells: list[tuple] = []
        self.carried_count = carried["count"] if carried else np.zeros(tensors, dtype=np.int64)
        self.smallest = carried["smallest"] if carried else None
        if carried:
            self.compared[: carried["compared"].size] = carried["compared"]
            self.cells.append(tuple(carried[f"cell_{i}"] for i in range(4)))

    def add(self, lo: int, compared, cells: tuple, count, smallest, density, short: bool, first: int) -> None:
        """A block's part, its pairs numbered from graded row `lo` (the cells' and `compared`'s)."""
        self.compared[self.compared.size - compared.size :] += compared
        rows, cols, cell, new = cells
        self.cells.append((rows + lo, cols, cell, new))
        last = first + count.size
        self.closed_count[first:last] = count
        if self.closed_smallest is None:
            self.closed_smallest = np.empty((self.density.size, smallest.shape[1]), dtype=np.float32)
        self.closed_smallest[first:last] = smallest
        self.density[first:last] = density
        self.short |= short

    def finish(self) -> None:
        """The cells in the order a fresh audit finds them (by tensor, then step pair) and their log-chances."""
        rows, cols, cell, new = (np.concatenate(part) for part in zip(*self.cells))
        order = np.lexsort((rows, cols))
        self.rows, self.cols, self.norms, self.new = rows[order], cols[order], cell[order], new[order]
        chance = np.spacing(self.norms).astype(np.float64) / self.norms * self.density[self.cols]
        # A tensor whose changes could not be measured: p = 1 (log 0), an equal norm is no evidence.
        log_p = np.log(np.where(self.density[self.cols] > 0, np.minimum(1.0, chance), 1.0))
        self.log_p = np.bincount(self.rows, weights=log_p, minlength=self.compared.size)
        self.fresh = np.bincount(self.rows, weights=self.new, minlength=self.compared.size)

    def carried(self, starved_at: np.ndarray, none_at: np.ndarray, closing: int) -> dict:
        """What the next audit takes as it is: the first starved runs ending before graded row `closing`, the
        pairs before `closing` - 1, the changes there."""
        final = (starved_at >= 0) & (starved_at < closing)
        pairs = max(closing - 1, 0)
        before = self.rows < pairs
        return {
            "starved_at": np.where(final, starved_at, -1),
            "none_at": none_at & final,
            "compared": self.compared[:pairs],
            "count": self.closed_count,
            "smallest": self.closed_smallest,
            **{f"cell_{i}": a[before] for i, a in enumerate((self.rows, self.cols, self.norms, self.new))},
        }


def _stale_cells(first: int, norms: np.ndarray, consecutive: np.ndarray, pair_from: int, close_pair: int, carried):
    """One block of tensors' part of `_StaleCells`, its pairs from `pair_from` on: per pair the tensors compared;
    each equal cell's pair, tensor, norm and whether it starts being equal there; per tensor the count and the
    smallest of its changes in the pairs before `close_pair` (with the `carried` ones: count, smallest, sorted),
    its change density and whether the carried changes were too few for it."""
    with np.errstate(invalid="ignore"):
        valid = np.isfinite(norms) & (norms > 0)
    both = valid[:, 1:] & valid[:, :-1] & consecutive
    del valid
    compared = both[:, pair_from:].sum(axis=0)
    equal = both & (norms[:, 1:] == norms[:, :-1])
    cols, rows = np.nonzero(equal[:, pair_from:])
    rows += pair_from
    cell = norms[cols, rows + 1]
    new = (rows == 0) | ~equal[cols, np.maximum(rows - 1, 0)]
    usable = (both & ~equal)[:, pair_from:]
    del both, equal
    with np.errstate(invalid="ignore", divide="ignore"):
        change = np.where(usable, np.abs(norms[:, pair_from + 1 :] / norms[:, pair_from:-1] - 1), np.inf)
    change = change.astype(np.float32)
    split = max(0, close_pair - pair_from)
    carried_count, carried_smallest = carried
    closed = usable[:, :split].sum(axis=1) + carried_count
    count = closed + usable[:, split:].sum(axis=1)
    k = np.maximum(1, np.ceil(0.01 * count).astype(np.int64))
    width = carried_smallest.shape[1]
    if width:  # carried: only the new changes below a tensor's kept ones are merged in
        short = bool(((k > width) & (carried_count > width)).any())
        keep = _insert_smallest(carried_smallest, change[:, :split])
        h = _kth_of_union(carried_smallest, change, k)
    else:  # the closed changes' smallest, enough for the k-th smallest of a run a quarter longer (every block alike)
        k_closed = max(1, -(-split // 100))
        keep = _smallest(change[:, :split], k_closed + k_closed // 4 + 16)
        short = False
        enough = ((k <= keep.shape[1]) | (closed <= keep.shape[1])).all()
        h = _kth_of_union(keep, change[:, split:], k) if enough else _kth_smallest(change, k)
    ok = np.isfinite(h) & (h > 0) & (count >= k)
    density = np.where(ok, k / (2 * np.where(ok, h, 1.0) * np.maximum(count, 1)), 0.0)
    return compared, (rows, cols + first, cell, new), closed, keep, density, short


def _smallest(values: np.ndarray, width: int) -> np.ndarray:
    """Each row's `width` smallest values, sorted (inf past a row's own)."""
    if width < values.shape[1]:
        values = np.partition(values, width - 1, axis=1)[:, :width]
    padded = np.full((len(values), width), np.inf, dtype=values.dtype)
    padded[:, : values.shape[1]] = np.sort(values, axis=1)
    return padded


def _places(smallest: np.ndarray, rows: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Where each of `values` goes in its row of `smallest` (sorted rows): after the equal ones (a binary search,
    all values at once)."""
    width = smallest.shape[1]
    lo, hi = np.zeros(rows.size, dtype=np.int64), np.full(rows.size, width, dtype=np.int64)
    for _ in range(width.bit_length()):
        mid = (lo + hi) // 2
        searching = lo < hi
        after = smallest[rows, np.minimum(mid, width - 1)] <= values
        lo = np.where(searching & after, mid + 1, lo)
        hi = np.where(searching & ~after, mid, hi)
    return lo


def _below(bound: np.ndarray, values: np.ndarray):
    """The `values` below their row's `bound`: rows and values, by row then value."""
    rows, cols = np.nonzero(values < bound[:, None])
    picked = values[rows, cols]
    order = np.lexsort((picked, rows))
    return rows[order], picked[order]


def _insert_smallest(smallest: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The sorted rows of `smallest` with each row's `values` below its largest merged in, kept to their width:
    the new changes' share, the kept ones only moved along."""
    rows, below = _below(smallest[:, -1], values)
    if not rows.size:
        return smallest
    width = smallest.shape[1]
    merged = np.insert(smallest.ravel(), rows * width + _places(smallest, rows, below), below)
    # Row r holds width + (its new values) in `merged`, after the rows before it and theirs: drop its last ones.
    kept = np.ones(merged.size, dtype=bool)
    kept[(rows + 1) * width + np.arange(rows.size)] = False
    return merged[kept].reshape(smallest.shape)


def _kth_of_union(smallest: np.ndarray, values: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Each row's `k`-th smallest of its sorted `smallest` (the row's smallest values so far, inf-padded) and
    its `values`: only the values below the row's k-th kept one can move it, and with m of them it lies among
    the kept ones from the (k - m)-th on."""
    width = smallest.shape[1]
    bound = np.full(len(smallest), np.inf, dtype=smallest.dtype)
    inside = k <= width
    bound[inside] = smallest[inside, k[inside] - 1]
    rows, below = _below(bound, values)
    many = np.bincount(rows, minlength=len(smallest))
    start = np.cumsum(many) - many
    most = int(many.max(initial=0))
    new = np.full((len(smallest), most), np.inf, dtype=smallest.dtype)
    new[rows, np.arange(rows.size) - start[rows]] = below
    first = np.maximum(0, k - 1 - many)  # the kept ones before it are below it whatever the new ones are
    at = first[:, None] + np.arange(most + 1)
    kept = np.where(at < width, np.take_along_axis(smallest, np.minimum(at, width - 1), axis=1), np.inf)
    window = np.sort(np.concatenate([kept, new], axis=1), axis=1)
    return np.take_along_axis(window, (k - 1 - first)[:, None], axis=1)[:, 0].astype(np.float64)


def _kth_smallest(values: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Each row's `k`-th smallest value (float64; inf where the row is shorter)."""
    h = np.full(len(values), np.inf)
    if values.shape[1]:
        kth = np.minimum(k, values.shape[1]) - 1
        h = np.take_along_axis(np.partition(values, np.unique(kth), axis=1), kth[:, None], axis=1)[:, 0]
        h = h.astype(np.float64)
    return h
