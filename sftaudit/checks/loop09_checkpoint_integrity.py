"""LOOP-09 checkpoint integrity."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import duckdb

from ..checkpoints import (TRAINER_GLOBALS, CheckpointError, MissingWeights, PickleContents, UnreadablePickle,
                           inside_run, is_lfs_pointer, read_pickle)
from ..hashing import file_sha256
from ..ingest import recorded_checkpoints
from ..layouts import PICKLE_SUFFIXES, FileError, UnsafePickle, Weights, adapter_module, read_weights, targeted
from ..safe_io import kind_of
from .base import AuditContext, Check, Finding

# Input-embedding names of the common architectures (a tied output head must equal it).
EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")
FLOAT_DTYPES = {"float64", "float32", "float16", "bfloat16", "float8_e5m2", "float8_e4m3fn"}
# Where each part of an exact-resume training state may live, by key, in a state pickle.
STATE_KEYS = {
    "step": ("step", "global_step", "global_steps", "step_id", "iter_num"),
    "optimizer": ("optimizer", "optimizer_state", "optimizer_state_dict", "optim"),
    "scheduler": ("scheduler", "lr_scheduler"),
    "rng_states": ("rng_states", "rng_state", "rng"),
    "data_position": ("data_position", "sampler", "dataloader"),
    "collator": ("collator", "collator_config"),
}
RNG_PARTS = {"python": ("python",), "numpy": ("numpy",), "torch": ("torch", "cpu")}
# Parts every exact resume needs; the scheduler and the collator's state only where the run has them.
ALWAYS_NEEDED = ("step", "optimizer", "rng_states", "data_position")


@dataclass
class Inspection:
    """What reading one checkpoint found: problems (severity, message, evidence) and tensor digests."""

    name: str
    step: int
    problems: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    digests: dict[str, str] | None = None   # None: the weights could not be read
    on_disk: bool = True
    state_found: list[str] | None = None  # training-state parts its files hold (None: not read)
    rng_missing: list[str] = field(default_factory=list)  # RNG streams its RNG state lacks
    trainer: bool = False  # a Trainer save (trainer_state.json beside the weights)
    unread: set[str] = field(default_factory=set)  # files already reported unreadable or unsafe

    @property
    def passes(self) -> bool:
        return self.on_disk and not any(sev in ("warn", "fail") for sev, _, _ in self.problems)


class CheckpointIntegrity(Check):
    """Checkpoint integrity (trigger point: before/after save).

    What it detects:
        Checkpoints that cannot be resumed from or shipped, in every layout `sftaudit.layouts`
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
        path saved at several steps, are info.
    Evidence:
        `keys` (missing/unexpected), `dtypes`, `tensors` (with non-finite counts, shapes or
        gradient norms), the file concerned, `missing_state` (part -> checkpoints) with
        `applies_to`, the imports a pickle would perform, `lfs_pointers`, `saves`.
    """

    code = "LOOP-09"
    name = "checkpoint integrity"
    needs = ("checkpoints",)
    defaults = {
        "expected_dtype": None,          # e.g. "bfloat16"; default: the checkpoint's majority dtype
        "require_resume_state": False,   # true: a checkpoint that cannot resume exactly fails
        "trusted_pickle_globals": list(TRAINER_GLOBALS),
        "max_tensors_listed": 20,
    }

    def run(self, ctx: AuditContext) -> list[Finding]:
        checkpoints = saved_checkpoints(ctx)
        inspections = [self.inspect(ctx, c) for c in checkpoints]
        findings = [self._finding(i, sev, msg, ev) for i in inspections for sev, msg, ev in i.problems]
        findings += [self._finding(i, "info", (
            f"{i.name} was saved at steps {', '.join(map(str, c['saves']))} to the same path: each save "
            f"overwrote the one before, only step {c['step']}'s is on disk"), {"saves": c["saves"]})
            for i, c in zip(inspections, checkpoints) if len(c["saves"]) > 1]
        findings += self._resume_state(ctx, inspections)
        readable = [i for i in inspections if i.digests is not None]
        for before, after in zip(readable, readable[1:]):
            findings += self._stale(ctx, before, after)
        return findings

    def _resume_state(self, ctx: AuditContext, inspections: list[Inspection]) -> list[Finding]:
        """What the checkpoints lack to resume exactly, stated once for the run: weights-only saves (no
        checkpoint holds optimizer state) are a configuration, other gaps a risk; both info (nothing is
        wrong until someone resumes: LOOP-11 judges the resumes). Under `require_resume_state` each
        checkpoint lacking a part fails instead."""
        lacking = missing_state(ctx, inspections)
        if not lacking:
            return []
        if self.params["require_resume_state"]:
            return [self._finding(i, "fail", (
                f"{i.name} cannot resume exactly: its training state lacks {', '.join(lacking[i.name])}; save "
                f"them with the weights"), {"missing_state": lacking[i.name]}, category="risk")
                for i in inspections if i.name in lacking]
        read = [i for i in inspections if i.state_found is not None]
        # Weights-only saves: the run keeps no optimizer state anywhere, and these hold weights (a
        # checkpoint whose weights cannot be read is no weights-only save: its other gaps are a risk).
        saved_none = not any("optimizer" in i.state_found for i in read)
        weights_only = [i.name for i in read if saved_none and i.digests is not None and i.name in lacking]
        findings = []
        if weights_only:
            by_part = _by_part({n: lacking[n] for n in weights_only})
            restarts = [what for part, what in (("optimizer", "the optimizer's moments"), ("scheduler", "the "
                        "learning-rate schedule"), ("data_position", "the data order")) if part in by_part]
            trainer = " (the Trainer: save_only_model=False)" if any(i.trainer for i in read) else ""
            findings.append(self.finding("info", (
                f"{len(weights_only)} checkpoint(s) are weights-only saves ({_listed(weights_only)}): they lack "
                f"{', '.join(by_part)}. They serve evaluation and shipping; a run resumed from one restarts "
                f"{_and(restarts)}. To resume exactly, save the training state with the weights{trainer}"),
                category="configuration", missing_state=by_part, applies_to=weights_only))
        others = [n for n in lacking if n not in weights_only]
        if others:
            by_part = _by_part({n: lacking[n] for n in others})
            by_checkpoints: dict[tuple[str, ...], list[str]] = {}  # parts missing from the same checkpoints
            for part, ns in by_part.items():
                by_checkpoints.setdefault(tuple(ns), []).append(part)
            parts = "; ".join(f"{', '.join(ps)} ({_listed(list(ns))})" for ns, ps in by_checkpoints.items())
            findings.append(self.finding("info", (
                f"{len(others)} checkpoint(s) cannot resume exactly, their training state lacks {parts}; save them "
                f"with the weights, or set require_resume_state = true to fail such checkpoints"),
                category="risk", missing_state=by_part, applies_to=others))
        return findings

    def _finding(self, inspection: Inspection, severity: str, message: str, evidence: dict,
                 category: str = "anomaly") -> Finding:
        f = self.finding(severity, message, step=inspection.step, category=category, **evidence)
        return Finding(f.code, f.severity, f.message, f.step, inspection.name, f.evidence, f.category)

    # ---------------------------------------------------------------- one checkpoint

    def inspect(self, ctx: AuditContext, checkpoint: dict[str, Any]) -> Inspection:
        """Read one recorded checkpoint safely; never raises on bad files (they are problems)."""
        name, step = checkpoint["name"], checkpoint["step"]
        out = Inspection(name, step)
        try:
            path = inside_run(ctx.run_dir, checkpoint["path"])
        except CheckpointError as exc:
            out.problems.append(("fail", f"{name} was saved outside the run directory and was not read ({exc})",
                                 {"path": checkpoint["path"]}))
            out.digests = None
            return out
        if not path.exists():
            out.on_disk = False
            out.problems.append(("info", f"{name} is no longer on disk (rotated out or deleted); it cannot be "
                                 f"rolled back to", {"path": checkpoint["path"]}))
            return out
        folder = state_folder(ctx, path, checkpoint)
        # A weight file's own folder holds its training state: its files are listed (safely) too.
        files, refused = _checkpoint_files(ctx.run_dir, folder if folder is not None and path.is_file() else path)
        if refused:
            out.problems.append(("fail", f"{name}: {refused[0]}; the checkpoint was not read (copy the real file "
                                 f"into the checkpoint folder)", {"files": refused}))
            return out
        pointers = [f for f in files if is_lfs_pointer(f)]
        if pointers:
            # The weights are not on disk to judge: one finding for the checkpoint, and it is not intact.
            listed = _listed([str(f.relative_to(path)) if path.is_dir() else f.name for f in pointers], 3)
            out.problems.append(("warn", f"{name}: {len(pointers)} file(s) are Git LFS pointers, not the weights "
                                 f"({listed}): run `git lfs pull` in the clone, then audit again; until then "
                                 f"this checkpoint cannot be verified or rolled back to",
                                 {"lfs_pointers": [f.name for f in pointers]}))
            return out
        key = self._cache_key(path, checkpoint, files)
        cached = _cache_get(ctx, key)
        if cached is not None:
            return cached
        self._check_hashes(ctx, checkpoint, out)
        weights = self._check_weights(path, checkpoint, out)
        self._check_state(path, folder, weights, out)
        _cache_put(ctx, key, out)
        return out

    def _cache_key(self, path: Path, checkpoint: dict[str, Any], files: list[Path]) -> str:
        """What a checkpoint's inspection depends on: its files' paths, sizes and mtimes (with the
        training state beside a weight file), the hashes the shim recorded, the parameters it is judged
        against, and this check's options."""
        stats = [(str(f.relative_to(path.parent)), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
        key = [CACHE_VERSION, checkpoint["name"], checkpoint["path"], checkpoint["step"], stats,
               checkpoint.get("sha256"), checkpoint["params"], checkpoint["tied"], self.params]
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()

    def _check_hashes(self, ctx: AuditContext, checkpoint: dict, out: Inspection) -> None:
        changed = []
        for rel, recorded in sorted((checkpoint.get("sha256") or {}).items()):
            try:
                target = inside_run(ctx.run_dir, rel)
                current = _sha256(target) if target.is_file() else None
            except (CheckpointError, OSError):
                current = None
            if current != recorded:
                changed.append(rel)
        if changed:
            out.problems.append(("fail", f"{out.name}: {len(changed)} file(s) changed or vanished since the shim "
                                 f"hashed them at save, first {changed[0]}; do not trust this checkpoint",
                                 {"files": changed}))

    def _check_weights(self, path: Path, checkpoint: dict, out: Inspection) -> Weights | None:
        try:
            weights = read_weights(path, tuple(self.params["trusted_pickle_globals"]))
        except UnsafePickle as exc:
            rel = self._rel(path, exc.file)
            out.problems.append(("fail", _unsafe_message(rel, exc.imports), {"file": rel, "imports": exc.imports}))
            out.unread.add(exc.file.name)
            return None
        except FileError as exc:
            rel = self._rel(path, exc.file)
            out.problems.append(("fail", f"{rel} cannot be read safely: {exc}; this checkpoint cannot be loaded",
                                 {"file": rel}))
            out.unread.add(exc.file.name)
            return None
        except MissingWeights as exc:
            out.problems.append(("warn", f"{out.name}: {exc}: it cannot be verified or rolled back to",
                                 {"file": path.name}))
            return None
        except (CheckpointError, OSError) as exc:
            out.problems.append(("fail", f"{out.name}: {exc}", {"file": path.name}))
            return None
        out.digests = {n: s.digest for n, s in weights.scans.items()}
        entries, scans, params = weights.tensors, weights.scans, checkpoint["params"]
        if weights.adapter is not None:
            self._check_adapter(weights, params, checkpoint["step"], out)
        else:
            self._check_keys(entries, params, checkpoint["tied"], out)
            self._check_tied(weights, checkpoint, out)
        self._check_dtypes(entries, params, out)
        bad = [{"tensor": n, "nonfinite_elements": s.nonfinite, "shape": list(entries[n].shape)}
               for n, s in scans.items() if s.nonfinite]
        if bad:
            out.problems.append(("fail", f"{out.name} holds non-finite values in {len(bad)} tensor(s), first "
                                 f"{bad[0]['tensor']} ({bad[0]['nonfinite_elements']} element(s)); do not resume "
                                 f"from or ship it", {"tensors": bad[: self.params["max_tensors_listed"]],
                                                     "tensor_count": len(bad)}))
        return weights

    @staticmethod
    def _rel(path: Path, file: Path) -> str:
        return f"{path.name}/{file.name}" if path.is_dir() else path.name

    def _check_adapter(self, weights: Weights, params: list[dict], step: int, out: Inspection) -> None:
        """PEFT adapters: judged against the adapter's target modules and rank (and the LoRA
        parameters the model trained), not the base model."""
        config, entries, scans = weights.adapter, weights.tensors, weights.scans
        if not entries:
            out.problems.append(("fail", f"{out.name}: the adapter file holds no tensors; the trained adapter was "
                                 f"not saved (a state_dict filter applied twice keeps nothing)", {"keys": {
                                     "missing": [], "unexpected": []}, "tensor_count": 0}))
            return
        rank, targets = config.get("r"), config.get("target_modules")
        lora = {n: adapter_module(n) for n in entries}
        untargeted = sorted(n for n, m in lora.items() if m and targets is not None and not targeted(m[0], targets))
        wrong_rank = [{"tensor": n, "shape": list(entries[n].shape), "rank": rank} for n, m in lora.items()
                      if m and isinstance(rank, int) and not config.get("rank_pattern") and len(entries[n].shape) == 2
                      and entries[n].shape[0 if m[1].endswith("A") else 1] != rank]
        trained = {adapter_module(p["name"]) for p in params if p["requires_grad"]} - {None}
        saved = {m for m in lora.values() if m}
        missing = sorted(f"{m}.{kind}" for m, kind in trained - saved)
        if missing or untargeted:
            out.problems.append(("fail", f"{out.name} does not match the adapter: {len(missing)} trained LoRA "
                                 f"matrices missing and {len(untargeted)} key(s) outside target_modules "
                                 f"{targets}, first {(missing or untargeted)[0]}",
                                 {"keys": {"missing": missing, "unexpected": untargeted}}))
        if wrong_rank:
            out.problems.append(("fail", f"{out.name}: {len(wrong_rank)} LoRA matrices do not have the rank r={rank} "
                                 f"of adapter_config.json, first {wrong_rank[0]['tensor']} {wrong_rank[0]['shape']}",
                                 {"tensors": wrong_rank[: self.params["max_tensors_listed"]]}))
        b = [n for n, m in lora.items() if m and m[1] in ("lora_B", "lora_embedding_B") and n in scans]
        if b and step > 0 and all(scans[n].all_zero for n in b):
            out.problems.append(("fail", f"{out.name}: every lora_B matrix ({len(b)}) is still zero after {step} "
                                 f"step(s), so the adapter changes nothing; the LoRA parameters were not trained "
                                 f"(not in the optimizer, learning rate 0, or saved before training)",
                                 {"tensors": [{"tensor": n} for n in b[: self.params["max_tensors_listed"]]],
                                  "tensor_count": len(b)}))

    def _check_tied(self, weights: Weights, checkpoint: dict, out: Inspection) -> None:
        """A config that ties the output head to the input embeddings while the saved tensors differ:
        a reload overwrites one with the other."""
        config = weights.config or {}
        says_tied = config.get("tie_word_embeddings", checkpoint.get("tie_word_embeddings"))
        if not says_tied:
            return
        head = next((n for n in weights.tensors if n.endswith("lm_head.weight")), None)
        embed = next((n for n in weights.tensors if n.endswith(EMBEDDING_SUFFIXES)), None)
        if head is None or embed is None or head not in weights.scans or embed not in weights.scans:
            return
        if weights.scans[head].digest != weights.scans[embed].digest:
            out.problems.append(("fail", f"{out.name}: the config ties {head} to {embed} "
                                 f"(tie_word_embeddings) but the saved tensors differ; a reload overwrites one with "
                                 f"the other. Save with tie_word_embeddings=false or tie them again before saving",
                                 {"tensors": [{"tensor": head}, {"tensor": embed}]}))

    def _check_keys(self, entries: dict, params: list[dict], tied: dict[str, str], out: Inspection) -> None:
        groups: dict[str, set[str]] = {p["name"]: {p["name"]} for p in params}
        for alias, target in tied.items():
            groups.setdefault(target, {target}).add(alias)
        known = {n for g in groups.values() for n in g}
        missing = sorted(c for c, names in groups.items() if not names & entries.keys())
        unexpected = sorted(entries.keys() - known)
        if missing or unexpected:
            first = (missing or unexpected)[0]
            out.problems.append(("fail", f"{out.name} does not match the model: {len(missing)} missing and "
                                 f"{len(unexpected)} unexpected key(s), first {first}; a strict load fails and a "
                                 f"lenient one silently re-initialises weights", {"keys": {"missing": missing,
                                                                                       "unexpected": unexpected}}))
        shapes = {p["name"]: tuple(p["shape"]) for p in params}
        wrong = [{"tensor": n, "shape": list(e.shape), "expected": list(shapes[groups_of(n, tied)])}
                 for n, e in entries.items() if groups_of(n, tied) in shapes and e.shape != shapes[groups_of(n, tied)]]
        if wrong:
            out.problems.append(("fail", f"{out.name}: {len(wrong)} tensor(s) have the wrong shape, first "
                                 f"{wrong[0]['tensor']} {wrong[0]['shape']} instead of {wrong[0]['expected']}",
                                 {"tensors": wrong[: self.params["max_tensors_listed"]]}))

    def _check_dtypes(self, entries: dict, params: list[dict], out: Inspection) -> None:
        floats = {n: e.dtype for n, e in entries.items() if e.dtype in FLOAT_DTYPES}
        if not floats:
            return
        expected = self.params["expected_dtype"]
        if expected is None:
            counts = Counter(floats.values()).most_common()
            trained = Counter(p["dtype"] for p in params).most_common(1)
            top = [d for d, c in counts if c == counts[0][1]]
            expected = trained[0][0] if trained and trained[0][0] in top and len(top) > 1 else counts[0][0]
        stray = [{"tensor": n, "dtype": d, "expected": expected} for n, d in floats.items() if d != expected]
        if stray:
            out.problems.append(("fail", f"{out.name}: {len(stray)} tensor(s) not saved as {expected}, first "
                                 f"{stray[0]['tensor']} as {stray[0]['dtype']}; cast consistently before saving",
                                 {"dtypes": stray[: self.params["max_tensors_listed"]], "tensor_count": len(stray)}))

    def _check_state(self, path: Path, folder: Path | None, weights: Weights | None, out: Inspection) -> None:
        """The training state a checkpoint holds: the pickles of its folder (a weight file's own folder
        too: ``step-40/model.safetensors`` beside ``trainer.pt``), and the state its weight files carry
        (a nested ``torch.save({"model": ..., "optimizer": ...})``, DeepSpeed's optimizer shards, DCP's
        non-model entries)."""
        pickles: dict[str, Any] = dict(weights.state) if weights else {}
        read = ({f.name for f in weights.files} if weights else {path.name}) | out.unread
        shown = out.name if path.is_dir() else folder.name if folder else ""
        for f in sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in PICKLE_SUFFIXES
                        and p.name not in read and p != path) if folder else []:
            rel = f"{shown}/{f.name}"
            try:
                contents = read_pickle(f)
            except UnreadablePickle as exc:
                out.problems.append(("fail", f"{rel}: {str(exc).partition(': ')[2]}", {"file": rel,
                                                                                   "imports": exc.imports}))
                continue
            except CheckpointError as exc:
                out.problems.append(("fail", f"{rel} cannot be inspected: {exc}", {"file": rel}))
                continue
            unsafe = contents.unsafe_globals(tuple(self.params["trusted_pickle_globals"]))
            if unsafe:
                out.problems.append(("fail", _unsafe_message(rel, unsafe), {"file": rel, "imports": unsafe}))
                continue
            pickles[f.name] = contents
        if weights and weights.state_keys:
            pickles[".metadata"] = PickleContents({k: True for k in weights.state_keys})
        out.state_found, out.rng_missing = state_parts(folder, pickles)
        out.trainer = folder is not None and (folder / "trainer_state.json").is_file()

    # ---------------------------------------------------------------- between checkpoints

    def _stale(self, ctx: AuditContext, before: Inspection, after: Inspection) -> list[Finding]:
        same = sorted(n for n, d in after.digests.items() if before.digests.get(n) == d)
        if not same:
            return []
        grads = ctx.frame(
            """SELECT g.tensor, any_value(g.idx) AS idx, max(g.norm) AS max_grad_norm, max(g.norm * s.lr) AS largest_step
               FROM grad_norms g LEFT JOIN steps s ON s.rank = g.rank AND s.step = g.step
               WHERE g.rank = 0 AND g.step > ? AND g.step <= ? AND isfinite(g.norm) AND g.norm > 0
               GROUP BY g.tensor""", [before.step, after.step])
        saved = ctx.row("SELECT param_norms FROM checkpoints WHERE rank = 0 AND event = 'saved' AND step = ? "
                        "AND param_norms IS NOT NULL LIMIT 1", [after.step])
        weight_norms = saved[0] if saved else []
        # LOOP-05's rule: lr x |g| under half a float32 ulp of |w| at every step is an update that rounds away
        # (plain SGD at a tiny LR), not a tensor missing from the optimizer.
        rounds_away = {tensor for tensor, idx, step_size in grads.select("tensor", "idx", "largest_step").iter_rows()
                       if step_size is not None and idx is not None and idx < len(weight_norms)
                       and step_size < weight_norms[idx] * 2.0 ** -24}
        norms = {t: n for t, n in zip(grads["tensor"].to_list(), grads["max_grad_norm"].to_list()) if t not in rounds_away}
        tied = ctx.manifest.get("tied", {})
        stale = [{"tensor": n, "max_grad_norm": norms[groups_of(n, tied)]} for n in same if groups_of(n, tied) in norms]
        if not stale:
            return []
        return [self._finding(after, "fail", (
            f"{len(stale)} parameter(s) identical in {before.name} and {after.name} although they had gradients "
            f"in steps {before.step + 1}-{after.step}, first {stale[0]['tensor']}; they are missing from the "
            f"optimizer or frozen by mistake"), {"tensors": stale[: self.params["max_tensors_listed"]],
                                                 "previous_checkpoint": before.name, "tensor_count": len(stale)})]


# Bump when what an inspection holds changes: older cached results are then ignored.
CACHE_VERSION = 3


def _cache_get(ctx: AuditContext, key: str) -> Inspection | None:
    """A stored inspection of unchanged files (so a re-audit does not rescan them), or None."""
    if not ctx.scalar("SELECT count(*) FROM information_schema.tables WHERE table_name = 'loop09_cache'"):
        return None
    row = ctx.row("SELECT inspection FROM loop09_cache WHERE key = ?", [key])
    if row is None:
        return None
    data = json.loads(row[0])
    return Inspection(**{**data, "problems": [tuple(p) for p in data["problems"]]})


def _cache_put(ctx: AuditContext, key: str, inspection: Inspection) -> None:
    try:
        ctx.con.execute("CREATE TABLE IF NOT EXISTS loop09_cache (key VARCHAR PRIMARY KEY, inspection JSON)")
        ctx.con.execute("INSERT OR REPLACE INTO loop09_cache VALUES (?, ?)",
                        [key, json.dumps(asdict(inspection), default=str)])
    except duckdb.Error:  # a read-only connection (a check run by hand): nothing to keep
        pass


# A checkpoint folder holds a few dozen files; one with more entries than this is not one.
MAX_CHECKPOINT_ENTRIES = 10_000


def _checkpoint_files(run_dir: Path, path: Path) -> tuple[list[Path], list[str]]:
    """The regular files of a checkpoint (the file itself, or its folder's tree), listed without
    following symlinked folders, and why any entry was refused: a symlink resolving outside the run
    folder (never read: `/etc/passwd`, `/`), a FIFO or device (opening one blocks or never ends)."""
    root = Path(run_dir).resolve()
    files, refused, todo, seen = [], [], [path], 0
    while todo:
        entry = todo.pop()
        seen += 1
        if seen > MAX_CHECKPOINT_ENTRIES:
            refused.append(f"more than {MAX_CHECKPOINT_ENTRIES} entries under {path.name}")
            break
        rel = entry.name if entry == path else f"{path.name}/{entry.relative_to(path)}"
        try:
            target = entry.resolve()
            mode = os.lstat(entry).st_mode
            if stat.S_ISLNK(mode):
                if target != root and root not in target.parents:
                    refused.append(f"{rel} is a symlink to {target}, outside the run folder")
                    continue
                mode = os.stat(target).st_mode
        except (OSError, RuntimeError) as exc:  # a dangling link, a symlink loop
            refused.append(f"{rel} cannot be resolved ({type(exc).__name__})")
            continue
        if stat.S_ISREG(mode):
            files.append(entry)
        elif stat.S_ISDIR(mode) and not (entry != path and os.path.islink(entry)):
            try:
                todo.extend(sorted(entry.iterdir(), reverse=True))
            except OSError as exc:
                refused.append(f"{rel} cannot be listed ({exc.strerror})")
        elif not stat.S_ISDIR(mode):
            refused.append(f"{rel} is {kind_of(mode)}, not a regular file")
    return sorted(files), refused


def _listed(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _by_part(lacking: dict[str, list[str]]) -> dict[str, list[str]]:
    """Checkpoint -> missing parts, turned into part -> the checkpoints missing it."""
    out: dict[str, list[str]] = {}
    for name, parts in lacking.items():
        for part in parts:
            out.setdefault(part, []).append(name)
    return out


def _and(items: list[str]) -> str:
    return ", ".join(items[:-1]) + (" and " if len(items) > 1 else "") + items[-1] if items else "nothing"


def _unsafe_message(rel: str, unsafe: list[str]) -> str:
    return (f"{rel} is a pickle that would import and call {unsafe[0]} when loaded (sftaudit only read it "
            f"statically); never torch.load it without weights_only=True and find what wrote it")


def groups_of(name: str, tied: dict[str, str]) -> str:
    """The canonical parameter a (possibly tied) key stands for."""
    return tied.get(name, name)


def state_parts(folder: Path | None, pickles: dict[str, PickleContents]) -> tuple[list[str], list[str]]:
    """The parts of an exact-resume training state the checkpoint's files hold, and the RNG streams
    (python, numpy, torch) its RNG state lacks."""
    found: dict[str, Any] = {}
    for fname, contents in pickles.items():
        value = contents.value
        if not isinstance(value, dict):
            if fname == "training_args.bin":
                found["collator"] = fname  # the Trainer's dataloader/padding settings live in its arguments
            continue
        for part, keys in STATE_KEYS.items():
            hit = next((value[k] for k in keys if k in value), None)
            if hit is not None:
                found.setdefault(part, hit)
        stem = fname.split(".")[0]
        if stem == "optimizer" and {"state", "param_groups"} <= value.keys():
            found.setdefault("optimizer", value)
        if stem == "scheduler":
            found.setdefault("scheduler", value)
        if stem.startswith("rng_state"):
            found.setdefault("rng_states", value)
    trainer_state = _json(folder / "trainer_state.json") if folder else None
    if isinstance(trainer_state, dict) and "global_step" in trainer_state:
        # The Trainer resumes its data position by skipping global_step batches.
        found.setdefault("step", trainer_state["global_step"])
        found.setdefault("data_position", trainer_state["global_step"])
    if folder and (folder / "collator.json").is_file():
        found.setdefault("collator", "collator.json")
    rng = found.get("rng_states")
    rng_missing = [f"rng_states.{part}" for part, keys in RNG_PARTS.items()
                   if isinstance(rng, dict) and not any(k in rng for k in keys)]
    return [part for part in STATE_KEYS if found.get(part) is not None], rng_missing


def needed_state(ctx: AuditContext, inspections: list[Inspection]) -> list[str]:
    """The parts an exact resume of this run needs: step, optimizer, RNG states and data position
    always; the scheduler when the run had one (the shim's manifest describes it, a checkpoint or the
    run folder saved its state, or the learning rate changed); the collator's state when a checkpoint
    saved any (the usual collators have none: their settings are code)."""
    held = {part for i in inspections for part in i.state_found or []}
    manifests = [json.loads(m) for (m,) in ctx.con.execute("SELECT manifest FROM manifest WHERE rank = 0").fetchall()]
    scheduler = ("scheduler" in held or any(m.get("scheduler") for m in manifests)
                 or (ctx.run_dir / "scheduler.pt").is_file()
                 or (ctx.scalar("SELECT count(DISTINCT lr) FROM steps WHERE rank = 0 AND isfinite(lr)") or 0) > 1)
    return [part for part in STATE_KEYS if part in ALWAYS_NEEDED or (part == "scheduler" and scheduler)
            or (part == "collator" and part in held)]


def missing_state(ctx: AuditContext, inspections: list[Inspection]) -> dict[str, list[str]]:
    """Checkpoint name -> the training-state parts it lacks of those the run needs (checkpoints whose
    state could be read, and that lack something)."""
    needed = needed_state(ctx, inspections)
    lacking = {i.name: [p for p in needed if p not in i.state_found] + i.rng_missing
               for i in inspections if i.state_found is not None}
    return {name: parts for name, parts in lacking.items() if parts}


def state_folder(ctx: AuditContext, path: Path, checkpoint: dict[str, Any]) -> Path | None:
    """The folder whose files hold a checkpoint's training state: the checkpoint's own folder, or the
    folder a weight file sits in when that folder is its own (not the run directory, no other
    checkpoint in it or under it)."""
    if path.is_dir():
        return path
    folder, root = path.parent, Path(ctx.run_dir).resolve()
    if folder == root:
        return None
    others = [(root / c["path"]).resolve() for c in recorded_checkpoints(ctx.con) if c["path"] != checkpoint["path"]]
    return None if any(o == folder or folder in o.parents for o in others) else folder


def saved_checkpoints(ctx: AuditContext) -> list[dict[str, Any]]:
    """Rank 0's checkpoints in step order (one per path: its last save), with the recorded hashes
    and the saving segment's params."""
    manifests = {seg: json.loads(m) for seg, m in
                 ctx.con.execute("SELECT seg, manifest FROM manifest WHERE rank = 0").fetchall()}
    return [{**c, "params": manifests.get(c["seg"], ctx.manifest).get("params", []),
             "tied": manifests.get(c["seg"], ctx.manifest).get("tied", {})} for c in recorded_checkpoints(ctx.con)]


def _sha256(path: Path) -> str:
    return file_sha256(path)  # the shim's own definition: the recorded and recomputed hashes must agree


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, ValueError):
        return None
