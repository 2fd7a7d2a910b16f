"""LOOP-09 checkpoint integrity."""

from __future__ import annotations

from dataclasses import replace

from ..readers.checkpoints import TRAINER_GLOBALS
from ..readers.inspection import PROBLEMS, Inspection, groups_of, inspect_final_model, listed
from .base import AuditContext, Check, Finding, Option, count
from .resume_state import (
    cannot_resume,
    inspected,
    inspection_options,
    missing_state,
    saved_checkpoints,
)


class CheckpointIntegrity(Check):
    """Checkpoint integrity (trigger point: before/after save).

    What it detects:
        Checkpoints that cannot be resumed from or shipped, in every layout `sftaudit.readers.layouts`
        reads (safetensors, torch.save, Trainer folders, PEFT adapters, DCP, DeepSpeed): weight
        keys missing or unexpected against the model's parameters (tied weights understood) or,
        for an adapter, against its target modules and rank; wrong shapes, a stray dtype,
        non-finite values, an empty adapter or untrained lora_B, a config that ties embeddings
        the saved tensors do not; unreadable or hostile files (truncated safetensors, headers
        pointing outside the file, pickles that would run code or that a bounded static walk
        cannot finish, storage records larger than their declared tensors, symlinks out of the
        run folder, FIFOs and devices), Git LFS pointer files where the weights should be (a
        clone made without git-lfs), files changed since they were saved, an incomplete training state, and parameters identical between two consecutive
        checkpoints although they had gradients.
    Why it matters:
        A rollback is only as good as the checkpoint it lands on: faults such as a key missing
        after an architecture change, or collator config, scheduler step and RNG states
        lost at rollback, surface only when someone needs the checkpoint most.
    Statistic:
        Keys and shapes of every weight file (safetensors header validated before use, pickles
        and DCP metadata read statically) against the manifest's parameters; majority floating
        dtype per checkpoint (or `expected_dtype`); count of elements whose exponent bits are all
        set, streamed in bounded chunks; sha256 against the shim's record of the last save to
        that path; training-state parts found by reading the state pickles statically (never
        unpickled), in the checkpoint's folder or beside a weight file in its own folder; blake2b
        digest per tensor, compared between consecutive checkpoints, joined
        with the gradient norms recorded in between. Results are cached by the files' paths,
        sizes and mtimes and the recorded hashes.
    Threshold:
        Any missing/unexpected key, shape mismatch, stray dtype, non-finite element, unsafe
        pickle, unreadable or changed file, empty or untrained adapter, tied config with
        differing tensors, or stale parameter with a positive gradient norm fails that
        checkpoint, unless lr x gradient norm stayed under half a float32 ulp of the weight
        norm at every step in between (an update that rounds away, e.g. SGD at lr 1e-5). Training
        state: the parts every exact resume needs (step, optimizer, RNG states, data position), the
        scheduler when the run had one (the shim's manifest, a saved scheduler state or a learning
        rate that changed), the collator's state when a checkpoint saved any. Checkpoints of a run
        that saves no optimizer state anywhere are weights-only saves: one info for the run
        (a configuration); other missing parts: one info for the run (a risk; LOOP-11 says when a
        resume from such a checkpoint broke); a fail per checkpoint under `require_resume_state`.
        Git LFS pointers are one warn per
        checkpoint (not verifiable, so not a rollback target); a checkpoint no longer on disk, and a
        path saved at several steps, are info. A checkpoint without its weights while others kept theirs (an
        interrupted or pruned save) is a warn of its own; when no checkpoint holds weights at all (a copy of the
        run's logs, e.g. an output_dir committed without its weight files) the run is judged on its training:
        one info for the run (a risk) says none of them can be resumed, shipped or rolled back to, and they
        stay not intact. The model saved into the output folder itself at the end (what is shipped: an import lists
        it, a recorded run's is read off its folder, less what the shim recorded as checkpoints) is judged as a
        checkpoint's weights are, on its own (a merged model rightly differs from the checkpoints), with no training
        state expected; its findings name "the final model". Another run's checkpoints between the run's first and
        last checkpoint in the same folder (told apart by content at import): one warn for the run (a risk: it dates
        nothing).
    Evidence:
        `keys` (missing/unexpected), `dtypes`, `tensors` (with non-finite counts, shapes or
        gradient norms), the file concerned, `missing_state` (part -> checkpoints) with
        `applies_to`, the imports a pickle would perform, `lfs_pointers`, `saves`; `not_intact` with
        `applies_to` for the checkpoints of a logs-only copy.
    """

    code = "LOOP-09"
    name = "checkpoint integrity"
    rules = {
        **PROBLEMS,
        "overwritten-saves": "a checkpoint path was saved at several steps: only the last save is on disk",
        "weights-only-saves": "the run saves weights only: no checkpoint can resume exactly (configuration)",
        "cannot-resume": "checkpoints lack parts of the training state an exact resume needs (risk)",
        "parameters-unchanged": "parameters identical in two checkpoints although they had gradients in between",
        "logs-only": "no checkpoint holds model weights (a copy of the run's logs): none can be used (risk)",
        "mixed-runs": "another run's checkpoints lie among the run's own in its folder: a name is no run's (risk)",
    }
    needs = (("checkpoints", "final_model"),)
    defaults = {
        "expected_dtype": Option(None, kind=str),  # e.g. "bfloat16"; default: the checkpoint's majority dtype
        "require_resume_state": False,  # true: a checkpoint that cannot resume exactly fails
        "trusted_pickle_globals": list(TRAINER_GLOBALS),
        "max_tensors_listed": count(20),
    }

    def run(self, ctx: AuditContext) -> list[Finding]:
        checkpoints = saved_checkpoints(ctx)
        inspections = inspected(ctx, checkpoints, **inspection_options(self.params))
        weightless = _weightless(inspections)
        findings = [
            self._finding(i, kind, sev, msg, ev)
            for i in inspections
            for kind, sev, msg, ev in i.problems
            if not (kind == "no-weights" and weightless)
        ]
        if weightless:
            findings.append(
                self.finding(
                    "logs-only",
                    "info",
                    f"none of the run's {len(weightless)} checkpoint(s) holds model weights ({listed(weightless)}): "
                    "this folder is a copy of the run's logs without its weight files, so no checkpoint can be "
                    "resumed, shipped or rolled back to; the training is judged on its logs",
                    category="risk",
                    applies_to=weightless,
                    not_intact=True,
                )
            )
        findings += [
            self._finding(
                i,
                "overwritten-saves",
                "info",
                (
                    f"{i.name} was saved at steps {', '.join(map(str, c['saves']))} to the same path: each save "
                    f"overwrote the one before, only step {c['step']}'s is on disk"
                ),
                {"saves": c["saves"]},
            )
            for i, c in zip(inspections, checkpoints)
            if len(c["saves"]) > 1
        ]
        # A logs-only copy's checkpoints cannot be used at all: what their training state lacks is moot.
        findings += self._resume_state(ctx, [i for i in inspections if i.name not in weightless])
        readable = [i for i in inspections if i.digests is not None]
        for before, after in zip(readable, readable[1:]):
            findings += self._stale(ctx, before, after)
        return findings + self._mixed_runs(ctx, checkpoints) + self._final_model(ctx)

    def _final_model(self, ctx: AuditContext) -> list[Finding]:
        """The model saved into the output folder itself at the end: what would be shipped, judged as a
        checkpoint's weights are (its keys on their own: it may be a merged model). The manifest lists it
        (`final_model`): an import's, or a recorded run's read off its folder when the audit began."""
        final = ctx.manifest.get("final_model")
        if not isinstance(final, dict) or not final.get("files"):
            return []
        inspection = inspect_final_model(
            ctx.con,
            ctx.run_dir,
            final["step"],
            final["files"],
            **inspection_options(self.params),
        )
        return [self._finding(inspection, kind, sev, msg, ev) for kind, sev, msg, ev in inspection.problems]

    def _mixed_runs(self, ctx: AuditContext, checkpoints: list[dict]) -> list[Finding]:
        """Another run's checkpoints (the import's `other_runs` note) between the judged run's first and last: the
        folder's checkpoint-N sequence mixes two trainings, so a name alone does not say which run it holds."""
        own = sorted(c["step"] for c in checkpoints if c.get("step") is not None)
        notes = [n for n in ctx.manifest.get("notes") or [] if isinstance(n, dict) and n.get("key") == "other_runs"]
        if len(own) < 2 or not notes:
            return []
        among = sorted(
            (step, name)
            for run in notes[0].get("runs") or []
            for step, name in zip(run.get("checkpoint_steps") or [], run.get("checkpoints") or [])
            if step is not None and own[0] < step < own[-1]
        )
        if not among:
            return []
        names = [name for _, name in among]
        return [
            self.finding(
                "mixed-runs",
                "warn",
                f"{len(names)} checkpoint(s) of another run ({listed(names)}) lie among this run's own, between its "
                f"steps {own[0]} and {own[-1]}: in this folder a checkpoint's name does not say which training it "
                "holds, and a later run may have saved over an earlier one's; take checkpoints by the step this "
                "audit names, and give each run its own output_dir",
                category="risk",
                other_checkpoints=names,
                own_checkpoint_steps=own,
            )
        ]

    def _resume_state(self, ctx: AuditContext, inspections: list[Inspection]) -> list[Finding]:
        """What the checkpoints lack to resume exactly, stated once for the run: weights-only saves (no
        checkpoint holds optimizer state) are a configuration, other gaps a risk; both info (nothing is
        wrong until someone resumes: LOOP-11 judges the resumes). Under `require_resume_state` each
        checkpoint lacking a part fails instead."""
        lacking = missing_state(ctx, inspections)
        if not lacking:
            return []
        if self.params["require_resume_state"]:
            return [
                self.resume_state_finding(i.name, i.step, lacking[i.name]) for i in inspections if i.name in lacking
            ]
        read = [i for i in inspections if i.state_found is not None]
        # Weights-only saves: the run keeps no optimizer state anywhere, and these hold weights (a
        # checkpoint whose weights cannot be read is no weights-only save: its other gaps are a risk).
        saved_none = not any("optimizer" in i.state_found for i in read)
        weights_only = [i.name for i in read if saved_none and i.digests is not None and i.name in lacking]
        findings = []
        if weights_only:
            by_part = _by_part({n: lacking[n] for n in weights_only})
            restarts = [
                what
                for part, what in (
                    ("optimizer", "the optimizer's moments"),
                    ("scheduler", "the learning-rate schedule"),
                    ("data_position", "the data order"),
                )
                if part in by_part
            ]
            trainer = " (the Trainer: save_only_model=False)" if any(i.trainer for i in read) else ""
            findings.append(
                self.finding(
                    "weights-only-saves",
                    "info",
                    (
                        f"{len(weights_only)} checkpoint(s) are weights-only saves ({listed(weights_only)}): they lack "
                        f"{', '.join(by_part)}. They serve evaluation and shipping; a run resumed from one restarts "
                        f"{_and(restarts)}. To resume exactly, save the training state with the weights{trainer}"
                    ),
                    category="configuration",
                    missing_state=by_part,
                    applies_to=weights_only,
                )
            )
        others = [n for n in lacking if n not in weights_only]
        if others:
            by_part = _by_part({n: lacking[n] for n in others})
            by_checkpoints: dict[tuple[str, ...], list[str]] = {}  # parts missing from the same checkpoints
            for part, ns in by_part.items():
                by_checkpoints.setdefault(tuple(ns), []).append(part)
            parts = "; ".join(f"{', '.join(ps)} ({listed(list(ns))})" for ns, ps in by_checkpoints.items())
            findings.append(
                self.finding(
                    "cannot-resume",
                    "info",
                    (
                        f"{len(others)} checkpoint(s) cannot resume exactly, their training state lacks {parts}; save them "
                        f"with the weights, or set require_resume_state = true to fail such checkpoints"
                    ),
                    category="risk",
                    missing_state=by_part,
                    applies_to=others,
                )
            )
        return findings

    def resume_state_finding(self, name: str, step: int, lacking: list[str]) -> Finding:
        """The fail `require_resume_state` makes of one checkpoint lacking parts of an exact resume's training state
        (gate's resume-state policy asks it of the checkpoint it judges)."""
        f = self.finding(
            "cannot-resume", "fail", cannot_resume(name, lacking), step=step, category="risk", missing_state=lacking
        )
        return replace(f, checkpoint=name)

    def _finding(
        self,
        inspection: Inspection,
        rule: str,
        severity: str,
        message: str,
        evidence: dict,
        category: str = "anomaly",
    ) -> Finding:
        """A finding about one checkpoint (its scope is that checkpoint alone)."""
        f = self.finding(rule, severity, message, step=inspection.step, category=category, **evidence)
        return replace(f, checkpoint=inspection.name)

    def _stale(self, ctx: AuditContext, before: Inspection, after: Inspection) -> list[Finding]:
        same = sorted(n for n, d in after.digests.items() if before.digests.get(n) == d)
        if not same:
            return []
        grads = ctx.frame(
            """SELECT g.tensor, any_value(g.idx) AS idx, max(g.norm) AS max_grad_norm, max(g.norm * s.lr) AS largest_step
               FROM grad_norms g LEFT JOIN steps s ON s.rank = g.rank AND s.step = g.step
               WHERE g.rank = 0 AND g.step > ? AND g.step <= ? AND isfinite(g.norm) AND g.norm > 0
               GROUP BY g.tensor""",
            [before.step, after.step],
        )
        saved = ctx.row(
            "SELECT param_norms FROM checkpoints WHERE rank = 0 AND event = 'saved' AND step = ? "
            "AND param_norms IS NOT NULL LIMIT 1",
            [after.step],
        )
        weight_norms = saved[0] if saved else []
        # LOOP-05's rule: lr x |g| under half a float32 ulp of |w| at every step is an update that rounds away
        # (plain SGD at a tiny LR), not a tensor missing from the optimizer.
        rounds_away = {
            tensor
            for tensor, idx, step_size in grads.select("tensor", "idx", "largest_step").iter_rows()
            if step_size is not None
            and idx is not None
            and idx < len(weight_norms)
            and step_size < weight_norms[idx] * 2.0**-24
        }
        norms = {
            t: n for t, n in zip(grads["tensor"].to_list(), grads["max_grad_norm"].to_list()) if t not in rounds_away
        }
        tied = ctx.manifest.get("tied", {})
        stale = [{"tensor": n, "max_grad_norm": norms[groups_of(n, tied)]} for n in same if groups_of(n, tied) in norms]
        if not stale:
            return []
        return [
            self._finding(
                after,
                "parameters-unchanged",
                "fail",
                (
                    f"{len(stale)} parameter(s) identical in {before.name} and {after.name} although they had gradients "
                    f"in steps {before.step + 1}-{after.step}, first {stale[0]['tensor']}; they are missing from the "
                    f"optimizer or frozen by mistake"
                ),
                {
                    "tensors": stale[: self.params["max_tensors_listed"]],
                    "previous_checkpoint": before.name,
                    "tensor_count": len(stale),
                },
            )
        ]


def _weightless(inspections: list[Inspection]) -> list[str]:
    """The checkpoints of a logs-only copy: every checkpoint still on disk holds no model weights (empty when any
    holds weights: then a weightless one is an interrupted or pruned save, a warn of its own)."""
    present = [i for i in inspections if i.on_disk]
    bare = [i.name for i in present if any(kind == "no-weights" for kind, *_ in i.problems)]
    return bare if present and len(bare) == len(present) else []


def _by_part(lacking: dict[str, list[str]]) -> dict[str, list[str]]:
    """Checkpoint -> missing parts, turned into part -> the checkpoints missing it."""
    out: dict[str, list[str]] = {}
    for name, parts in lacking.items():
        for part in parts:
            out.setdefault(part, []).append(name)
    return out


def _and(items: list[str]) -> str:
    return ", ".join(items[:-1]) + (" and " if len(items) > 1 else "") + items[-1] if items else "nothing"
