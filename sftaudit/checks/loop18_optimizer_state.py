"""LOOP-18 optimizer state and weight movement, read after the fact."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.safe_io import LFS_HINT, is_lfs_pointer
from ..readers.checkpoints import CheckpointError, inside_run
from ..readers.optimizer_state import (
    OPTIMIZER_FILE,
    AdamState,
    checkpoint_weights,
    load_weight,
    map_names,
    read_adam_state,
)
from ..store.rundb import recorded_checkpoints
from .base import AuditContext, Check, Finding, at_least, count, share


@dataclass
class Snapshot:
    """One checkpoint on disk: its weights and (when saved) its Adam state with per-entry statistics."""

    name: str
    step: int
    folder: Path
    weights: dict[str, Any] = field(default_factory=dict)
    state: AdamState | None = None
    stats: dict[int, dict[str, float]] = field(default_factory=dict)
    problem: str | None = None


class OptimizerState(Check):
    """Optimizer state and weight movement (trigger point: after the fact, per checkpoint).

    What it detects:
        From the Adam state a Trainer saves with each checkpoint (`optimizer.pt`, read statically,
        never unpickled): trainable tensors the optimizer never updated (no state: never a
        gradient; or a second moment that is exactly zero); non-finite moments (a NaN reached the
        optimizer); a tensor whose recent gradient scale (from its second moment) jumped far more
        than its peers' between two checkpoints; updates dominated by Adam's eps. From the weights
        of consecutive checkpoints: a tensor that moved far more than usual, and than its peers,
        in one checkpoint window. (A non-finite loss or gradient norm in the log is the dynamics
        checks' to find, from the log alone.)
    Why it matters:
        A run trained without the shim keeps its per-tensor evidence only here: the moments are
        running means of the last ~10 gradients (exp_avg) and ~1/(1-beta2) squared gradients
        (exp_avg_sq). A tensor never updated trains nothing while the loss looks fine; a NaN in
        the state makes every later update NaN; an update divided mostly by eps is damped
        (common with bf16 moments); a moment or weight jump localises a spike to a checkpoint window.
    Statistic:
        Per state entry, with bias correction at its step t: gradient RMS = sqrt(mean(v / (1 -
        beta2^t))); eps share = fraction of non-zero v elements with sqrt(v_hat) < eps. Between
        consecutive checkpoints A and B: moment jump = RMS_B / RMS_A per tensor; weight movement =
        |w_B - w_A| / |w_A| per tensor, and its ratio to the tensor's movement in the window before.
        Names come from the weights saved beside the state (`sftaudit.readers.optimizer_state`): the
        shape, then among same-shaped tensors their movement between checkpoints (an entry that never
        updated is the tensor that never moved; the last one left is named by elimination); entries
        whose name stays ambiguous are listed by index and shape.
    Threshold:
        No state or all-zero v for a trainable parameter: fail (run). Non-finite moments: fail at
        the first checkpoint window holding them. Moment jump >= `moment_jump` (10x) and >=
        `moment_jump` x the median jump of all tensors: warn. Movement ratio >= `movement_jump`
        (10x) and >= `movement_jump` x the median ratio: warn. eps share >= `eps_share` (0.5) in a
        tensor: warn. The checkpoint-window findings are left to finer evidence when it exists:
        non-finite state when a non-finite loss or gradient norm was logged or recorded, moment and
        movement jumps when per-tensor gradient norms were recorded (LOOP-05 places those at their step).
    Evidence:
        The tensors (name or index, shape, group), their statistics, the checkpoint window
        (`resolution`: first and last step it covers), the checkpoints whose state could not be read.
    """

    code = "LOOP-18"
    name = "optimizer state and weight movement"
    rules = {
        "state-not-read": "the optimizer state of checkpoints could not be read",
        "never-updated": "trainable tensors were never updated by the optimizer",
        "non-finite-state": "the saved optimizer state is non-finite",
        "second-moment-jump": "a tensor's gradient scale (Adam's second moment) grew far beyond its peers'",
        "update-jump": "a tensor moved far more between saves than in the window before",
        "eps-dominated": "updates are dominated by Adam's eps: gradients smaller than eps",
    }
    needs = ("checkpoints",)
    defaults = {
        "moment_jump": at_least(10.0, 1),
        "movement_jump": at_least(10.0, 1),
        "eps_share": share(0.5),
        "max_tensors_listed": count(20),
    }

    def run(self, ctx: AuditContext) -> list[Finding]:
        snapshots = self._snapshots(ctx)
        findings = self._unread(snapshots)
        with_state = [s for s in snapshots if s.state is not None]
        # Checkpoint windows are coarse: where per-step evidence exists, it places the event (LOOP-05 with
        # per-tensor gradient norms, a non-finite logged loss or gradient norm) and the windows stay silent.
        per_tensor = ctx.has_rows("grad_norms")
        nonfinite_logged = (
            per_tensor
            or ctx.scalar("SELECT count(*) FROM steps WHERE NOT isfinite(loss) OR NOT isfinite(grad_norm)") > 0
        )
        if with_state:
            findings += self._never_updated(snapshots, with_state[-1])
            findings += [] if nonfinite_logged else self._nonfinite(snapshots, with_state)
            findings += [] if per_tensor else self._moment_jumps(snapshots, with_state)
            findings += self._eps(with_state)
        findings += [] if per_tensor else self._movement(snapshots)
        return findings

    # ------------------------------------------------------------------ reading

    def _snapshots(self, ctx: AuditContext) -> list[Snapshot]:
        out = []
        for c in recorded_checkpoints(ctx.con):
            try:
                path = inside_run(ctx.run_dir, c["path"])
            except CheckpointError:
                continue
            if not path.exists():
                continue
            snap = Snapshot(c["name"], int(c["step"]), path if path.is_dir() else path.parent)
            try:
                snap.weights = checkpoint_weights(snap.folder)
            except CheckpointError:
                pass  # LOOP-09 reports unreadable weights
            if is_lfs_pointer(snap.folder / OPTIMIZER_FILE):
                snap.problem = f"{OPTIMIZER_FILE} is a {LFS_HINT}"
            elif (snap.folder / OPTIMIZER_FILE).is_file():
                try:
                    snap.state = read_adam_state(snap.folder / OPTIMIZER_FILE)
                    snap.stats = {i: _entry_stats(e, snap.state.groups[e.group]) for i, e in snap.state.entries.items()}
                except CheckpointError as exc:
                    snap.problem = str(exc)
            out.append(snap)
        out.sort(key=lambda s: s.step)
        for before, after in zip(out, out[1:]):
            if after.state is not None and after.weights:
                try:
                    after.state.names = map_names(after.state, after.weights, before.weights)
                except CheckpointError:
                    pass
        for s in out[:1]:
            if s.state is not None and s.weights:
                s.state.names = map_names(s.state, s.weights, {})
        # Parameter indices are the same in every save of a run: a name told apart at one checkpoint holds at
        # the others (where non-finite weights or a missing neighbour leave it ambiguous).
        with_state = [s for s in out if s.state is not None]
        for order in (with_state, with_state[::-1]):
            for a, b in zip(order, order[1:]):
                b.state.names = {**{i: n for i, n in a.state.names.items() if i in b.state.indices}, **b.state.names}
        return out

    def _unread(self, snapshots: list[Snapshot]) -> list[Finding]:
        """One info per reason a state was not read, naming its checkpoints (a clone without git-lfs: all of them)."""
        by_problem: dict[str, list[str]] = {}
        for s in snapshots:
            if s.problem:
                by_problem.setdefault(s.problem, []).append(s.name)
        return [
            self.finding(
                "state-not-read",
                "info",
                f"{names[0] if len(names) == 1 else f'{len(names)} checkpoints ({names[0]} first)'}: "
                f"optimizer state not read ({problem})",
                skipped=names,
            )
            for problem, names in by_problem.items()
        ]

    def _label(self, snap: Snapshot, index: int) -> str:
        name = snap.state.names.get(index) if snap.state else None
        if name:
            return name
        entry = snap.state.entries.get(index) if snap.state else None
        shape = list(entry.exp_avg.shape) if entry is not None else None
        return f"parameter #{index}" + (f" (shape {shape}, name ambiguous)" if shape else "")

    # ------------------------------------------------------------------ state findings

    def _never_updated(self, snapshots: list[Snapshot], newest: Snapshot) -> list[Finding]:
        state = newest.state
        stateless = [i for i in state.indices if i not in state.entries]
        zero = [i for i, s in newest.stats.items() if s["zero"]]
        if not stateless and not zero:
            return []
        tensors = [
            {
                "tensor": self._label(newest, i),
                "index": i,
                "reason": "all-zero second moment",
                "step": state.entries[i].step,
            }
            for i in zero
        ]
        # A parameter without state has no shape on record: name it when the tensors that never moved
        # across the checkpoints, other than those with a state, are exactly as many.
        unmoved = _never_moved(snapshots) - set(state.names.values())
        named = sorted(unmoved) if len(unmoved) == len(stateless) else []
        for k, i in enumerate(stateless):
            tensors.append(
                {
                    "tensor": named[k] if len(named) == 1 else f"parameter #{i}",
                    "index": i,
                    "reason": "no optimizer state: never had a gradient",
                    **({"candidates": sorted(unmoved)[: self.params["max_tensors_listed"]]} if len(named) != 1 else {}),
                }
            )
        listed = tensors[: self.params["max_tensors_listed"]]
        return [
            self.finding(
                "never-updated",
                "fail",
                f"{len(tensors)} trainable tensor(s) were never updated by the optimizer up to {newest.name} "
                f"({listed[0]['tensor']}: {listed[0]['reason']}); check that their gradients reach the optimizer "
                f"(a detached output, a hook or loss that drops them)",
                tensors=listed,
                seen_at=newest.name,
                tensor_count=len(tensors),
            )
        ]

    def _nonfinite(self, snapshots: list[Snapshot], with_state: list[Snapshot]) -> list[Finding]:
        for snap in with_state:
            bad = [i for i, s in snap.stats.items() if s["nonfinite"]]
            if bad:
                first, last, previous = self._window(snapshots, snap)
                return [
                    self.finding(
                        "non-finite-state",
                        "fail",
                        f"the optimizer state saved at {snap.name} is non-finite in {len(bad)} tensor(s) "
                        f"({self._label(snap, bad[0])} first): a non-finite gradient reached the optimizer in steps "
                        f"{first}-{last}; every later update is non-finite. Resume from {previous or 'the start'}",
                        step=first,
                        resolution=_resolution(first, last, previous, snap.name),
                        tensors=[
                            {"tensor": self._label(snap, i), "nonfinite": snap.stats[i]["nonfinite"]}
                            for i in bad[: self.params["max_tensors_listed"]]
                        ],
                    )
                ]
        return []

    def _jump(
        self, rule: str, message: str, a: Snapshot, b: Snapshot, tensors: list[dict], limit: float, median: float
    ) -> Finding:
        """A warn at the first step after save `a`: the listed tensors' ratio between saves `a` and `b` stands
        out from their peers' (`median`)."""
        first = a.step + 1
        return self.finding(
            rule,
            "warn",
            message,
            step=first,
            resolution=_resolution(first, b.step, a.name, b.name),
            tensors=tensors,
            value=tensors[0]["ratio"],
            threshold=limit,
            median_ratio=median,
        )

    def _moment_jumps(self, snapshots: list[Snapshot], with_state: list[Snapshot]) -> list[Finding]:
        findings = []
        for a, b in zip(with_state, with_state[1:]):
            common = [
                i
                for i in b.stats
                if i in a.stats
                and a.stats[i]["rms"] > 0
                and np.isfinite(a.stats[i]["rms"])
                and np.isfinite(b.stats[i]["rms"])
            ]
            if len(common) < 2:
                continue
            ratio = np.array([b.stats[i]["rms"] / a.stats[i]["rms"] for i in common])
            median = float(np.median(ratio))
            limit = self.params["moment_jump"]
            hot = np.flatnonzero((ratio >= limit) & (ratio >= limit * median))
            if not hot.size:
                continue
            order = hot[np.argsort(-ratio[hot])]
            tensors = [
                {
                    "tensor": self._label(b, common[k]),
                    "gradient_rms_before": a.stats[common[k]]["rms"],
                    "gradient_rms_after": b.stats[common[k]]["rms"],
                    "ratio": float(ratio[k]),
                }
                for k in order[: self.params["max_tensors_listed"]]
            ]
            first, last = a.step + 1, b.step
            findings.append(
                self._jump(
                    "second-moment-jump",
                    f"the gradient scale of {tensors[0]['tensor']} (from Adam's second moment) grew {tensors[0]['ratio']:.0f}x "
                    f"between {a.name} and {b.name}, its peers' {median:.2g}x"
                    + (f" (with {len(tensors) - 1} more tensor(s))" if len(tensors) > 1 else "")
                    + f": a gradient spike in steps {first}-{last}; inspect that layer and those steps' data",
                    a,
                    b,
                    tensors,
                    limit,
                    median,
                )
            )
            break  # later windows carry the same moments forward
        return findings

    def _eps(self, with_state: list[Snapshot]) -> list[Finding]:
        snap = next((s for s in reversed(with_state) if all(not x["nonfinite"] for x in s.stats.values())), None)
        if snap is None:
            return []
        damped = sorted(
            (i for i, s in snap.stats.items() if s["eps_share"] >= self.params["eps_share"]),
            key=lambda i: -snap.stats[i]["eps_share"],
        )
        if not damped:
            return []
        eps = snap.state.groups[snap.state.entries[damped[0]].group]["eps"]
        tensors = [
            {
                "tensor": self._label(snap, i),
                "eps_share": snap.stats[i]["eps_share"],
                "gradient_rms": snap.stats[i]["rms"],
            }
            for i in damped[: self.params["max_tensors_listed"]]
        ]
        return [
            self.finding(
                "eps-dominated",
                "warn",
                f"in {len(damped)} tensor(s) ({tensors[0]['tensor']} first, {tensors[0]['eps_share']:.0%} of its elements) "
                f"the update is dominated by Adam's eps = {eps:g} at {snap.name}: their gradients are smaller than eps, "
                f"so they barely train; lower eps (or keep the moments in float32)",
                seen_at=snap.name,
                eps=eps,
                tensors=tensors,
                threshold=self.params["eps_share"],
                value=tensors[0]["eps_share"],
            )
        ]

    # ------------------------------------------------------------------ weights

    def _movement(self, snapshots: list[Snapshot]) -> list[Finding]:
        readable = [s for s in snapshots if s.weights]
        if len(readable) < 3:
            return []
        names = sorted(set.intersection(*(set(s.weights) for s in readable)))
        norms, moves = [], []
        for a, b in zip(readable, readable[1:]):
            wa = [load_weight(a.weights[n]) for n in names]
            wb = [load_weight(b.weights[n]) for n in names]
            norms.append([float(np.linalg.norm(x)) for x in wa])
            moves.append([float(np.linalg.norm(y - x)) for x, y in zip(wa, wb)])
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.array(moves) / np.array(norms)  # windows x tensors
            ratio = rel[1:] / rel[:-1]  # each window against the one before
        limit = self.params["movement_jump"]
        for w in range(ratio.shape[0]):
            row = ratio[w]
            finite = np.isfinite(row)
            if finite.sum() < 2:
                continue
            median = float(np.median(row[finite]))
            hot = np.flatnonzero(finite & (row >= limit) & (row >= limit * median))
            if not hot.size:
                continue
            a, b = readable[w + 1], readable[w + 2]
            order = hot[np.argsort(-row[hot])]
            tensors = [
                {
                    "tensor": names[k],
                    "relative_change": float(rel[w + 1, k]),
                    "relative_change_before": float(rel[w, k]),
                    "ratio": float(row[k]),
                }
                for k in order[: self.params["max_tensors_listed"]]
            ]
            first, last = a.step + 1, b.step
            return [
                self._jump(
                    "update-jump",
                    f"{tensors[0]['tensor']} moved {tensors[0]['ratio']:.0f}x more between {a.name} and {b.name} than in "
                    f"the window before (its peers {median:.2g}x)"
                    + (f", with {len(tensors) - 1} more tensor(s)" if len(tensors) > 1 else "")
                    + f": something hit it in steps {first}-{last}; inspect those steps and roll back to {a.name}",
                    a,
                    b,
                    tensors,
                    limit,
                    median,
                )
            ]
        return []

    def _window(self, snapshots: list[Snapshot], snap: Snapshot) -> tuple[int, int, str | None]:
        earlier = [s for s in snapshots if s.step < snap.step]
        previous = earlier[-1] if earlier else None
        return (previous.step + 1 if previous else 1), snap.step, (previous.name if previous else None)


def _entry_stats(entry, group: dict[str, Any]) -> dict[str, float]:
    v, m = entry.exp_avg_sq, entry.exp_avg
    nonfinite = int(np.count_nonzero(~np.isfinite(v)) + np.count_nonzero(~np.isfinite(m)))
    beta2 = group["betas"][1]
    correction = 1.0 - beta2 ** max(entry.step, 1.0)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # beta2 = 1: no correction possible
        v_hat = v.astype(np.float64) / correction
        nonzero = v_hat[v_hat > 0]
        return {
            "rms": float(np.sqrt(v_hat.mean())) if v_hat.size else 0.0,
            "nonfinite": nonfinite,
            "zero": bool(v.size) and not bool(np.any(v)),
            "eps_share": float(np.mean(np.sqrt(nonzero) < group["eps"])) if nonzero.size else 0.0,
        }


def _never_moved(snapshots: list[Snapshot]) -> set[str]:
    """Tensors with identical bytes in every checkpoint on disk (needs two or more)."""
    readable = [s for s in snapshots if s.weights]
    if len(readable) < 2:
        return set()
    names = set.intersection(*(set(s.weights) for s in readable))
    first = readable[0]
    return {
        n
        for n in names
        if all(
            np.array_equal(load_weight(first.weights[n]), load_weight(s.weights[n]), equal_nan=True)
            for s in readable[1:]
        )
    }


def _resolution(first: int, last: int, before: str | None, after: str) -> dict[str, Any]:
    return {"kind": "checkpoint window", "first_step": first, "last_step": last, "from": before, "to": after}
