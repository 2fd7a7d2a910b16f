"""LOOP-15 trainable-set conformance."""

from __future__ import annotations

from fnmatch import fnmatchcase

import numpy as np

from .base import AuditContext, Check, Finding
from .rolling import runs_of


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
        consecutive steps compared for exact equality (float32 norms of different batches'
        gradients are never equal by chance). The declared patterns (fnmatch) against the
        parameter names and their `requires_grad` at start.
    Threshold:
        No or zero gradient for `min_steps` (3) consecutive recorded steps: fail at the last of
        them. Declared trainable but frozen: fail at the first step. Equal non-zero norm at two
        consecutive steps: fail at the second.
    Evidence:
        The tensors (up to `max_tensors_listed`), the steps, the norms compared, the patterns.
    """

    code = "LOOP-15"
    name = "trainable-set conformance"
    needs = ("grad_norms",)
    defaults = {"min_steps": 3, "max_tensors_listed": 20}

    def run(self, ctx: AuditContext) -> list[Finding]:
        params = ctx.frame("SELECT idx, name, requires_grad FROM params WHERE rank = 0 AND idx IS NOT NULL "
                           "AND seg = (SELECT max(seg) FROM params WHERE rank = 0) ORDER BY idx")
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
        return [self.finding(
            "fail", f"the trainable set differs from the declared one: {'; '.join(what)}; check the freezing code and "
            f"the adapter's target modules", step=first_step, tensors=frozen[: self.params["max_tensors_listed"]],
            tensor_count=len(frozen), unmatched_patterns=unmatched, declared=patterns)]

    def _gradients(self, ctx: AuditContext, params) -> list[Finding]:
        steps = ctx.con.sql("SELECT DISTINCT step FROM grad_norms WHERE rank = 0 ORDER BY step").fetchnumpy()["step"]
        if steps.size == 0:
            return []
        cells = ctx.con.sql("SELECT step, idx, norm FROM grad_norms WHERE rank = 0").fetchnumpy()
        n_params = int(params["idx"].max()) + 1
        norms = np.full((steps.size, n_params), np.nan)
        present = np.zeros((steps.size, n_params), dtype=bool)
        rows = np.searchsorted(steps, cells["step"])
        norms[rows, cells["idx"]] = cells["norm"]
        present[rows, cells["idx"]] = True
        names = dict(zip(params["idx"].to_list(), params["name"].to_list()))
        requires = np.zeros(n_params, dtype=bool)
        requires[params["idx"].to_numpy()] = params["requires_grad"].fill_null(False).to_numpy()
        findings = []

        starved = (~present | (norms == 0)) & requires[None, :]
        k = min(self.params["min_steps"], steps.size)
        first_hit = {}
        for col in np.flatnonzero(starved.any(axis=0)):
            hits = runs_of(starved[:, col], k)
            if hits.size:
                first_hit[col] = int(hits[0])
        if first_hit:
            row = min(first_hit.values())
            cols = sorted((c for c, r in first_hit.items() if r == row), key=lambda c: c)
            none = [names[c] for c in cols if not present[row, c]]
            listed = [{"tensor": names[c], "gradient": "none" if not present[row, c] else "zero"} for c in cols]
            findings.append(self.finding(
                "fail",
                f"{len(cols)} tensor(s) that require grad got {'no' if none else 'zero'} gradient for {k} steps in a row "
                f"(through step {steps[row]}), first {names[cols[0]]}; with gradient checkpointing use "
                f"use_reentrant=False or enable_input_require_grads(), and check what detaches them from the loss",
                step=int(steps[row]), tensors=listed[: self.params["max_tensors_listed"]], tensor_count=len(cols),
                min_steps=k, other_tensors_later=len(first_hit) - len(cols)))

        consecutive = np.diff(steps) == 1
        with np.errstate(invalid="ignore"):
            stale = (norms[1:] == norms[:-1]) & (norms[1:] > 0) & np.isfinite(norms[1:]) & consecutive[:, None]
        if stale.any():
            row = int(np.flatnonzero(stale.any(axis=1))[0])
            cols = np.flatnonzero(stale[row])
            findings.append(self.finding(
                "fail",
                f"{cols.size} tensor(s) had a gradient bit-identical in norm to the previous step's at step {steps[row + 1]}, "
                f"first {names[int(cols[0])]} ({int(stale.any(axis=1).sum())} step(s)): a stale gradient buffer is reused "
                f"(ZeRO bucket, a hook that caches, a missing zero_grad with a frozen graph); resume from a checkpoint before it",
                step=int(steps[row + 1]),
                tensors=[{"tensor": names[int(c)], "norm": float(norms[row + 1, c])} for c in cols[: self.params["max_tensors_listed"]]],
                tensor_count=int(cols.size), steps_affected=int(stale.any(axis=1).sum())))
        return findings
