"""Checkpoint inspection: read one saved checkpoint safely and list what is wrong with it.

The library LOOP-09 judges with, and LOOP-11 and `gate` ask: a checkpoint's files (listed without
following links out of the run folder), the sha256 the shim recorded at save, its weights in every
layout `sftaudit.readers.layouts` reads (keys, shapes, dtypes, non-finite values, adapters, tied embeddings)
and the training-state parts its pickles hold, read statically (never unpickled). Results are cached
in the run's DuckDB file (`checkpoint_inspections`), keyed by the files' paths, sizes and mtimes, the
recorded hashes, the parameters judged against and the options.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import duckdb

from ..core.hashing import file_sha256
from ..core.safe_io import is_lfs_pointer, kind_of, open_regular, read_json
from ..errors import InputError
from .checkpoints import (
    TRAINER_GLOBALS,
    CheckpointError,
    MissingWeights,
    PickleContents,
    UnreadablePickle,
    inside_run,
    read_pickle,
)
from .layouts import (
    PICKLE_SUFFIXES,
    FileError,
    UnsafePickle,
    Weights,
    adapter_module,
    read_weights,
    targeted,
)

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

# What reading a checkpoint can find wrong, by kind: LOOP-09 declares each as one of its rules.
PROBLEMS = {
    "outside-run": "the checkpoint was saved outside the run folder and was not read",
    "not-on-disk": "the checkpoint was rotated out or deleted",
    "file-refused": "a checkpoint file is not a regular file inside the run folder",
    "lfs-pointers": "checkpoint files are Git LFS pointers, not the weights",
    "changed-since-save": "files changed or vanished since the shim hashed them at save",
    "non-finite": "the saved weights hold non-finite values",
    "empty-adapter": "the adapter file holds no tensors",
    "adapter-mismatch": "the saved adapter does not match the adapter's target modules",
    "lora-rank": "LoRA matrices do not have the configured rank",
    "lora-b-zero": "every lora_B matrix is still zero after training",
    "tied-weights-differ": "tied input and output embeddings were saved different",
    "keys-mismatch": "the saved keys do not match the model's parameters",
    "shape-mismatch": "tensors were saved with the wrong shape",
    "dtype-mismatch": "tensors were saved in another dtype than the rest",
    "unsafe-pickle": "a pickle would import something a checkpoint does not need",
    "unreadable": "a checkpoint file cannot be read",
    "no-weights": "the checkpoint holds no model weights",
}


@dataclass
class Inspection:
    """What reading one checkpoint found: problems (kind, severity, message, evidence) and tensor digests. The kind
    names the problem for LOOP-09's rules (`PROBLEMS`)."""

    name: str
    step: int
    problems: list[tuple[str, str, str, dict[str, Any]]] = field(default_factory=list)
    digests: dict[str, str] | None = None  # None: the weights could not be read
    on_disk: bool = True
    state_found: list[str] | None = None  # training-state parts its files hold (None: not read)
    rng_missing: list[str] = field(default_factory=list)  # RNG streams its RNG state lacks
    trainer: bool = False  # a Trainer save (trainer_state.json beside the weights)
    unread: set[str] = field(default_factory=set)  # files already reported unreadable or unsafe

    @property
    def passes(self) -> bool:
        return self.on_disk and not any(sev in ("warn", "fail") for _, sev, _, _ in self.problems)


def inspect_checkpoint(
    con: duckdb.DuckDBPyConnection,
    run_dir: Path,
    checkpoint: dict[str, Any],
    *,
    checkpoint_paths: Sequence[str] = (),
    expected_dtype: str | None = None,
    trusted_pickle_globals: Sequence[str] = TRAINER_GLOBALS,
    max_tensors_listed: int = 20,
) -> Inspection:
    """Read one recorded checkpoint (name, step, path, recorded sha256, the params and tied names it is
    judged against) safely; never raises on bad files (they are problems). `checkpoint_paths`: the
    run's recorded checkpoints (a weight file's folder holding another one is not its own);
    `expected_dtype`: None judges against the checkpoint's majority floating dtype;
    `trusted_pickle_globals`: what a pickle may import; `max_tensors_listed`: per problem's evidence.
    The connection keeps the cache (a read-only one only reads it)."""
    options = _Options(expected_dtype, tuple(trusted_pickle_globals), max_tensors_listed)
    return _Inspector(con, Path(run_dir), options, tuple(checkpoint_paths)).inspect(checkpoint)


FINAL_MODEL = "the final model"


def inspect_final_model(
    con: duckdb.DuckDBPyConnection,
    run_dir: Path,
    step: int,
    files: Sequence[str],
    *,
    expected_dtype: str | None = None,
    trusted_pickle_globals: Sequence[str] = TRAINER_GLOBALS,
    max_tensors_listed: int = 20,
) -> Inspection:
    """The model the Trainer saved into the output folder itself at the end (`save_model`), read as a checkpoint's
    weights are: its weight `files` at the folder's top (as the import listed them: regular files, no link), never
    the checkpoint folders under it; no training state is expected beside it. Its keys are held to no parameter
    list: it may rightly differ from the checkpoints (an adapter merged into its base model before the save)."""
    options = _Options(expected_dtype, tuple(trusted_pickle_globals), max_tensors_listed)
    final = {"name": FINAL_MODEL, "step": step, "path": ".", "params": [], "tied": {}, "sha256": None}
    return _Inspector(con, Path(run_dir), options, (), top_level_files=tuple(files)).inspect(final)


@dataclass(frozen=True)
class _Options:
    expected_dtype: str | None
    trusted_pickle_globals: tuple[str, ...]
    max_tensors_listed: int


@dataclass(frozen=True)
class _Inspector:
    con: duckdb.DuckDBPyConnection
    run_dir: Path
    options: _Options
    checkpoint_paths: tuple[str, ...]
    top_level_files: tuple[str, ...] | None = None  # the final model's files at the output's top: no training state

    def inspect(self, checkpoint: dict[str, Any]) -> Inspection:
        name, step = checkpoint["name"], checkpoint["step"]
        out = Inspection(name, step)
        try:
            path = inside_run(self.run_dir, checkpoint["path"])
        except CheckpointError as exc:
            out.problems.append(
                (
                    "outside-run",
                    "fail",
                    f"{name} was saved outside the run directory and was not read ({exc})",
                    {"path": checkpoint["path"]},
                )
            )
            out.digests = None
            return out
        if not path.exists():
            out.on_disk = False
            out.problems.append(
                (
                    "not-on-disk",
                    "info",
                    f"{name} is no longer on disk (rotated out or deleted); it cannot be rolled back to",
                    {"path": checkpoint["path"]},
                )
            )
            return out
        final = self.top_level_files is not None
        folder = None if final else state_folder(self.run_dir, path, checkpoint["path"], self.checkpoint_paths)
        # A weight file's own folder holds its training state: its files are listed (safely) too.
        files, refused = (
            ([path / name for name in self.top_level_files if _regular_not_link(path / name)], [])
            if final
            else _checkpoint_files(self.run_dir, folder if folder is not None and path.is_file() else path)
        )
        if refused:
            out.problems.append(
                (
                    "file-refused",
                    "fail",
                    f"{name}: {refused[0]}; the checkpoint was not read (copy the real file "
                    f"into the checkpoint folder)",
                    {"files": refused},
                )
            )
            return out
        pointers = [f for f in files if is_lfs_pointer(f)]
        if pointers:
            # The weights are not on disk to judge: one finding for the checkpoint, and it is not intact.
            names = listed([str(f.relative_to(path)) if path.is_dir() else f.name for f in pointers], 3)
            out.problems.append(
                (
                    "lfs-pointers",
                    "warn",
                    f"{name}: {len(pointers)} file(s) are Git LFS pointers, not the weights "
                    f"({names}): run `git lfs pull` in the clone, then audit again; until then "
                    + (
                        "it cannot be verified or shipped"
                        if final
                        else "this checkpoint cannot be verified or rolled back to"
                    ),
                    {"lfs_pointers": [f.name for f in pointers]},
                )
            )
            return out
        key = self._cache_key(path, checkpoint, files)
        cached = _cache_get(self.con, key)
        if cached is not None:
            return cached
        self._check_hashes(checkpoint, out)
        weights = self._check_weights(path, checkpoint, out)
        if not final:
            self._check_state(path, folder, weights, out)
        _cache_put(self.con, key, out)
        return out

    def _cache_key(self, path: Path, checkpoint: dict[str, Any], files: list[Path]) -> str:
        """What a checkpoint's inspection depends on: its files' paths, sizes and mtimes (with the
        training state beside a weight file), the hashes the shim recorded, the parameters it is judged
        against, and the options."""
        stats = [(str(f.relative_to(path.parent)), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
        key = [
            CACHE_VERSION,
            checkpoint["name"],
            checkpoint["path"],
            checkpoint["step"],
            stats,
            checkpoint.get("sha256"),
            checkpoint["params"],
            checkpoint["tied"],
            asdict(self.options),
        ]
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()

    def _check_hashes(self, checkpoint: dict, out: Inspection) -> None:
        changed = []
        for rel, recorded in sorted((checkpoint.get("sha256") or {}).items()):
            try:
                target = inside_run(self.run_dir, rel)
                current = file_sha256(target) if target.is_file() else None
            except (CheckpointError, OSError):
                current = None
            if current != recorded:
                changed.append(rel)
        if changed:
            out.problems.append(
                (
                    "changed-since-save",
                    "fail",
                    f"{out.name}: {len(changed)} file(s) changed or vanished since the shim "
                    f"hashed them at save, first {changed[0]}; do not trust this checkpoint",
                    {"files": changed},
                )
            )

    def _check_weights(self, path: Path, checkpoint: dict, out: Inspection) -> Weights | None:
        try:
            weights = read_weights(path, self.options.trusted_pickle_globals)
        except UnsafePickle as exc:
            rel = self._rel(path, exc.file)
            out.problems.append(
                ("unsafe-pickle", "fail", _unsafe_message(rel, exc.imports), {"file": rel, "imports": exc.imports})
            )
            out.unread.add(exc.file.name)
            return None
        except FileError as exc:
            rel = self._rel(path, exc.file)
            out.problems.append(
                (
                    "unreadable",
                    "fail",
                    f"{rel} cannot be read safely: {exc}; {self._what()} cannot be loaded",
                    {"file": rel},
                )
            )
            out.unread.add(exc.file.name)
            return None
        except MissingWeights as exc:
            out.problems.append(
                (
                    "no-weights",
                    "warn",
                    f"{out.name}: {exc}: it cannot be verified or "
                    + ("shipped" if self.top_level_files is not None else "rolled back to"),
                    {"file": path.name},
                )
            )
            return None
        except (CheckpointError, OSError) as exc:
            out.problems.append(("unreadable", "fail", f"{out.name}: {exc}", {"file": path.name}))
            return None
        out.digests = {n: s.digest for n, s in weights.scans.items()}
        entries, scans, params = weights.tensors, weights.scans, checkpoint["params"]
        if weights.adapter is not None:
            self._check_adapter(weights, params, checkpoint["step"], out)
        else:
            if params:  # none known (an import whose only weights are its final model): no keys to hold it to
                self._check_keys(entries, params, checkpoint["tied"], out)
            self._check_tied(weights, checkpoint, out)
        self._check_dtypes(entries, params, out)
        bad = [
            {"tensor": n, "nonfinite_elements": s.nonfinite, "shape": list(entries[n].shape)}
            for n, s in scans.items()
            if s.nonfinite
        ]
        if bad:
            out.problems.append(
                (
                    "non-finite",
                    "fail",
                    f"{out.name} holds non-finite values in {len(bad)} tensor(s), first "
                    f"{bad[0]['tensor']} ({bad[0]['nonfinite_elements']} element(s)); do not resume "
                    f"from or ship it",
                    {"tensors": bad[: self.options.max_tensors_listed], "tensor_count": len(bad)},
                )
            )
        return weights

    def _what(self) -> str:
        return "the final model" if self.top_level_files is not None else "this checkpoint"

    def _rel(self, path: Path, file: Path) -> str:
        if self.top_level_files is not None:  # the final model's files sit at the run's top
            return file.name
        return f"{path.name}/{file.name}" if path.is_dir() else path.name

    def _check_adapter(self, weights: Weights, params: list[dict], step: int, out: Inspection) -> None:
        """PEFT adapters: judged against the adapter's target modules and rank (and the LoRA
        parameters the model trained), not the base model."""
        config, entries, scans = weights.adapter, weights.tensors, weights.scans
        if not entries:
            out.problems.append(
                (
                    "empty-adapter",
                    "fail",
                    f"{out.name}: the adapter file holds no tensors; the trained adapter was "
                    f"not saved (a state_dict filter applied twice keeps nothing)",
                    {"keys": {"missing": [], "unexpected": []}, "tensor_count": 0},
                )
            )
            return
        rank, targets = config.get("r"), config.get("target_modules")
        lora = {n: adapter_module(n) for n in entries}
        untargeted = sorted(n for n, m in lora.items() if m and targets is not None and not targeted(m[0], targets))
        wrong_rank = [
            {"tensor": n, "shape": list(entries[n].shape), "rank": rank}
            for n, m in lora.items()
            if m
            and isinstance(rank, int)
            and not config.get("rank_pattern")
            and len(entries[n].shape) == 2
            and entries[n].shape[0 if m[1].endswith("A") else 1] != rank
        ]
        trained = {adapter_module(p["name"]) for p in params if p["requires_grad"]} - {None}
        saved = {m for m in lora.values() if m}
        missing = sorted(f"{m}.{kind}" for m, kind in trained - saved)
        if missing or untargeted:
            out.problems.append(
                (
                    "adapter-mismatch",
                    "fail",
                    f"{out.name} does not match the adapter: {len(missing)} trained LoRA "
                    f"matrices missing and {len(untargeted)} key(s) outside target_modules "
                    f"{targets}, first {(missing or untargeted)[0]}",
                    {"keys": {"missing": missing, "unexpected": untargeted}},
                )
            )
        if wrong_rank:
            out.problems.append(
                (
                    "lora-rank",
                    "fail",
                    f"{out.name}: {len(wrong_rank)} LoRA matrices do not have the rank r={rank} "
                    f"of adapter_config.json, first {wrong_rank[0]['tensor']} {wrong_rank[0]['shape']}",
                    {"tensors": wrong_rank[: self.options.max_tensors_listed]},
                )
            )
        b = [n for n, m in lora.items() if m and m[1] in ("lora_B", "lora_embedding_B") and n in scans]
        if b and step > 0 and all(scans[n].all_zero for n in b):
            out.problems.append(
                (
                    "lora-b-zero",
                    "fail",
                    f"{out.name}: every lora_B matrix ({len(b)}) is still zero after {step} "
                    f"step(s), so the adapter changes nothing; the LoRA parameters were not trained "
                    f"(not in the optimizer, learning rate 0, or saved before training)",
                    {"tensors": [{"tensor": n} for n in b[: self.options.max_tensors_listed]], "tensor_count": len(b)},
                )
            )

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
            out.problems.append(
                (
                    "tied-weights-differ",
                    "fail",
                    f"{out.name}: the config ties {head} to {embed} "
                    f"(tie_word_embeddings) but the saved tensors differ; a reload overwrites one with "
                    f"the other. Save with tie_word_embeddings=false or tie them again before saving",
                    {"tensors": [{"tensor": head}, {"tensor": embed}]},
                )
            )

    def _check_keys(self, entries: dict, params: list[dict], tied: dict[str, str], out: Inspection) -> None:
        groups: dict[str, set[str]] = {p["name"]: {p["name"]} for p in params}
        for alias, target in tied.items():
            groups.setdefault(target, {target}).add(alias)
        known = {n for g in groups.values() for n in g}
        missing = sorted(c for c, names in groups.items() if not names & entries.keys())
        unexpected = sorted(entries.keys() - known)
        if missing or unexpected:
            first = (missing or unexpected)[0]
            out.problems.append(
                (
                    "keys-mismatch",
                    "fail",
                    f"{out.name} does not match the model: {len(missing)} missing and "
                    f"{len(unexpected)} unexpected key(s), first {first}; a strict load fails and a "
                    f"lenient one silently re-initialises weights",
                    {"keys": {"missing": missing, "unexpected": unexpected}},
                )
            )
        shapes = {p["name"]: tuple(p["shape"]) for p in params}
        wrong = [
            {"tensor": n, "shape": list(e.shape), "expected": list(shapes[groups_of(n, tied)])}
            for n, e in entries.items()
            if groups_of(n, tied) in shapes and e.shape != shapes[groups_of(n, tied)]
        ]
        if wrong:
            out.problems.append(
                (
                    "shape-mismatch",
                    "fail",
                    f"{out.name}: {len(wrong)} tensor(s) have the wrong shape, first "
                    f"{wrong[0]['tensor']} {wrong[0]['shape']} instead of {wrong[0]['expected']}",
                    {"tensors": wrong[: self.options.max_tensors_listed]},
                )
            )

    def _check_dtypes(self, entries: dict, params: list[dict], out: Inspection) -> None:
        floats = {n: e.dtype for n, e in entries.items() if e.dtype in FLOAT_DTYPES}
        if not floats:
            return
        expected = self.options.expected_dtype
        if expected is None:
            counts = Counter(floats.values()).most_common()
            trained = Counter(p["dtype"] for p in params).most_common(1)
            top = [d for d, c in counts if c == counts[0][1]]
            expected = trained[0][0] if trained and trained[0][0] in top and len(top) > 1 else counts[0][0]
        stray = [{"tensor": n, "dtype": d, "expected": expected} for n, d in floats.items() if d != expected]
        if stray:
            out.problems.append(
                (
                    "dtype-mismatch",
                    "fail",
                    f"{out.name}: {len(stray)} tensor(s) not saved as {expected}, first "
                    f"{stray[0]['tensor']} as {stray[0]['dtype']}; cast consistently before saving",
                    {"dtypes": stray[: self.options.max_tensors_listed], "tensor_count": len(stray)},
                )
            )

    def _check_state(self, path: Path, folder: Path | None, weights: Weights | None, out: Inspection) -> None:
        """The training state a checkpoint holds: the pickles of its folder (a weight file's own folder
        too: ``step-40/model.safetensors`` beside ``trainer.pt``), and the state its weight files carry
        (a nested ``torch.save({"model": ..., "optimizer": ...})``, DeepSpeed's optimizer shards, DCP's
        non-model entries)."""
        pickles: dict[str, Any] = dict(weights.state) if weights else {}
        read = ({f.name for f in weights.files} if weights else {path.name}) | out.unread
        shown = out.name if path.is_dir() else folder.name if folder else ""
        for f in (
            sorted(
                p
                for p in folder.iterdir()
                if p.is_file() and p.suffix in PICKLE_SUFFIXES and p.name not in read and p != path
            )
            if folder
            else []
        ):
            rel = f"{shown}/{f.name}"
            try:
                contents = read_pickle(f)
            except UnreadablePickle as exc:
                out.problems.append(
                    (
                        "unreadable",
                        "fail",
                        f"{rel}: {str(exc).partition(': ')[2]}",
                        {"file": rel, "imports": exc.imports},
                    )
                )
                continue
            except CheckpointError as exc:
                out.problems.append(("unreadable", "fail", f"{rel} cannot be inspected: {exc}", {"file": rel}))
                continue
            unsafe = contents.unsafe_globals(self.options.trusted_pickle_globals)
            if unsafe:
                out.problems.append(
                    ("unsafe-pickle", "fail", _unsafe_message(rel, unsafe), {"file": rel, "imports": unsafe})
                )
                continue
            pickles[f.name] = contents
        if weights and weights.state_keys:
            pickles[".metadata"] = PickleContents({k: True for k in weights.state_keys})
        out.state_found, out.rng_missing = state_parts(folder, pickles)
        out.trainer = folder is not None and (folder / "trainer_state.json").is_file()

    # ---------------------------------------------------------------- between checkpoints


# Bump when what an inspection holds changes: older cached results are then ignored.
CACHE_VERSION = 3
CACHE_TABLE = "checkpoint_inspections"


def _cache_get(con: duckdb.DuckDBPyConnection, key: str) -> Inspection | None:
    """A stored inspection of unchanged files (so a re-audit does not rescan them), or None."""
    # Results are drained (fetchall): DuckDB refuses other work on a connection with a half-read one.
    if not con.execute(f"SELECT count(*) FROM information_schema.tables WHERE table_name = '{CACHE_TABLE}'").fetchall()[
        0
    ][0]:
        return None
    rows = con.execute(f"SELECT inspection FROM {CACHE_TABLE} WHERE key = ?", [key]).fetchall()
    if not rows:
        return None
    data = json.loads(rows[0][0])
    return Inspection(**{**data, "problems": [tuple(p) for p in data["problems"]]})


def _cache_put(con: duckdb.DuckDBPyConnection, key: str, inspection: Inspection) -> None:
    try:
        con.execute(f"CREATE TABLE IF NOT EXISTS {CACHE_TABLE} (key VARCHAR PRIMARY KEY, inspection JSON)")
        con.execute(
            f"INSERT OR REPLACE INTO {CACHE_TABLE} VALUES (?, ?)", [key, json.dumps(asdict(inspection), default=str)]
        )
    except duckdb.Error:  # a read-only connection (a check run by hand, the gate): nothing to keep
        pass


# A checkpoint folder holds a few dozen files; one with more entries than this is not one.
MAX_CHECKPOINT_ENTRIES = 10_000


def _regular_not_link(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


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


def listed(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _unsafe_message(rel: str, unsafe: list[str]) -> str:
    return (
        f"{rel} is a pickle that would import and call {unsafe[0]} when loaded (sftaudit only read it "
        f"statically); never torch.load it without weights_only=True and find what wrote it"
    )


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
    global_step = _state_global_step(folder / "trainer_state.json") if folder else None
    if global_step is not None:
        # The Trainer resumes its data position by skipping global_step batches.
        found.setdefault("step", global_step)
        found.setdefault("data_position", global_step)
    if folder and (folder / "collator.json").is_file():
        found.setdefault("collator", "collator.json")
    rng = found.get("rng_states")
    rng_missing = [
        f"rng_states.{part}"
        for part, keys in RNG_PARTS.items()
        if isinstance(rng, dict) and not any(k in rng for k in keys)
    ]
    return [part for part in STATE_KEYS if found.get(part) is not None], rng_missing


def state_folder(run_dir: Path, path: Path, own_path: str, checkpoint_paths: Sequence[str]) -> Path | None:
    """The folder whose files hold a checkpoint's training state: the checkpoint's own folder, or the
    folder a weight file sits in when that folder is its own (not the run directory, no other
    checkpoint in it or under it)."""
    if path.is_dir():
        return path
    folder, root = path.parent, Path(run_dir).resolve()
    if folder == root:
        return None
    others = [(root / p).resolve() for p in checkpoint_paths if p != own_path]
    return None if any(o == folder or folder in o.parents for o in others) else folder


# How much of a trainer_state.json is read for its ``global_step``: the Trainer sorts the state's keys, so its few
# scalar fields come before ``log_history``, which a long per-step run makes hundreds of MB (never decoded here).
STATE_HEAD_BYTES = 1 << 16
_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def _state_global_step(path: Path) -> Any:
    """A trainer_state.json's ``global_step`` (None: no regular file, not a JSON object, no such field, or a save
    cut short: a state that does not end with its closing brace). Of a state larger than its head, taken from the
    fields before the log, decoded one at a time: the last of them so named, as the json module keeps the last of
    duplicate keys (so the import reads the state). The whole file is read when the field is not among them, or when
    the rest of the file may name it again (its name there, or an escape: ``\\u`` could spell it)."""
    try:
        with open_regular(path) as f:
            start = f.read(STATE_HEAD_BYTES)
            size = f.seek(0, os.SEEK_END)
            f.seek(max(size - 64, 0))
            end = f.read(64).rstrip(b" \t\n\r")
            found, value = False, None
            if size > len(start) and end.endswith(b"}") and start.isascii():
                found, value, scanned = _leading_field(start.decode("ascii"), "global_step")
                found = found and not _holds_any(f, scanned, (b"global_step", b"\\"))
    except (OSError, InputError):
        return None
    if not found:
        state = _json(path)
        value = state.get("global_step") if isinstance(state, dict) else None
    return value


def _holds_any(f: Any, offset: int, needles: tuple[bytes, ...]) -> bool:
    """Whether the file from byte `offset` on holds any of `needles`: read into one buffer a block at a time
    (bounded memory, none allocated per block), the buffer starting with the end of the block before (a needle
    across two blocks), each needle found by the bytes' own search, in C."""
    overlap = max(map(len, needles)) - 1
    buffer = bytearray(overlap + (1 << 20))
    f.seek(offset)
    kept = 0  # bytes of the block before at the buffer's start
    while read := f.readinto(memoryview(buffer)[kept:]):
        end = kept + read
        if any(buffer.find(needle, 0, end) >= 0 for needle in needles):
            return True
        kept = min(overlap, end)
        buffer[:kept] = buffer[end - kept : end]
    return False


def _leading_field(text: str, key: str) -> tuple[bool, Any, int]:
    """Whether the JSON object that `text` (a file's head) begins holds `key` among the fields wholly in it, the
    value of the last one so named, and where the fields read end (the start of one cut short by the head's end,
    or of what is not a field); (False, None, where) where it is not found."""
    decoder, space = json.JSONDecoder(), _JSON_SPACE
    pos = space.match(text).end()
    found, value = False, None
    if text[pos : pos + 1] != "{":
        return False, None, pos
    pos += 1
    while True:
        field = pos
        try:
            name, pos = decoder.raw_decode(text, space.match(text, pos).end())
            pos = space.match(text, pos).end()
            if text[pos : pos + 1] != ":":
                return found, value, field
            read, pos = decoder.raw_decode(text, space.match(text, pos + 1).end())
        except (ValueError, RecursionError):
            return found, value, field
        pos = space.match(text, pos).end()
        if pos >= len(text):  # a number at the head's end may go on past it
            return found, value, field
        if name == key:
            found, value = True, read
        if text[pos : pos + 1] != ",":
            return found, value, pos
        pos += 1


def _json(path: Path) -> Any:
    try:
        return read_json(path) if path.is_file() else None
    except (OSError, InputError):
        return None
