"""LOOP-10 loss pathologies and rolling-window drift."""

from __future__ import annotations

import numpy as np

from .base import AuditContext, CannotJudge, Check, Finding, at_least, count, positive, probability
from .carried_curve import carried_curve, carried_excursions, carried_tail
from .gradient_columns import gradient_columns
from .stats.curve import LENSES, lone_peaks, short_log_peaks
from .stats.rolling import (
    adaptive_window,
    column,
    loss_family,
    nonfinite_logged,
    normal_sf,
    rows_per_log,
    skipped_updates,
    step_frame,
    warmup_end,
)


class LossDynamics(Check):
    """Loss pathologies and rolling-window drift (runs after every step).

    What it detects:
        A loss spike (a batch the model cannot predict, such as garbage text, or an update that knocked the
        model off and that it recovered from), a learning rate that jumps outside warmup, a loss plateau,
        training vs validation loss divergence (when the run logs `eval_loss`), and distribution drift of the
        loss, the global and per-tensor gradient norms and the probe entropy between consecutive windows. A loss
        that rises and stays up is LOOP-19's; a spike of the logged global gradient norm is LOOP-27's.
    Why it matters:
        Each of the three loss-curve pathologies points at a cause: a plateau (homogeneous data or too few
        useful tokens), periodic spikes (contaminated batches) and a growing train/validation gap
        (over-fitting or leakage). A learning-rate jump outside warmup is a scheduler or resume bug.
    Statistic:
        Spikes are judged against the run's own noise at its logging resolution, from the first logged steps, never a
        fixed floor. On log(loss) (a loss's noise scales with its level): each logged value's residual from the median
        of the 5 values before it (at least 3: a level of 2 is their mean, which one dip drags down, so the return to
        trend after it would read as a spike), over the noise of such a residual where the value lies: the robust sigma (1.4826 MAD
        / sqrt 6) of second differences of log loss pooled over a centred window of at least 32 logged values (second
        differences leave a trend out, even a fine-tune's steep first fall), floored at one rounding step of the log at
        that level (0.0002 after 0.0001 in a 4-decimal log is one step, not a doubling). One-sided: a value below its
        running level is never a spike, however the curve bends. The threshold is scaled by the run's upper-tail factor:
        the 90th percentile of its standardised residuals above their median over their MAD, relative to a normal
        distribution's. A per-step loss of few rows is right-skewed (one hard row lifts the mean) and a preference loss
        (DPO, ORPO, KTO: `rewards/*`, `logps/*` logged) heavy-tailed: the factor measures it; the rows each logged value
        averages (batch x accumulation x logging interval) are reported. A policy-gradient loss (GRPO, PPO: `kl`,
        `reward` logged) is no fit of the data: no spikes or plateaus judged. A running level of the values before lags
        a loss that falls fast (a short log halving in a few windows), so each value is also judged against the midpoint
        of its two neighbours (minus half the second difference of log loss: a trend leaves it out), over the noise of
        such a residual (the sigma above x sqrt(3/2)), scaled by its own tail factor; and so again on the square root of
        the loss (a low loss is a mean of rare errors whose noise grows like the square root of its level: its log
        swings with every window that happens to hold none, and a spike hides in the swing). A log too short for a noise
        estimate (6 values or fewer) is judged against the rest of the log: a value (from the third to the one before
        last) against the highest of the other values after the first. Learning-rate ratio lr[s] / lr[s-1] after warmup
        (a step the fp16 loss scaler skipped, LR held, does not end it). Plateau: relative change of the block median
        loss over `plateau_blocks` blocks. Train/val: eval_loss rising at `gap_evals` consecutive evaluations while the
        training loss block median falls. Drift: two-sided Mann-Whitney U between consecutive windows of each series'
        absolute step-to-step change of log value (volatility, indifferent to a smooth trend), Benjamini-Hochberg
        corrected across all series and windows.
    Threshold:
        Spike: z >= `sigma_spike` (6) x tail factor and at least `min_effect` (1.2) x the running level, back below that
        bar within `diverge_steps` (5) logged steps: warn (longer, or through the end, is LOOP-19's divergence). Peak (a
        value the running level missed): z >= `sigma_spike` x its tail factor and at least `min_effect` x each
        neighbour, on either the log or the square root: warn. Short log: at least `short_log_effect` (1.5) x every
        other value after the first: warn. A one-sided normal p of 1e-9 at z 6 (2e-9 over two lenses) keeps false
        spikes under 1% even over a 10-million-point log (family-wise
        control; Benjamini-Hochberg over normal p-values raised false spikes on per-step logs whose tails outrun the
        factor). Learning-rate jump: ratio >= `lr_jump` (10x) or <= 1/`lr_jump`, unless the step keeps (within 50%) the
        per-step slope of the interval before it (a decay reaching 0): warn; not judged on a run imported from its logs
        (LOOP-14 judges a logged schedule against its plan). Plateau: change < `plateau_tolerance` (0.5%) over 4 blocks
        after warmup: info (a converged and a stuck loss look alike; the eval metrics decide). Train/val: 3 rising
        evals: warn. Drift: BH q < `fdr_q` (0.01) and volatility ratio >= 3: info (drift is context for the other
        findings, not a verdict). Fewer than 3 logged steps: not judged.
    Evidence:
        Loss, running level, z, p-value and effect size at the step, the logged steps it stayed up; the tail
        factor, the log's rounding step and the rows per logged value; the learning rates around a jump; block
        medians of a plateau; drifted series with q-values.
    """

    code = "LOOP-10"
    name = "loss pathologies and drift"
    rules = {
        "loss-spike": "the loss spiked against its own step-to-step noise",
        "loss-peak": "one logged loss stood above both its neighbours, against the run's noise of such a stand",
        "short-log-peak": "in a log too short for a noise estimate, one logged loss stood far above all the others",
        "lr-jump": "the learning rate changed abruptly in one step after warmup",
        "plateau": "the loss plateaued",
        "overfitting": "validation loss rose at several evaluations in a row while the training loss fell",
        "volatility": "the step-to-step volatility of logged series rose",
    }
    needs = ("steps",)
    defaults = {
        "sigma_spike": positive(6.0),
        "min_effect": at_least(1.2, 1),
        "short_log_effect": at_least(1.5, 1),
        "diverge_steps": count(5),
        "window": count(None, low=2),
        "lr_jump": at_least(10.0, 1),
        "plateau_blocks": count(4, low=2),
        "plateau_tolerance": at_least(0.005, 0),
        "gap_evals": count(3),
        "fdr_q": probability(0.01),
        "min_volatility_ratio": at_least(3.0, 1),
        "max_series_listed": count(20),
    }

    def run(self, ctx: AuditContext) -> list[Finding]:
        frame = step_frame(ctx, "loss", "lr", "grad_norm")
        if frame.height < 3:
            raise CannotJudge(f"{frame.height} logged training step(s): too few to judge the loss curve")
        steps = frame["step"].to_numpy()
        loss = column(frame, "loss")
        lr = column(frame, "lr")
        window = self.params["window"] or adaptive_window(steps.size)
        _, _, bad_norm, has_norm = nonfinite_logged(ctx)
        first = warmup_end(np.nan_to_num(lr), skipped_updates(bad_norm, has_norm, ctx.manifest))
        family, _ = loss_family(ctx)
        # A policy-gradient surrogate (GRPO, PPO) is no fit of the data: its spikes and plateaus mean nothing.
        curve = (
            [] if family == "rl" else (self._loss_spikes(ctx, steps, loss) + self._plateau(steps, loss, window, first))
        )
        return (
            curve
            + self._lr_jumps(ctx, steps, lr, first)
            + self._train_val_gap(ctx)
            + self._drift(ctx, frame, window, first)
        )

    def _loss_spikes(self, ctx, steps, loss) -> list[Finding]:
        p = self.params
        curve = carried_curve(ctx, "loss", loss)
        found = carried_excursions(ctx, "loss", loss, p["sigma_spike"], p["diverge_steps"], p["min_effect"])
        z, threshold = found["z"], found["threshold"]
        ctx.add_series(
            self.code,
            "loss z vs its own step-to-step noise",
            steps,
            np.nan_to_num(z, posinf=0.0, neginf=0.0),
            threshold,
            sole_condition=True,
        )
        rows = rows_per_log(ctx)
        findings = []
        # A loss that rose and stayed up is LOOP-19's divergence; after it the baseline is meaningless.
        end = next((s for s, _, sustained in found["episodes"] if sustained), steps.size)
        reported = np.zeros(steps.size, dtype=bool)
        for s, length, _ in found["episodes"]:
            if s >= end:
                break
            reported[s : s + length] = True
            e = s + length - 1
            level = float(np.exp(found["level"][s]))
            effect = float(loss[s] / level)
            findings.append(
                self.finding(
                    "loss-spike",
                    "warn",
                    f"loss spiked at step {steps[s]} to {loss[s]:.4g}, {effect:.3g}x its running level of {level:.4g} "
                    f"(z {z[s]:.1f} against the run's own step-to-step noise, threshold {threshold:.1f}), back within "
                    f"{length} logged step(s); inspect the batches of steps {steps[s]}-{steps[e]} for corrupt samples, "
                    f"and the learning rate if the spike recurs",
                    step=steps[s],
                    value=loss[s],
                    baseline_median=level,
                    z=z[s],
                    p_value=normal_sf(z[s]),
                    effect_size=effect,
                    threshold=threshold,
                    min_effect=p["min_effect"],
                    tail_factor=found["tail"],
                    log_quantum=found["quantum"],
                    rows_per_log=rows,
                    spike_steps=steps[s : e + 1].tolist()[:50],
                )
            )
        root = carried_curve(ctx, "loss-square-root", loss, LENSES["square root"][0])
        return findings + self._peaks(
            ctx, steps, loss, end, reported, rows, {"log": curve.noise, "square root": root.noise}
        )

    def _peaks(self, ctx, steps, loss, end, reported, rows, noises) -> list[Finding]:
        """Lone values over both neighbours that the running level missed (it lags a falling loss), and in a log
        too short for a noise estimate, values far above all the others; before a divergence only."""
        p = self.params
        tails = {
            lens: lambda z, lens=lens: carried_tail(ctx, f"loss-peak-{lens.replace(' ', '-')}", z) for lens in noises
        }
        peaks = lone_peaks(loss, p["sigma_spike"], p["min_effect"], noises=noises, tails=tails)
        findings = []
        for i in peaks["peaks"]:
            if i >= end or reported[i]:
                continue
            lens = peaks["lenses"][peaks["lens"][i]]
            midpoint = float(np.exp(np.log(loss[i]) - peaks["residual"][i]))
            z = float(peaks["z"][i])
            findings.append(
                self.finding(
                    "loss-peak",
                    "warn",
                    f"loss spiked at step {steps[i]} to {loss[i]:.4g}, {loss[i] / midpoint:.3g}x the midpoint of its "
                    f"neighbours ({loss[i - 1]:.4g} at step {steps[i - 1]}, {loss[i + 1]:.4g} at step "
                    f"{steps[i + 1]}; z {z:.1f} against the run's own noise of one value against its neighbours, "
                    f"on the {lens} of the loss, threshold {peaks['threshold'][i]:.1f}) and was back at "
                    f"the next log; inspect the batches of steps "
                    f"{steps[i - 1] + 1}-{steps[i]} for corrupt samples, and the learning rate if the spike recurs",
                    step=steps[i],
                    value=loss[i],
                    baseline_median=midpoint,
                    z=z,
                    p_value=normal_sf(z),
                    effect_size=float(loss[i] / midpoint),
                    over_neighbours=float(np.exp(peaks["prominence"][i])),
                    threshold=float(peaks["threshold"][i]),
                    min_effect=p["min_effect"],
                    lens=lens,
                    tail_factor=peaks["tails"][lens],
                    rows_per_log=rows,
                )
            )
        for i in short_log_peaks(loss, p["short_log_effect"], noise=noises["log"]):
            if i >= end or reported[i]:
                continue
            others = np.delete(loss[1:], i - 1)
            highest = float(np.nanmax(others))
            findings.append(
                self.finding(
                    "short-log-peak",
                    "warn",
                    f"loss spiked at step {steps[i]} to {loss[i]:.4g}, {loss[i] / highest:.3g}x the highest of the "
                    f"other logged values after the first ({highest:.4g}; {steps.size} logged values: too few for a noise "
                    f"estimate, so the rest of the log is the bound, at least {p['short_log_effect']:g}x); inspect the "
                    f"batches of steps {steps[i - 1] + 1}-{steps[i]} for corrupt samples",
                    step=steps[i],
                    value=loss[i],
                    baseline_median=highest,
                    effect_size=float(loss[i] / highest),
                    threshold=p["short_log_effect"],
                    logged_values=loss.tolist(),
                    rows_per_log=rows,
                )
            )
        return findings

    def _lr_jumps(self, ctx, steps, lr, first) -> list[Finding]:
        if not np.isfinite(lr).any():
            return []  # no learning rate logged
        if ctx.manifest.get("imported"):
            return []  # a logged schedule is LOOP-14's: it knows each segment's plan and names the restart
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = lr[1:] / lr[:-1]
        factor = self.params["lr_jump"]
        # Between two LRs both under 1% of the peak (the tail of a decay to 0) a ratio is not a jump.
        with np.errstate(invalid="ignore"):
            material = np.fmax(lr[1:], lr[:-1]) >= 0.01 * np.nanmax(lr)
        # A step that keeps the slope of the interval before it (per step, so logging windows compare) is a
        # schedule running its course, e.g. a linear decay reaching 0 at the last step, not a jump.
        with np.errstate(divide="ignore", invalid="ignore"):
            slope = np.diff(lr) / np.diff(steps)
        keeps_slope = np.abs(slope - np.r_[np.nan, slope[:-1]]) <= 0.5 * np.abs(np.r_[np.nan, slope[:-1]])
        jumps = np.flatnonzero(
            ((ratio >= factor) | (ratio <= 1 / factor)) & material & ~keeps_slope & (np.arange(1, steps.size) > first)
        )
        if not jumps.size:
            return []
        i = jumps[0] + 1
        return [
            self.finding(
                "lr-jump",
                "warn",
                f"learning rate changed {ratio[i - 1]:.3g}x in one step at step {steps[i]} ({lr[i - 1]:.3g} -> {lr[i]:.3g}) "
                f"after warmup; check the scheduler and the resumed optimizer state",
                step=steps[i],
                value=ratio[i - 1],
                threshold=factor,
                lr_before=lr[i - 1],
                lr_after=lr[i],
                jump_steps=steps[jumps + 1].tolist()[:50],
            )
        ]

    def _plateau(self, steps, loss, window, first) -> list[Finding]:
        k = self.params["plateau_blocks"]
        start = -(-max(first, 1) // window) * window  # first whole block after warmup
        blocks = (steps.size - start) // window
        if blocks < k + 1:
            return []
        medians = np.median(loss[start : start + blocks * window].reshape(blocks, window), axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):  # a zero or non-finite median: LOOP-21 / LOOP-25's
            change = (medians[k:] - medians[:-k]) / np.abs(medians[:-k])  # over k blocks; negative = improving
            flat = np.flatnonzero(np.abs(change) < self.params["plateau_tolerance"])
        if not flat.size:
            return []
        b = flat[0]
        at = steps[start + b * window]
        return [
            self.finding(
                "plateau",
                "info",
                f"loss plateaued from step {at}: the running median moved {change[b]:+.2%} over {k * window} steps; "
                f"check the data for homogeneous or mostly masked samples before spending more steps",
                step=at,
                value=change[b],
                threshold=self.params["plateau_tolerance"],
                block_medians=medians[b : b + k + 1].tolist(),
            )
        ]

    def _train_val_gap(self, ctx) -> list[Finding]:
        selected = (ctx.manifest.get("selection") or {}).get("metric")
        if selected not in (None, "eval_loss"):
            return []  # the run selects on another metric (WER, accuracy): LOOP-26 judges over-fitting on it
        evals = ctx.frame(
            "SELECT step, avg(value) AS eval_loss FROM metrics WHERE rank = 0 AND name = 'eval_loss' "
            "GROUP BY step ORDER BY step"
        )
        n = self.params["gap_evals"]
        if evals.height < n + 1:
            return []
        train = ctx.frame(
            "SELECT e.step, (SELECT median(loss) FROM steps s WHERE s.rank = 0 AND s.step <= e.step AND s.step > e.step - 20) AS train "
            "FROM (SELECT DISTINCT step FROM metrics WHERE rank = 0 AND name = 'eval_loss') e ORDER BY e.step"
        )
        ev, tr = evals["eval_loss"].to_numpy(), train["train"].fill_null(np.nan).to_numpy()
        diverging = (np.diff(ev) > 0) & (np.diff(tr) < 0)
        hits = np.flatnonzero(
            np.convolve(diverging.astype(int), np.ones(n, dtype=int), mode="full")[: diverging.size] >= n
        )
        if not hits.size:
            return []
        i = int(hits[0]) - n + 1  # the first rising evaluation of the run of n
        at = int(evals["step"][i + 1])
        return [
            self.finding(
                "overfitting",
                "warn",
                f"validation loss rose at {n} evaluations in a row from step {at} while the training loss fell; "
                f"the model is overfitting its training data: stop or roll back to a checkpoint before step {at}, "
                f"and add data, regularisation or an earlier stop",
                step=at,
                eval_steps=evals["step"].to_list()[i : i + n + 1],
                eval_loss=ev[i : i + n + 1].tolist(),
            )
        ]

    def _drift(self, ctx, frame, window, first) -> list[Finding]:

        steps = frame["step"].to_numpy()
        start = -(-max(first, 1) // window) * window
        blocks = (steps.size - start - 1) // window
        if blocks < 2:
            return []
        columns = gradient_columns(ctx)
        labels = ["loss", "global grad norm"] + [f"grad norm {n}" for n in columns.names]
        logged = np.vstack([column(frame, "loss"), column(frame, "grad_norm")])
        *logged_tests, logged_compared = self._volatility_tests(logged, 0, start, blocks, window)
        at, series, p, effect, compared = self._tensor_tests(columns, start, blocks, window)
        compared = int(logged_compared.sum()) + int(compared.sum())
        at, series, p, effect = (np.concatenate(part) for part in zip(logged_tests, (at, series, p, effect)))
        q = _benjamini_hochberg(p, (blocks - 1) * len(labels))
        hit = q < self.params["fdr_q"]
        if not hit.any():
            return []
        b = int(at[hit].min())
        chosen = np.flatnonzero(hit & (at == b))
        step = int(steps[start + (b + 1) * window + 1])
        listed = sorted(
            ({"series": labels[series[i]], "q_value": float(q[i]), "effect_size": float(effect[i])} for i in chosen),
            key=lambda r: r["q_value"],
        )[: self.params["max_series_listed"]]
        return [
            self.finding(
                "volatility",
                "info",
                f"step-to-step volatility of {chosen.size} series ({listed[0]['series']} first) rose from step {step} "
                f"against the previous {window} steps (Benjamini-Hochberg q < {self.params['fdr_q']})",
                step=step,
                drifted=listed,
                tests=compared,
                threshold=self.params["fdr_q"],
            )
        ]

    def _tensor_tests(self, columns, start: int, blocks: int, window: int):
        """`_volatility_tests` of every tensor's norms (series from 2 on), with the tests compared per window pair.
        Carried: a pair of windows wholly in the closed step rows is tested once; the audit after tests the pairs
        from the last window carried on, reading the rows from it."""
        key = {"format": 1, "window": window, "start": start, "ratio": self.params["min_volatility_ratio"]}
        carried = columns.carried(self.code, key)
        after = max(0, int(carried["windows"]) - 1) if carried else 0  # the first window of a pair not carried
        found = list(
            columns.map(
                lambda first, block: self._volatility_tests(block, 2 + first, 0, blocks - after, window),
                first_row=start + after * window,
            )
        )
        none = (np.zeros(0, dtype=np.intp), np.zeros(0, dtype=np.intp), np.zeros(0), np.zeros(0), np.zeros(0, int))
        at, series, p, effect = (np.concatenate(part) for part in zip(none[:4], *(tests for *tests, _ in found)))
        at += after
        compared = np.sum([none[4]] if not found else [ok for *_, ok in found], axis=0)
        if carried:
            at, series, p, effect = (
                np.concatenate([carried[name], a])
                for name, a in zip(("at", "series", "p", "effect"), (at, series, p, effect))
            )
            compared = np.concatenate([carried["compared"], compared])
            order = np.lexsort((at, series))  # as a fresh audit tests them: by series, then window
            at, series, p, effect = (a[order] for a in (at, series, p, effect))
        windows = min(blocks, max(0, (columns.closing_rows - 1 - start) // window))  # wholly in the closed rows
        done = at + 1 < windows
        columns.carry(
            self.code,
            key,
            columns.closing_rows,
            {"windows": np.array(windows), "compared": compared[: max(0, windows - 1)]}
            | {name: a[done] for name, a in zip(("at", "series", "p", "effect"), (at, series, p, effect))},
        )
        return at, series, p, effect, compared

    def _volatility_tests(self, values: np.ndarray, first_series: int, start: int, blocks: int, window: int):
        """Mann-Whitney U of consecutive windows of each series' step-to-step change (series x steps `values`,
        series numbered from `first_series`) where the volatility rose enough: (window index, series, p-value,
        effect size) of each test, and per window pair how many series could be compared."""
        with np.errstate(divide="ignore", invalid="ignore"):
            change = np.abs(np.diff(np.log(np.where(values > 0, values, np.nan)), axis=1))
        windows = change[:, start : start + blocks * window].reshape(len(values), blocks, window)
        del change
        finite = np.isfinite(windows).all(axis=2)
        ok = finite[:, :-1] & finite[:, 1:]
        ordered = np.sort(windows, axis=2)
        medians = (ordered[..., (window - 1) // 2] + ordered[..., window // 2]) / 2
        del ordered
        with np.errstate(divide="ignore", invalid="ignore"):
            effect = medians[:, 1:] / medians[:, :-1]
        # Only windows whose volatility rose enough to matter are tested; the rest keep p = 1, which
        # can only make the Benjamini-Hochberg correction (over all tests) more conservative.
        series, at = np.nonzero(ok & (effect >= self.params["min_volatility_ratio"]))
        p = np.zeros(0)
        if series.size:
            from scipy import stats  # here, not at module level: only a run with a window to test pays for scipy.stats

            x, y = windows[series, at], windows[series, at + 1]
            # scipy picks its method by whether any test of a call has ties: each test on its own tells.
            ordered = np.sort(np.concatenate([x, y], axis=1), axis=1)
            tied = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
            p = np.empty(series.size)
            for group in (tied, ~tied):
                if group.any():
                    p[group] = stats.mannwhitneyu(x[group], y[group], axis=1, alternative="two-sided").pvalue
        return at, series + first_series, p, effect[series, at], ok.sum(axis=0)


def _benjamini_hochberg(p: np.ndarray, tests: int) -> np.ndarray:
    """Benjamini-Hochberg q-values of `p` among `tests` tests in all, the others' p-values being 1 (so they
    rank last and lower no q-value)."""
    order = np.argsort(p, kind="stable")
    ranked = p[order] * tests / np.arange(1, p.size + 1)
    q = np.empty(p.size)
    q[order] = np.minimum(np.minimum.accumulate(ranked[::-1])[::-1], 1.0)
    return q
