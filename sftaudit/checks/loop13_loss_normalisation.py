"""LOOP-13 loss normalisation and scale."""

from __future__ import annotations

import numpy as np

from .base import AuditContext, CannotJudge, Check, Finding, Option, at_least, count


class LossNormalisation(Check):
    """Loss normalisation and scale (trigger point: after backward, per optimizer window).

    What it detects:
        The objective the optimizer minimised is not the token mean over the optimizer window:
        gradient accumulation taken as the mean of micro-batch means, or per-rank means
        averaged across ranks, so tokens in short micro-batches weigh more. The logged training
        loss disagreeing with the loss the model computed (logged x gradient-accumulation steps;
        a NaN step hidden by the Trainer's `logging_nan_inf_filter`), at any scale: also when the
        backpropagated objective carries the same error (transformers 4.47 with a model whose forward
        takes no `**kwargs`, such as GPT-2, divides no loss by the accumulation steps: logged loss and
        gradients are both GA x the token mean). The backpropagated objective a multiple of the trained loss
        while the log shows the trained one (transformers 4.46 with such a model: the curve looks right, the
        gradients are GA x a large batch's). A first loss far above
        ln(vocabulary), the loss of a uniform guess (a broken head or a loss scaled by mistake).
    Why it matters:
        With a mis-normalised objective, gradient accumulation is no longer a large batch: short
        answers are over-trained and long ones under-trained, and results change with the
        accumulation steps or the number of GPUs. A wrong logged loss sends people chasing a
        divergence that is not there, or hides one that is.
    Statistic:
        Per micro-batch the shim records the model's returned loss (a mean over its shifted target
        tokens n, or a sum over `num_items_in_batch` tokens when the Trainer passes it), n, and the
        gradient that reached that loss in backward: its weight w in the backpropagated objective
        (under TRL's own loss, which never backpropagates the model's `loss`, w is read from the
        gradient on the per-token log-probabilities it is computed from).
        A token's effective weight is t = w / (tokens the loss divides by); the intended weight is
        the same for every token of the window: all micro-batches of the step on one rank, and all
        ranks when the run says its loss is a token mean across ranks (the Trainer's
        `average_tokens_across_devices`, or `token_mean_across_ranks` in the recorder's config or
        in this check's audit config, a declaration made after the run;
        otherwise each rank's own token mean is the objective DDP averages). Relative
        weight error = t / (token-weighted mean of t) - 1 (an overall scale is the learning rate's
        business, not this check's). Logged loss: the Trainer's `loss` metric against the trained
        loss, the token mean of the model's own per-micro-batch losses over the window (sum of model
        loss x the tokens it divides by / the window's target tokens; over all ranks when the loss is
        a token mean across ranks, else the mean of the ranks'), at the same step; the backpropagated
        objective (sum of model loss x w) is set beside it, and judged against the trained loss on its own at
        every recorded step. First loss: the token-mean loss of the first recorded step against ln(vocabulary
        size).
    Threshold:
        Largest |relative weight error| in a step > `max_weight_error` (1%): fail at the first such
        step. Logged loss differs from the recorded one by more than `max_logged_error` (2%, above
        the Trainer's 4-decimal rounding): fail; a non-finite recorded loss logged as finite: fail. The
        objective more than `max_objective_scale` (1.5) times the trained loss, or less than 1/1.5 of it, where
        the logged loss did not already show the same scale: fail at the first such step.
        First loss > `first_loss_factor` (2) x ln(vocabulary): warn. No model loss recorded (a custom
        loss), or no micro-batch weight and no logged loss to compare: not run, saying why.
    Evidence:
        Per step: the micro-batches with their token counts, weights and relative errors; the most
        over-weighted samples (ids and target tokens); the detected convention; for the logged loss
        the two values and their ratio.
    """

    code = "LOOP-13"
    name = "loss normalisation and scale"
    rules = {
        "unequal-token-weights": "the loss weights tokens unequally across micro-batches",
        "nan-hidden-by-filter": "the loss was non-finite but the trainer logged a finite value",
        "logged-loss-mismatch": "the logged training loss is not the recorded loss",
        "objective-scaled": "the backpropagated objective is scaled against a large batch's",
        "initial-loss-high": "the first step's loss is far above a uniform guess",
    }
    needs = ("batches",)
    source_needs = ("micro_batch_loss",)
    defaults = {
        "max_weight_error": at_least(0.01, 0),
        "max_logged_error": at_least(0.02, 0),
        "first_loss_factor": at_least(2.0, 1),
        "max_objective_scale": at_least(1.5, 1),
        "samples_listed": count(5),
        "token_mean_across_ranks": Option(None, kind=bool),
    }  # None: as the run's config says

    def run(self, ctx: AuditContext) -> list[Finding]:
        if not ctx.has_rows("batches"):
            return []
        # Each micro-batch's token count, not its lists: a million batches' lists made into a frame cost 0.2 s of
        # CPU at each audit; the over-weighted micro-batch's are read by its rowid.
        micro = ctx.frame(
            """
            SELECT rowid AS batch_row, rank, step, micro, list_sum(target_tokens) AS n,
                   model_loss, loss_weight, num_items
            FROM batches WHERE target_tokens IS NOT NULL ORDER BY step, rank, micro
            """
        )
        if micro.height == 0:
            return []
        if micro["model_loss"].null_count() == micro.height:
            raise CannotJudge(
                "the model returned no loss (a custom loss computed outside the model), so no per-token mean was "
                "visible; pass labels to the model to have it checked"
            )
        self._judged = False
        self._objective_named = False
        findings = self._weights(ctx, micro) + self._logged(ctx, micro)
        findings += [] if self._objective_named else self._objective(ctx)
        if not self._judged:
            raise CannotJudge(
                "no micro-batch's loss weight was recorded (the model's loss never reached backward: the training "
                "loop computed its own loss) and no logged training loss could be compared with the recorded one"
            )
        return findings + self._first_loss(ctx, micro)

    # ------------------------------------------------------------------ token weights

    def _weights(self, ctx: AuditContext, micro) -> list[Finding]:
        across_ranks = self._across_ranks(ctx)
        ranks = micro["rank"].to_numpy().astype(np.int64)
        steps = micro["step"].to_numpy()
        # One optimizer window per step, or per (step, rank) when each rank normalises by its own tokens
        # (rows come ordered by step, rank, micro, so windows are contiguous either way).
        window = steps if across_ranks else steps * (int(ranks.max()) + 1) + ranks
        n = micro["n"].fill_null(0).to_numpy().astype(float)
        loss = micro["model_loss"].to_numpy().astype(float)
        weight = micro["loss_weight"].to_numpy().astype(float)
        items = micro["num_items"].to_numpy().astype(float)
        divides_by = np.where(np.isfinite(items), items, n)
        with np.errstate(divide="ignore", invalid="ignore"):
            token_weight = weight / divides_by
        usable = np.isfinite(token_weight) & np.isfinite(loss) & (n > 0)
        # A window is judged when every micro-batch of it is usable.
        uniq, start = np.unique(window, return_index=True)
        bounds = np.append(start, steps.size)
        whole = np.logical_and.reduceat(usable, start)
        ok = np.repeat(whole, np.diff(bounds))
        if not ok.any():
            return []
        self._judged = True
        tw = np.where(ok, token_weight, 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            mean_weight = np.add.reduceat(tw * n, start) / np.add.reduceat(np.where(ok, n, 0.0), start)
            rel = np.where(ok, token_weight / np.repeat(mean_weight, np.diff(bounds)) - 1.0, np.nan)
        worst = np.fmax.reduceat(np.abs(np.where(ok, rel, np.nan)), start)
        window_step = steps[start]
        series_steps, first_window = np.unique(window_step, return_index=True)
        ctx.add_series(
            self.code,
            "largest relative token-weight error",
            series_steps.tolist(),
            np.fmax.reduceat(worst, first_window).tolist(),
            self.params["max_weight_error"],
        )
        bad = np.flatnonzero(whole & (worst > self.params["max_weight_error"]))
        if not bad.size:
            return []
        i = int(bad[0])
        step = int(window_step[i])
        rows = slice(int(bounds[i]), int(bounds[i + 1]))
        micro_batches = [
            {
                "rank": int(r),
                "micro": int(m),
                "target_tokens": int(k),
                "loss_weight": float(w),
                "divides_by": float(d),
                "relative_error": float(e),
            }
            for r, m, k, w, d, e in zip(
                micro["rank"][rows], micro["micro"][rows], n[rows], weight[rows], divides_by[rows], rel[rows]
            )
        ]
        over = max(range(len(micro_batches)), key=lambda j: micro_batches[j]["relative_error"])
        ids, per_row = ctx.row(
            "SELECT sample_ids, target_tokens FROM batches WHERE rowid = ?", [micro["batch_row"][int(bounds[i] + over)]]
        )
        samples = sorted(zip(ids, per_row), key=lambda x: x[1])[: self.params["samples_listed"]]
        convention = _convention(weight[rows], divides_by[rows], n[rows], micro["rank"][rows].n_unique())
        top = micro_batches[over]
        return [
            self.finding(
                "unequal-token-weights",
                "fail",
                f"the loss of step {step} weights tokens unequally ({convention}): tokens of micro-batch {top['micro']}"
                f"{' on rank ' + str(top['rank']) if micro['rank'][rows].n_unique() > 1 else ''} "
                f"({top['target_tokens']} target tokens) count {1 + top['relative_error']:.2f}x the window's token mean "
                f"({np.unique(window_step[bad]).size} step(s) affected); divide each micro-batch's summed token loss by the window's total target "
                f"tokens (Trainer: pass num_items_in_batch / keep model_accepts_loss_kwargs)",
                step=step,
                value=float(worst[i]),
                threshold=self.params["max_weight_error"],
                convention=convention,
                steps_affected=int(np.unique(window_step[bad]).size),
                micro_batches=micro_batches,
                over_weighted_samples=[{"sample_id": s, "target_tokens": k} for s, k in samples],
            )
        ]

    # ------------------------------------------------------------------ logged loss

    def _logged(self, ctx: AuditContext, micro) -> list[Finding]:
        logged = ctx.frame("SELECT step, value FROM metrics WHERE rank = 0 AND name = 'loss' ORDER BY step")
        if logged.height == 0:
            return []
        recorded = self._recorded(ctx)
        # Only steps logged one step after the previous log: the Trainer's value is then that one step's.
        steps = logged["step"].to_numpy()
        single = np.diff(np.concatenate([[steps[0] - 1], steps])) == 1
        by_step = {r["step"]: r for r in recorded.iter_rows(named=True) if r["complete"] and r["trained"] is not None}
        pairs = [
            (int(s), float(v), by_step[s])
            for s, v, one in zip(steps, logged["value"].to_list(), single)
            if one and s in by_step and v is not None
        ]
        if pairs:
            self._judged = True
        findings = []
        hidden = [(s, v) for s, v, r in pairs if not np.isfinite(r["trained"]) and np.isfinite(v)]
        if hidden:
            s, v = hidden[0]
            findings.append(
                self.finding(
                    "nan-hidden-by-filter",
                    "fail",
                    f"the loss was non-finite at step {s} but the trainer logged {v:.4g} there ({len(hidden)} step(s)); "
                    f"the Trainer's logging_nan_inf_filter hides NaN steps from the logs: resume from a checkpoint "
                    f"before step {s} and find the batch that produced it",
                    step=s,
                    logged=v,
                    recorded=str(by_step[s]["trained"]),
                    steps_hidden=[h[0] for h in hidden][:50],
                )
            )
        pairs = [(s, v, r) for s, v, r in pairs if np.isfinite(r["trained"]) and np.isfinite(v)]
        if not pairs:
            return findings
        s_arr = np.array([p[0] for p in pairs])
        log_arr = np.array([p[1] for p in pairs], dtype=float)
        rec_arr = np.array([p[2]["trained"] for p in pairs], dtype=float)
        obj_arr = np.array(
            [p[2]["objective"] if p[2]["weighted"] and p[2]["objective"] is not None else np.nan for p in pairs],
            dtype=float,
        )
        off = np.abs(log_arr - rec_arr) > self.params["max_logged_error"] * np.abs(rec_arr) + 5e-4
        if not off.any():
            return findings
        j = int(np.flatnonzero(off)[0])
        step = int(s_arr[j])
        with np.errstate(divide="ignore", invalid="ignore"):
            r = float(log_arr[j] / rec_arr[j])
            objective_ratio = float(obj_arr[j] / rec_arr[j])
        multiple = round(r) if r >= 1.5 and abs(r - round(r)) < 0.05 else None
        accum = ctx.scalar("SELECT max(micro_batches) FROM steps WHERE rank = 0 AND step = ?", [step])
        why = (
            f" = {multiple} x the trained loss {rec_arr[j]:.4g}"
            + (" (the gradient-accumulation steps)" if multiple == accum else "")
            if multiple
            else f", {r:.3g}x the trained loss {rec_arr[j]:.4g}"
        )
        # The backpropagated objective off by the same factor: the gradients are scaled too, not only the log.
        scaled_too = np.isfinite(objective_ratio) and abs(objective_ratio / r - 1) <= self.params["max_logged_error"]
        self._objective_named = bool(scaled_too)
        fix = (
            f"the backpropagated objective is {objective_ratio:.3g}x it too, so the gradients are scaled and a "
            f"gradient-accumulation window weighs micro-batches, not tokens (as transformers 4.47 does with a "
            f"model whose forward takes no **kwargs, e.g. GPT-2: upgrade transformers, or divide each "
            f"micro-batch's loss by the accumulation steps)"
            if scaled_too
            else "the loss curve you are reading is not the loss that was trained: fix the logging's normalisation"
        )
        findings.append(
            self.finding(
                "logged-loss-mismatch",
                "fail",
                f"the logged training loss at step {step} is {log_arr[j]:.4g}{why} ({int(off.sum())} step(s)); {fix}",
                step=step,
                logged=float(log_arr[j]),
                recorded=float(rec_arr[j]),
                ratio=r,
                objective=float(obj_arr[j]) if np.isfinite(obj_arr[j]) else None,
                objective_ratio=objective_ratio if np.isfinite(objective_ratio) else None,
                objective_scaled=bool(scaled_too),
                value=r,
                threshold=self.params["max_logged_error"],
                steps_affected=int(off.sum()),
            )
        )
        return findings

    def _recorded(self, ctx: AuditContext):
        """Per step: the token mean of the model's losses (the loss that was trained, whatever share of it each
        backward got) and the backpropagated objective (sum of model loss x its weight in backward); whether every
        micro-batch had a loss (complete) and a weight (weighted)."""
        across = self._across_ranks(ctx)
        trained = "sum(token_sum) / nullif(sum(n), 0)" if across else "avg(token_sum / nullif(n, 0))"
        return ctx.frame(
            f"""
            SELECT step, {trained} AS trained, avg(objective) AS objective,
                   bool_and(complete) AS complete, bool_and(weighted) AS weighted
            FROM (SELECT rank, step, sum(model_loss * coalesce(num_items, list_sum(target_tokens))) AS token_sum,
                         sum(list_sum(target_tokens)) AS n, sum(model_loss * loss_weight) AS objective,
                         count(model_loss) = count(*) AS complete, count(loss_weight) = count(*) AS weighted
                  FROM batches WHERE target_tokens IS NOT NULL GROUP BY rank, step)
            GROUP BY step ORDER BY step  -- under DDP the Trainer logs the mean of the ranks' losses
            """
        )

    # ------------------------------------------------------------------ backpropagated objective

    def _objective(self, ctx: AuditContext) -> list[Finding]:
        """The objective backpropagated a multiple of the loss trained, whatever the log shows: transformers 4.46
        logs a model without **kwargs at the micro-batch mean while each backward gets the whole micro-batch
        mean (GA x the token mean; the log looks right, the gradients are GA x a large batch's)."""
        recorded = self._recorded(ctx).filter("complete", "weighted")
        if recorded.height == 0:
            return []
        steps = recorded["step"].to_numpy()
        trained = recorded["trained"].to_numpy().astype(float)
        objective = recorded["objective"].to_numpy().astype(float)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = objective / trained
        limit = self.params["max_objective_scale"]
        off = np.isfinite(ratio) & (np.abs(trained) > 1e-6) & ((ratio > limit) | (ratio < 1 / limit))
        if not off.any():
            return []
        j = int(np.flatnonzero(off)[0])
        step, r = int(steps[j]), float(ratio[j])
        accum = ctx.scalar("SELECT max(micro_batches) FROM steps WHERE rank = 0 AND step = ?", [step])
        multiple = round(r) if r >= 1.5 and abs(r - round(r)) < 0.05 else None
        logged = ctx.scalar("SELECT value FROM metrics WHERE rank = 0 AND name = 'loss' AND step = ?", [step])
        shown = (
            f" = {multiple} x the trained loss {trained[j]:.4g}"
            + (" (the gradient-accumulation steps)" if multiple == accum else "")
            if multiple
            else f", {r:.3g}x the trained loss {trained[j]:.4g}"
        )
        log = (
            f"; the logged loss ({logged:.4g}) shows the trained one, so the loss curve looks right"
            if logged is not None and abs(logged - trained[j]) <= self.params["max_logged_error"] * abs(trained[j])
            else ""
        )
        return [
            self.finding(
                "objective-scaled",
                "fail",
                f"the backpropagated objective at step {step} is {objective[j]:.4g}{shown} ({int(off.sum())} step(s))"
                f"{log}: the gradients are {r:.3g}x a large batch's (and clipping and the logged grad_norm with "
                f"them); each micro-batch's loss was not divided by the accumulation steps (as transformers 4.46 "
                f"does with a model whose forward takes no **kwargs, e.g. GPT-2): upgrade transformers, or divide "
                f"each micro-batch's loss by the accumulation steps",
                step=step,
                objective=float(objective[j]),
                recorded=float(trained[j]),
                logged=logged,
                objective_ratio=r,
                value=r,
                threshold=limit,
                steps_affected=int(off.sum()),
            )
        ]

    def _across_ranks(self, ctx: AuditContext) -> bool:
        """Whether the run's loss is a token mean across ranks (declared in this check's config or the run's)."""
        config = ctx.manifest.get("config") or {}
        declared = self.params["token_mean_across_ranks"]
        return (
            bool(declared)
            if declared is not None
            else bool(
                config.get("token_mean_across_ranks")
                or (config.get("training_args") or {}).get("average_tokens_across_devices")
            )
        )

    # ------------------------------------------------------------------ first loss

    def _first_loss(self, ctx: AuditContext, micro) -> list[Finding]:
        vocab = (ctx.manifest.get("model") or {}).get("config") or {}
        vocab = vocab.get("vocab_size") or (ctx.manifest.get("tokenizer") or {}).get("length")
        if ctx.manifest.get("seg", 0) != 0 and ctx.scalar("SELECT min(seg) FROM batches") != 0:
            return []
        first = ctx.row(
            "SELECT step, sum(model_loss * coalesce(num_items, list_sum(target_tokens))) / "
            "sum(list_sum(target_tokens)) FROM batches WHERE rank = 0 AND seg = 0 AND model_loss IS NOT NULL "
            "GROUP BY step ORDER BY step LIMIT 1"
        )
        if not vocab or first is None or first[1] is None or not np.isfinite(first[1]):
            return []
        uniform = float(np.log(vocab))
        if first[1] <= self.params["first_loss_factor"] * uniform:
            return []
        return [
            self.finding(
                "initial-loss-high",
                "warn",
                f"the first step's loss is {first[1]:.3g}, {first[1] / uniform:.1f}x ln(vocabulary) = {uniform:.2f}, the loss of a "
                f"uniform guess; check the output head's initialisation and any scaling applied to the loss",
                step=int(first[0]),
                value=float(first[1]),
                threshold=self.params["first_loss_factor"] * uniform,
                vocab_size=int(vocab),
            )
        ]


def _convention(weight: np.ndarray, divides_by: np.ndarray, n: np.ndarray, ranks: int) -> str:
    """Name the normalisation the weights show (for the finding's message)."""
    per_mean = np.allclose(divides_by, n)
    if per_mean and np.allclose(weight, weight[0], rtol=1e-3):
        if ranks > 1:
            return "mean of per-rank means"
        return (
            "mean of micro-batch means"
            if np.isclose(weight[0] * len(weight), 1.0, rtol=1e-3)
            else "micro-batch means with equal weights"
        )
    return "unequal per-micro-batch weights"
