"""LOOP-05 gradient-norm anomaly."""

from __future__ import annotations

import numpy as np

from ..core.artifacts import GRAD_HIST_EDGES
from .base import AuditContext, Check, Finding, at_least, count, positive
from .gradient_columns import add_groups, gradient_columns, sum_by_group
from .stats.rolling import (
    adaptive_window,
    block_stats,
    column,
    dominant_period,
    nonfinite_logged,
    normal_sf,
    previous_block_stats,
    robust_z,
    skipped_updates,
    step_frame,
    warmup_end,
)

# Log-norm sigma floor: a history flatter than this (e = 1.2x) does not make small wobbles alarms.
LOG_SIGMA_FLOOR = np.log(1.2)
# The log-norm sigma is the median over this many previous blocks (one volatile block must not hide a
# broken layer); a block less than half outside warmup is no baseline.
SIGMA_BLOCKS = 4
MIN_BASELINE_SHARE = 0.5


class GradientNormAnomaly(Check):
    """Gradient-norm anomaly (trigger point: after backward).

    What it detects:
        Non-finite loss or gradients, per tensor, that reached the weights (a step the fp16 loss scaler
        skipped is LOOP-25's info, in a run whose manifest records a scaler that skips, or an older one that
        does not say; so is a non-finite loss in a log without per-tensor norms); a parameter tensor whose gradient norm spikes (against its
        own history and against the other tensors at that step); the same tensor spiking at a
        fixed interval (one finding with the period); a global-norm spike no single tensor
        explains; a group of tensors whose gradients collapse to ~0 against their own history
        while the rest of the model keeps its gradients (one layer's attention at 1e-14 after a
        too-high learning rate); a parameter that receives gradients but whose weights never move between two
        saves (left out of the optimizer).
    Why it matters:
        One non-finite gradient poisons every weight it touches. A single layer whose gradient is
        suddenly an order of magnitude larger points at hardware (a faulty GPU with ECC errors) or a
        broken layer; periodic spikes at a fixed interval point at the framework (recompilation),
        not the data; a layer whose gradients collapsed stopped learning (a saturated softmax, dead
        activations) while the loss still moves through the rest; a tensor left out of the optimizer
        trains nothing while the loss looks fine.
    Statistic:
        Per tensor, y = log(L2 norm); its baseline is the median of y over the previous block of
        `window` steps (default: run length / 16, between 8 and 128 steps) and, as sigma, the median
        of the robust sigmas (1.4826 x MAD) of the previous 4 blocks (one volatile block must not
        hide a broken layer). Warmup steps are no baseline; a block less than half outside warmup
        gives none. Own-history z = (y - median) / max(sigma, log 1.2); effect size = norm / exp(median).
        Across tensors, each tensor's log-ratio to its baseline is compared with
        the mean + `sigma_across` std of all tensors' log-ratios at that step (raw norms differ by
        orders of magnitude between embeddings and norms, so they are not compared directly).
        Warmup (until the learning rate stops rising) is excluded. The chart draws, per step, the
        largest tensor's norm / its running median beside the typical tensor's (the geometric mean of
        every tensor's ratio): a spike stands out from the typical tensor; both rising together is a
        burst across the model (a hard batch), which the global norm's rule judges. Collapse: the same
        own-history z and ratio, downwards, counted per step across tensors. Weight movement: the shim
        records float64 weight norms at start and at every save; an unchanged norm while the
        tensor's gradients were non-zero means the weights did not move.
    Threshold:
        Spike: own-history z >= `sigma_own` (6, OLMo-core's rule), effect size >= `min_ratio`
        (10x) and across-tensor z >= `sigma_across` (3): fail at its first step.
        At least 4 own-history spikes of one tensor, 3/4 of them at one interval: one warn with the period. Global norm
        spike (same own-history rule) with no tensor spike: warn (a non-finite norm is never a spike); where LOOP-27
        warns of an isolated spike at each step it flagged, the event is told once, by LOOP-27 (which names this
        rule). Collapse:
        own-history z <= -`sigma_own` and norm at least `collapse_ratio` (1000x) below its running median for
        `collapse_steps` (3) steps in a row, while fewer than half of the tensors collapsed at that step (a
        model-wide fall is a loss at 0 or a learning rate at 0, judged elsewhere): fail at its first step. Non-finite
        gradients at a step the optimizer did not skip: fail. Weights
        unchanged between saves with non-zero gradients: fail.
    Evidence:
        The tensors with norm, baseline median, effect size (or fall), z, p-value, steps flagged; the
        histogram of log10|g| of the first tensor at that step when one was recorded; for frozen
        weights the saves compared and the gradient norms seen between them.
    """

    code = "LOOP-05"
    name = "gradient-norm anomaly"
    rules = {
        "non-finite-loss": "the recorded loss became non-finite",
        "non-finite-gradient": "gradients became non-finite",
        "periodic-spike": "a tensor's gradient norm spikes on a fixed period",
        "own-history-spike": "a tensor's gradient norm jumped against its own running median",
        "global-spike": "the global gradient norm jumped with no single tensor standing out",
        "gradient-collapse": "tensors' gradients collapsed far below their own running median",
        "weights-unchanged": "a tensor received gradients but its weights did not change between checkpoints",
    }
    needs = ("steps",)
    source_needs = ("grad_norm",)
    uses = ("grad_norms",)  # per tensor: without it, the global norm alone
    # An isolated spike of the global norm is LOOP-27's too, which gives the loss beside it.
    restated_by = {"global-spike": "LOOP-27/spike"}
    defaults = {
        "max_tensors_listed": count(20),
        "sigma_across": positive(3.0),
        "sigma_own": positive(6.0),
        "min_ratio": at_least(10.0, 1),
        "window": count(None, low=2),
        "warmup_steps": count(None, low=0),
        "min_periodic_spikes": count(4),
        "collapse_ratio": at_least(1000.0, 1),
        "collapse_steps": count(3),
    }

    def run(self, ctx: AuditContext) -> list[Finding]:
        logged_steps, _, bad_norm, has_norm = nonfinite_logged(ctx)
        # With no loss scaler (nor DeepSpeed's overflow check) nothing skipped a step: finite gradients after a
        # non-finite one do not make it a benign skip.
        skipped = skipped_updates(bad_norm, has_norm, ctx.manifest)
        return (
            self._nonfinite_loss(ctx)
            + self._nonfinite_grads(ctx, logged_steps[skipped])
            + self._spikes(ctx, skipped)
            + self._weights_not_moving(ctx)
        )

    # ------------------------------------------------------------------ non-finite

    def _nonfinite_loss(self, ctx: AuditContext) -> list[Finding]:
        # With per-tensor norms recorded (the shim) the non-finite loss is reported here, beside the tensors it
        # poisoned; a log without them (an import) is LOOP-25's.
        if not ctx.has_rows("grad_norms"):
            return []
        row = ctx.row(
            """
            SELECT min(step), max(step), count(*),
                   (SELECT arg_max(loss, step) FROM steps s2
                     WHERE isfinite(s2.loss) AND s2.step < min(s.step)) AS last_finite
            FROM steps s WHERE loss IS NOT NULL AND NOT isfinite(loss)
            """
        )
        first, last, n, last_finite = row
        if first is None:
            return []
        return [
            self.finding(
                "non-finite-loss",
                "fail",
                f"loss became non-finite at step {first} ({n} step(s) through {last}); resume from a checkpoint "
                f"before step {first} and find the batch or learning rate that caused it",
                step=first,
                first_step=first,
                last_step=last,
                steps_affected=n,
                last_finite_loss=last_finite,
            )
        ]

    def _nonfinite_grads(self, ctx: AuditContext, skips: np.ndarray) -> list[Finding]:
        # A step the optimizer skipped (`skips`: the fp16 loss scaler) did not reach the weights: LOOP-25 counts those.
        columns = gradient_columns(ctx)
        bad = columns.steps[columns.nonfinite & ~np.isin(columns.steps, skips)]  # rank 0's, read once already
        others = ctx.frame(  # the other ranks' (hive-partitioned by rank: rank 0's parts are not read again)
            "SELECT DISTINCT step FROM grad_cells WHERE rank <> 0 AND NOT isfinite(norm) "
            "AND step NOT IN (SELECT unnest(?::BIGINT[]))",
            [skips.tolist()],
        )["step"].to_numpy()
        bad = np.union1d(bad, others)
        if not bad.size:
            return []
        first, last, n = int(bad[0]), int(bad[-1]), int(bad.size)
        tensors = ctx.frame(
            """
            SELECT g.tensor, g.norm, s.nonfinite_grads[g.tensor] AS nonfinite_elements
            FROM grad_norms g JOIN steps s USING (rank, seg, step)
            WHERE g.step = ? AND NOT isfinite(g.norm)
            ORDER BY g.idx
            """,
            [first],
        )
        names = tensors["tensor"].to_list()
        shown = names[: self.params["max_tensors_listed"]]
        return [
            self.finding(
                "non-finite-gradient",
                "fail",
                f"gradients became non-finite at step {first} in {len(names)} tensor(s), first {names[0]}; "
                f"resume from a checkpoint before step {first} and skip or inspect that step's batch",
                step=first,
                first_step=first,
                last_step=last,
                steps_affected=n,
                tensor_count=len(names),
                tensors=tensors.head(self.params["max_tensors_listed"]).to_dicts(),
                tensors_truncated=len(names) > len(shown),
            )
        ]

    # ------------------------------------------------------------------ spikes

    def _spikes(self, ctx: AuditContext, skipped: np.ndarray) -> list[Finding]:
        steps_frame = step_frame(ctx, "lr", "grad_norm")
        if steps_frame.height < 2:
            return []
        steps = steps_frame["step"].to_numpy()
        columns = gradient_columns(ctx)
        names = columns.names
        # Non-finite norms are no spikes: a skipped update is LOOP-25's info, an applied one the non-finite rule's.
        g = column(steps_frame, "grad_norm")
        with np.errstate(divide="ignore", invalid="ignore"):
            global_y = np.log(np.where(np.isfinite(g) & (g > 0), g, np.nan))
        window = self.params["window"] or adaptive_window(steps.size)
        warmup = self.params["warmup_steps"]
        first_judged = (
            steps[0] + warmup
            if warmup is not None
            else steps[warmup_end(np.nan_to_num(column(steps_frame, "lr")), skipped)]
        )
        judged = steps >= first_judged
        cells, largest, across, collapsed = self._own_history(columns, judged, window)
        tensor, cell_step, norm, median, log_ratio, z_own = cells
        # The cross-tensor rule at the cells that spiked on their own: against every tensor's log-ratio at that step.
        total, total_sq, count = across
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = total / count
            spread = np.sqrt(np.maximum(total_sq / count - mean**2, 0.0))
            z_across = (log_ratio - mean[cell_step]) / np.where(spread[cell_step] > 0, spread[cell_step], np.nan)
            flagged = z_across >= self.params["sigma_across"]
        # The largest tensor's excursion beside the typical tensor's: a spike is one tensor standing out from
        # the others; both rising together is a burst across the model (a hard batch), the global norm's rule.
        # (Where no tensor's norm was recorded, as in an import, there is neither: no chart of constants.)
        if names:
            ctx.add_series(
                self.code,
                "largest tensor's gradient norm / its running median (a spike must also stand out from the typical "
                "tensor)",
                steps,
                np.nan_to_num(np.exp(largest)),
                self.params["min_ratio"],
            )
            with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
                typical = np.exp(np.where(count > 0, mean, 0.0))
            ctx.add_series(
                self.code,
                "typical tensor's gradient norm / its running median (rising with the largest: a model-wide burst)",
                steps,
                np.nan_to_num(typical, nan=1.0),
            )

        findings: list[Finding] = self._collapses(steps, names, collapsed, count)
        episodes: dict[int, list[dict]] = {}  # first step -> tensors whose spikes start there
        explained = np.zeros(steps.size, dtype=bool)  # steps a tensor-level finding accounts for
        explained[cell_step[flagged]] = True
        order = np.lexsort((cell_step, tensor))  # by tensor, then step
        spiking, starts = np.unique(tensor[order], return_index=True)
        for col, own in zip(spiking, np.split(order, starts[1:])):
            # Periodicity is judged on the tensor's own history: other tensors may spike with it.
            period = dominant_period(steps[cell_step[own]], self.params["min_periodic_spikes"])
            chosen = own if period is not None else own[flagged[own]]
            if not chosen.size:
                continue
            i = chosen[0]
            entry = {
                "tensor": names[col],
                "norm": float(norm[i]),
                "baseline_median": float(np.exp(median[i])),
                "effect_size": float(np.exp(log_ratio[i])),
                "z_own": float(z_own[i]),
                "p_value": normal_sf(z_own[i]),
                "z_across": float(z_across[i]),
                "steps_flagged": int(chosen.size),
                "last_step": int(steps[cell_step[chosen[-1]]]),
            }
            at = int(steps[cell_step[i]])
            if period is not None:
                explained[cell_step[chosen]] = True
                findings.append(
                    self.finding(
                        "periodic-spike",
                        "warn",
                        f"{names[col]} gradient norm spikes every {period} steps from step {at} ({chosen.size} spikes, "
                        f"up to {np.exp(log_ratio[chosen].max()):.0f}x its running median); look for work the framework repeats on that "
                        f"period (recompilation, a scheduled hook), not for bad data",
                        step=at,
                        period=period,
                        spike_steps=steps[cell_step[chosen]].tolist(),
                        tensors=[entry],
                        threshold=self.params["min_ratio"],
                        value=entry["effect_size"],
                        **self._histogram(ctx, at, names[col]),
                    )
                )
            else:
                episodes.setdefault(at, []).append(entry)
        for step, tensors in sorted(episodes.items()):
            tensors.sort(key=lambda t: -t["effect_size"])
            top = tensors[0]
            findings.append(
                self.finding(
                    "own-history-spike",
                    "fail",
                    f"gradient norm of {top['tensor']} jumped to {top['effect_size']:.0f}x its running median at step {step}"
                    + (f" (with {len(tensors) - 1} more tensor(s))" if len(tensors) > 1 else "")
                    + f"; inspect that layer and the hardware it ran on, and resume from a checkpoint before step {step}",
                    step=step,
                    tensors=tensors[: self.params["max_tensors_listed"]],
                    threshold=self.params["min_ratio"],
                    value=top["effect_size"],
                    p_value=top["p_value"],
                    effect_size=top["effect_size"],
                    **self._histogram(ctx, step, top["tensor"]),
                )
            )

        # The global norm: a spike shared by many tensors (a bad batch) that no single tensor stands out in.
        g_median, g_sigma = previous_block_stats(
            np.where(judged, global_y, np.nan), window, SIGMA_BLOCKS, MIN_BASELINE_SHARE
        )
        g_z = robust_z(global_y, g_median, g_sigma, LOG_SIGMA_FLOOR)
        with np.errstate(invalid="ignore"):
            g_flag = (
                judged & (g_z >= self.params["sigma_own"]) & (global_y - g_median >= np.log(self.params["min_ratio"]))
            )
        g_flag &= ~explained
        if g_flag.any():
            rows = np.flatnonzero(g_flag)
            row = rows[0]
            effect = float(np.exp(global_y[row] - g_median[row]))
            # A log holds the global norm alone: whether one tensor stood out is not known, so not claimed.
            where = "with no single tensor standing out" if len(names) else "(the log holds no per-tensor norms)"
            findings.append(
                self.finding(
                    "global-spike",
                    "warn",
                    f"global gradient norm jumped to {effect:.0f}x its running median at step {steps[row]} "
                    f"({rows.size} step(s) flagged) {where}; inspect that step's batch",
                    step=steps[row],
                    value=effect,
                    effect_size=effect,
                    p_value=normal_sf(g_z[row]),
                    threshold=self.params["min_ratio"],
                    spike_steps=steps[rows].tolist()[:50],
                )
            )
        return findings

    def _own_history(self, columns, judged: np.ndarray, window: int):
        """Each tensor against its own history, a block of tensors at a time: the cells (tensor, step row,
        norm, baseline log-median, log-ratio, z) that spiked on their own; per step, the largest judged
        log-ratio; the sum, sum of squares and count of every tensor's finite log-ratio (the
        cross-tensor rule's mean and spread); and the collapses: the cells (as above) where a tensor's
        first run of collapsed steps starts, with the count of collapsed tensors per step.

        Carried: a step row's results depend only on the rows up to it, so the rows the audit before judged
        and that are unchanged (`columns.carried`) are taken as they were; the rows after them are judged,
        read from the window `SIGMA_BLOCKS` before the earliest one whose result may change (a collapse
        still running at the carried end starts up to `collapse_steps` - 1 rows before it)."""
        n = judged.size
        run_length = self.params["collapse_steps"]
        unjudged = np.flatnonzero(~judged)
        key = {
            "format": 1,
            "window": window,
            "warmup_rows": int(unjudged.size),  # the steps before the first judged one
            **{p: self.params[p] for p in ("sigma_own", "min_ratio", "collapse_ratio", "collapse_steps")},
        }
        carried = columns.carried(self.code, key)
        since = carried["rows"] if carried else 0
        open_from = max(0, since - (run_length - 1))  # a collapse may start this early and not be carried
        lo = max(0, (open_from // window - SIGMA_BLOCKS) * window)
        m = n - lo
        largest = np.full(m, -np.inf)
        total, total_sq, count, down = np.zeros(m), np.zeros(m), np.zeros(m), np.zeros(m)
        cells, starts = [], []
        if n // window >= 1 and n > window:  # else no step has a previous block to be judged against
            for found, block_largest, sums, collapse in columns.map(
                lambda first, norms: self._block(first, norms, unjudged[unjudged >= lo] - lo, window, open_from - lo),
                first_row=lo,
            ):
                cells.append(found)
                starts.append(collapse[0])
                largest = np.fmax(largest, block_largest)
                total, total_sq = add_groups(total, sums[0]), add_groups(total_sq, sums[1])
                count += sums[2]
                down += collapse[1]
        found, first_runs = _joined(cells), _joined(starts)
        found = _shifted(found, lo, since)
        first_runs = _shifted(first_runs, lo, open_from)
        per_step = {"largest": largest, "total": total, "total_sq": total_sq, "count": count, "down": down}
        per_step = {name: values[since - lo :] for name, values in per_step.items()}
        if carried:
            per_step = {name: np.concatenate([carried[name], values]) for name, values in per_step.items()}
            # Carried cells take the new cells' types (float32 norms and statistics, as a fresh audit's).
            found = tuple(np.concatenate([carried[f"found_{i}"].astype(a.dtype), a]) for i, a in enumerate(found))
            # A tensor whose first collapse was carried keeps it: a later one is no first.
            later = np.isin(first_runs[0], carried["run_0"])
            first_runs = tuple(
                np.concatenate([carried[f"run_{i}"].astype(a.dtype), a[~later]]) for i, a in enumerate(first_runs)
            )
            # In the order a fresh audit finds them: by tensor (and step).
            order, by_tensor = np.lexsort((found[1], found[0])), np.argsort(first_runs[0], kind="stable")
            found, first_runs = tuple(a[order] for a in found), tuple(a[by_tensor] for a in first_runs)
        rows = columns.closing_rows
        done = first_runs[1] + run_length <= rows  # a collapse wholly in the closed rows: no later one is first
        if not carried or carried["rows"] != rows:  # else what it carried is what it would save (40 MB at 10^6)
            columns.carry(
                self.code,
                key,
                rows,
                {name: values[:rows] for name, values in per_step.items()}
                | {f"found_{i}": a[found[1] < rows] for i, a in enumerate(found)}
                | {f"run_{i}": a[done] for i, a in enumerate(first_runs)},
            )
        return (
            found,
            per_step["largest"],
            (per_step["total"], per_step["total_sq"], per_step["count"]),
            (first_runs, per_step["down"]),
        )

    def _block(self, first: int, norms: np.ndarray, unjudged: np.ndarray, window: int, runs_from: int = 0):
        """`_own_history` of one block of tensors (tensors x steps); collapses starting from step `runs_from`."""
        n = norms.shape[1]
        groups = -(-n // window)  # the blocks and the incomplete one after them: the steps in groups of `window`
        # y = log norm, in a buffer of whole groups: a group's log-ratios are computed in place against
        # the statistics of the block before it (a view, not a steps-long copy of them).
        y = np.full((len(norms), groups * window), np.nan, dtype=np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            np.log(norms, out=y[:, :n], where=np.isfinite(norms) & (norms > 0))
        # Warmup steps (tiny learning rates, the untrained model's norms) are no baseline and are not judged.
        y[:, unjudged] = np.nan
        med, sig = block_stats(y[:, :n], window, SIGMA_BLOCKS, MIN_BASELINE_SHARE)
        grouped = y.reshape(len(norms), groups, window)
        grouped[:, 0] = np.nan
        grouped[:, 1:] -= med[:, : groups - 1, None]
        log_ratio = y[:, :n]
        z_own = np.empty_like(y)
        z_grouped = z_own.reshape(grouped.shape)
        z_grouped[:, 0] = np.nan
        np.divide(grouped[:, 1:], np.maximum(sig, LOG_SIGMA_FLOOR)[:, : groups - 1, None], out=z_grouped[:, 1:])
        z_own = z_own[:, :n]
        with np.errstate(invalid="ignore"):
            own = (z_own >= self.params["sigma_own"]) & (log_ratio >= np.log(self.params["min_ratio"]))
            down = (z_own <= -self.params["sigma_own"]) & (log_ratio <= -np.log(self.params["collapse_ratio"]))
        tensor, row = np.nonzero(own)
        del own
        found = (
            tensor + first,
            row,
            norms[tensor, row],
            med[tensor, row // window - 1],
            log_ratio[tensor, row],
            z_own[tensor, row],
        )
        # A collapse: the first run of `collapse_steps` steps in a row far below the tensor's own history.
        some = np.flatnonzero(down[:, runs_from:].any(axis=1))  # the rare tensors with a collapsed step: their runs
        start = _first_run_start(down[some, runs_from:], self.params["collapse_steps"])
        tensor, row = some[start >= 0], start[start >= 0] + runs_from
        collapse = (
            (
                tensor + first,
                row,
                norms[tensor, row],
                med[tensor, row // window - 1],
                log_ratio[tensor, row],
                z_own[tensor, row],
            ),
            down.sum(axis=0),
        )
        del down
        # initial: a step no tensor of the block has a finite log-ratio at has nothing to reduce
        largest = np.fmax.reduce(log_ratio, axis=0, initial=-np.inf)
        finite = np.isfinite(log_ratio)
        log_ratio[~finite] = 0.0
        sums = (sum_by_group(log_ratio), sum_by_group(np.square(log_ratio, out=z_own)), finite.sum(axis=0))
        return found, largest, sums, collapse

    def _collapses(self, steps: np.ndarray, names: list[str], collapsed, count: np.ndarray) -> list[Finding]:
        """Tensors whose gradients fell to a small fraction of their own history for several steps in a row,
        while most tensors did not: a part of the model that stopped learning."""
        (tensor, row, norm, median, log_ratio, z_own), down = collapsed
        # A group, not the whole model: fewer than half of the tensors with a gradient collapsed at that step
        # (a model-wide fall is a loss near 0, LOOP-21's, or a learning rate at 0, LOOP-22's).
        group = down[row] < 0.5 * count[row]
        if not group.any():
            return []
        tensor, row, norm, median, log_ratio, z_own = (a[group] for a in (tensor, row, norm, median, log_ratio, z_own))
        order = np.lexsort((log_ratio, row))  # the earliest first, the deepest fall first among them
        first = int(steps[row[order[0]]])
        listed = [
            {
                "tensor": names[tensor[i]],
                "step": int(steps[row[i]]),
                "norm": float(norm[i]),
                "baseline_median": float(np.exp(median[i])),
                "fall": float(np.exp(-log_ratio[i])),
                "z_own": float(z_own[i]),
            }
            for i in order[: self.params["max_tensors_listed"]]
        ]
        top = listed[0]
        at_first = int((row == row[order[0]]).sum())
        return [
            self.finding(
                "gradient-collapse",
                "fail",
                f"the gradients of {at_first} tensor(s) collapsed at step {first} to {top['norm']:.2g}, "
                f"{top['fall']:.2g}x below their own running median ({top['baseline_median']:.2g}), first "
                f"{top['tensor']}, for {self.params['collapse_steps']}+ steps while most of the model kept its "
                f"gradients"
                + (f" ({len(order) - at_first} more tensor(s) later)" if len(order) > at_first else "")
                + "; that part of the model stopped learning (a saturated softmax or dead activations, often after "
                f"a too-high learning rate): resume from a checkpoint before step {first}, with a lower learning rate",
                step=first,
                kind="collapse",
                tensors=listed,
                tensor_count=int(len(order)),
                collapsed_share=float(down[row[order[0]]] / count[row[order[0]]]),
                threshold=self.params["collapse_ratio"],
                value=top["fall"],
            )
        ]

    def _histogram(self, ctx: AuditContext, step: int, tensor: str) -> dict:
        row = ctx.row(
            "SELECT counts, zeros, nonfinite FROM grad_hists WHERE rank = 0 AND step = ? AND tensor = ? LIMIT 1",
            [step, tensor],
        )
        if row is None:
            return {}
        return {
            "histogram": {
                "tensor": tensor,
                "step": step,
                "edges": GRAD_HIST_EDGES,
                "counts": row[0],
                "zeros": row[1],
                "nonfinite": row[2],
            }
        }

    # ------------------------------------------------------------------ weights that never move

    def _weights_not_moving(self, ctx: AuditContext) -> list[Finding]:
        initial = ctx.manifest.get("param_norms") if ctx.manifest.get("seg", 0) == 0 else None
        saves = ctx.con.execute(
            "SELECT step, path, param_norms FROM checkpoints WHERE rank = 0 AND event = 'saved' AND param_norms IS NOT NULL "
            "ORDER BY step"
        ).fetchall()
        snapshots = ([(0, "start of training", initial)] if initial else []) + saves
        if len(snapshots) < 2:
            return []
        names = [
            r[0]
            for r in ctx.con.execute(
                "SELECT name FROM params WHERE rank = 0 AND idx IS NOT NULL AND seg = (SELECT max(seg) FROM params WHERE rank = 0) "
                "ORDER BY idx"
            ).fetchall()
        ]
        findings = []
        reported: set[int] = set()
        for (a, a_name, a_norms), (b, b_name, b_norms) in zip(snapshots, snapshots[1:]):
            if len(a_norms) != len(names) or len(b_norms) != len(names):
                continue
            unchanged = [i for i in np.flatnonzero(np.asarray(a_norms) == np.asarray(b_norms)) if i not in reported]
            if not unchanged:
                continue
            grads = ctx.con.execute(
                "SELECT g.idx, min(g.step), count(*), max(g.norm), max(g.norm * s.lr) FROM grad_norms g "
                "LEFT JOIN steps s ON s.rank = g.rank AND s.step = g.step WHERE g.rank = 0 AND g.step > ? AND g.step <= ? "
                "AND g.norm > 0 AND g.idx IN (SELECT unnest(?::INTEGER[])) GROUP BY g.idx ORDER BY g.idx",
                [a, b, [int(i) for i in unchanged]],
            ).fetchall()
            for idx, first, n, largest, step_size in grads:
                # The RMS update (lr x |g| / sqrt(n)) under half a float32 ulp of the RMS weight (|w| / sqrt(n)) at
                # every step: updates round away; the learning rate is too small to move it, not a missing optimizer entry.
                if step_size is not None and step_size < b_norms[idx] * 2.0**-24:
                    continue
                reported.add(idx)
                findings.append(
                    self.finding(
                        "weights-unchanged",
                        "fail",
                        f"{names[idx]} received non-zero gradients at {n} step(s) from step {first} but its weights did not "
                        f"change between {a_name} and {b_name}; add it to the optimizer's parameter groups",
                        step=first,
                        tensors=[
                            {
                                "tensor": names[idx],
                                "weight_norm": b_norms[idx],
                                "largest_grad_norm": largest,
                                "steps_with_gradient": n,
                            }
                        ],
                        compared={"from": a_name, "from_step": a, "to": b_name, "to_step": b},
                    )
                )
        return findings


def _joined(parts: list[tuple]) -> tuple:
    """Per-block cell tuples (tensor, step row, norm, log-median, log-ratio, z) joined into one."""
    if parts:
        return tuple(np.concatenate(part) for part in zip(*parts))
    empty = np.zeros(0, dtype=np.float32)  # as a block's cells: float32, so a join with them stays float32
    return (np.zeros(0, dtype=np.intp), np.zeros(0, dtype=np.intp), empty, empty, empty, empty)


def _shifted(cells: tuple, lo: int, since: int) -> tuple:
    """Cells found in the rows read from row `lo` on, at their run's rows, those from row `since` on only."""
    tensor, row, *rest = cells
    row = row + lo
    keep = row >= since
    return (tensor[keep], row[keep], *(a[keep] for a in rest))


def _first_run_start(mask: np.ndarray, length: int) -> np.ndarray:
    """Per row of `mask` (tensors x steps): the step index starting its first run of `length` true steps, or -1."""
    if mask.shape[1] < length or length < 1:
        return np.full(len(mask), -1)
    total = np.cumsum(mask, axis=1, dtype=np.int32)
    window = total[:, length - 1 :].copy()
    window[:, 1:] -= total[:, :-length]
    hit = window >= length
    return np.where(hit.any(axis=1), hit.argmax(axis=1), -1)
