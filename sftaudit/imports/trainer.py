"""Import a Hugging Face Trainer / TRL ``output_dir`` that was trained without the shim.

What becomes evidence (and what does not):

* ``trainer_state.json`` ``log_history`` (the newest state, plus older checkpoints' states for
  the steps a resume abandoned): one ``steps`` record per training log (``loss`` is the Trainer's
  mean over the logging window, ``grad_norm`` its pre-clip global norm of the window's last step,
  ``learning_rate``), and every logged number as a ``metrics`` record (``eval_*``, ``epoch``,
  TRL's ``entropy``, ``mean_token_accuracy``, ``num_tokens``). Granularity: ``logging_steps``.
* ``checkpoint-N/`` folders (and any other folder of the output holding a ``trainer_state.json``, such
  as the ``last-checkpoint/`` a Hub push leaves, at its ``global_step``): ``checkpoints`` records (files,
  resume-state outline, tokenizer fingerprint), so LOOP-09 inspects them and the verdict can name a
  rollback checkpoint.
* The tokenizer and chat template saved with the newest checkpoint: the manifest's tokenizer
  and ``sftaudit/tokenizer/`` (LOOP-01/02).

The manifest also carries the run's planned length (``config.max_steps``: the state's ``max_steps``,
else LLaMA-Factory's ``total_steps``, else ``num_train_epochs`` x the steps per epoch the log shows) and
its vocabulary size (``vocab_size``: ``config.json``, else the embedding rows of a checkpoint's weights,
else the saved tokenizer's length), and the log files that are Git LFS pointers (``lfs_pointers``, said
once in ``import_notes``).

Per-step batches, per-tensor gradient norms and probes do not exist for such a run: the checks
that need them do not run, and the verdict says so. ``training_args.bin`` is a pickle of
arbitrary classes and is never loaded; the arguments that matter are in ``trainer_state.json``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from bisect import bisect_right
from itertools import compress
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np

from ..core.artifacts import SCHEMA_VERSION, TOKENIZER_DIR, artifact_root, rank_dir
from ..core.safe_io import LFS_HINT, UnsafeFile, is_lfs_pointer, open_regular, regular_file
from ..errors import InputError
from .dataset import (
    DATASET_KINDS,
    DATASET_LACKS,
    DATASET_SOURCE,
    dataset_description,
    dataset_records,
    failure_events,
)
from .logs import holding, latest_history, logging_interval, read_json, training_logs
from .notes import earlier_run_in_log, ignored_values, lfs, log_limits, other_runs, skipped_records
from .runs import describe, group_runs, later, latest, plan, plans_differ, split_glued, tip
from .selection import run_selection
from .source import SourceLog
from .sources import find_log, missing_extras, registered_sources
from .sources.trainer_state import PLAN_FIELDS, TRAINER_STATE, TrainerState
from .task import describe_task
from .writer import series, write

CHECKPOINT_DIR = re.compile(r"(?:checkpoint|ckpt)[-_]?(\d+)")
# Folders of an output that are never a checkpoint, whatever they hold.
NOT_CHECKPOINTS = {"sftaudit", "runs", "wandb", ".git"}
# Tensors whose rows are the vocabulary (input embeddings or output head), by the end of their name.
EMBEDDING_NAMES = (
    "embed_tokens.weight",
    "wte.weight",
    "word_embeddings.weight",
    "lm_head.weight",
    "embed_out.weight",
    "shared.weight",
)
# A tokenizer folder that can be built whole (a tokenizer_config.json alone rebuilds a few special tokens).
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt", "spiece.model")
# A planned length no run has (the Trainer's "until max_steps" sentinel for epochs is sys.maxsize).
MAX_PLAUSIBLE_EPOCHS = 1_000_000
LOGS_SOURCE = TrainerState.provenance
CHECKPOINTS_SOURCE = "checkpoints (weights, optimizer state)"
PROBES_SOURCE = "post-hoc probes"
# Where each kind of evidence of an imported run came from (the verdict's per-check provenance).
SOURCES = {
    "steps": LOGS_SOURCE,
    "metrics": LOGS_SOURCE,
    "checkpoints": CHECKPOINTS_SOURCE,
    "tokenizer": "tokenizer saved with the checkpoints",
    "chat_template": "tokenizer saved with the checkpoints",
    "probes": PROBES_SOURCE,
    "generations": PROBES_SOURCE,
    "evals": PROBES_SOURCE,
}
# What `sftaudit probe` wrote (checkpoints run after the fact): kept when the logs are imported again.
POSTHOC_FILE = "posthoc.json"
PROBE_KINDS = ("probes", "generations", "evals")


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """The checkpoint folders of a Trainer output, by step: ``checkpoint-N/`` (also ``checkpoint_N``,
    ``ckpt-N``) at N, and any other folder holding a ``trainer_state.json`` (``last-checkpoint/`` from a
    Hub push, ``best_checkpoint/``...) at its ``global_step``, unless a numbered folder has that step."""
    numbered, named = {}, {}
    if not run_dir.is_dir():
        return []
    for p in run_dir.iterdir():
        if not p.is_dir() or p.name in NOT_CHECKPOINTS:
            continue
        if m := CHECKPOINT_DIR.fullmatch(p.name):
            numbered[p] = int(m.group(1))  # symlinked too: recorded, never read (LOOP-09 names where it points)
        elif not p.is_symlink() and (step := _global_step(p / TRAINER_STATE, run_dir)) is not None:
            named[p] = step
    taken = set(numbered.values())
    return sorted([(s, p) for p, s in numbered.items()] + [(s, p) for p, s in named.items() if s not in taken])


def _global_step(path: Path, run_dir: Path) -> int | None:
    state = read_json(path, run_dir)
    step = state.get("global_step") if isinstance(state, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def lfs_pointers(run_dir: Path, checkpoints: list[tuple[int, Path]]) -> list[str]:
    """The log files (trainer states, every source's logs) that are Git LFS pointers, relative to the run folder.
    Checkpoint weights and training state are LOOP-09's to name."""
    candidates = {run_dir / TRAINER_STATE, *(p / TRAINER_STATE for _, p in checkpoints), *_log_candidates(run_dir)}
    return sorted(str(p.relative_to(run_dir)) for p in candidates if is_lfs_pointer(p, run_dir))


def _log_candidates(run_dir: Path) -> list[Path]:
    """The paths a log kept per (re)start may be, by name (every registered source's patterns; a FIFO or a link
    out of the run too: the import says why it does not read it)."""
    return [
        p
        for source in registered_sources()
        if source.rank is not None
        for pattern in source.patterns
        for p in run_dir.glob(pattern)
        if not p.is_dir() and "sftaudit" not in p.relative_to(run_dir).parts
    ]


def _unreadable_logs(run_dir: Path) -> list[str]:
    """Why each path named as a log is not read (not a regular file, or a link out of the run)."""
    out = []
    for p in _log_candidates(run_dir):
        try:
            regular_file(p.absolute(), run_dir)
        except UnsafeFile as exc:
            out.append(str(exc))
    return out


def is_trainer_output(run_dir: str | Path) -> bool:
    """A folder holding a Trainer state (a file of that name, whatever it is: the import says why it cannot read a
    FIFO or a link out of the run), a checkpoint folder or a training log of a registered source."""
    run_dir = Path(run_dir)
    return os.path.lexists(run_dir / TRAINER_STATE) or bool(checkpoint_dirs(run_dir)) or bool(_log_candidates(run_dir))


def imported_manifest(run_dir: str | Path) -> dict[str, Any] | None:
    """The manifest an earlier import wrote (None: no artifacts, or the shim's)."""
    path = rank_dir(run_dir, 0) / "manifest.jsonl"
    try:  # a FIFO or device must not block here: ingest refuses it with its reason
        with open_regular(path.absolute(), run_dir) as f:
            first = json.loads(f.readline(2**24))  # bounded: a manifest record is a few hundred KB
    except (OSError, UnsafeFile, ValueError, RecursionError):
        return None
    return first if isinstance(first, dict) and first.get("imported") else None


def recorded_by_shim(run_dir: str | Path) -> bool:
    """Whether the run folder holds the shim's artifacts (nothing to import)."""
    return any(artifact_root(run_dir).glob("rank-*")) and imported_manifest(run_dir) is None


def ensure_artifacts(
    run_dir: str | Path, data: str | Path | None = None, source: str | None = None, file: str | Path | None = None
) -> bool:
    """Before an audit: import a Trainer output that has no artifacts, or refresh an earlier import
    (the run may have gone on since), with its training data when given (`source`, `file`: as `import_run`).
    Returns whether it imported. Shim artifacts are left alone (and `data` refused: the shim recorded the
    batches)."""
    run_dir = Path(run_dir)
    has_artifacts = any(artifact_root(run_dir).glob("rank-*"))
    if (not has_artifacts and (is_trainer_output(run_dir) or file is not None or source is not None)) or (
        has_artifacts and imported_manifest(run_dir)
    ):
        import_run(run_dir, data, source=source, file=file)
        return True
    if data is not None:
        raise InputError(
            f"{run_dir}: --data is for runs trained without the shim (the shim recorded this run's batches)"
        )
    return False


def import_run(
    run_dir: str | Path,
    data: str | Path | None = None,
    progress: bool = False,
    source: str | None = None,
    file: str | Path | None = None,
) -> dict[str, Any]:
    """Write ``RUN_DIR/sftaudit/rank-0/*.jsonl`` from a Trainer output (and from its training data, when
    given: `dataset.dataset_records`); returns what was imported. The run's training log kept per (re)start is
    found by content among the registered sources (`sources.find_log`); `source` names the one to read (``--source``),
    `file` a log file given as the run's own path (`run_dir` is its folder)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: no such run directory")
    if data is not None and not Path(data).exists():  # before anything is read or written
        raise InputError(f"{data}: no such dataset file or folder")
    file = Path(file) if file is not None else None
    if file is None and source is None and not is_trainer_output(run_dir):
        raise InputError(
            f"{run_dir}: not a Trainer output or training log (no {TRAINER_STATE}, checkpoint-*/ folder or log of "
            f"{', '.join(s.name for s in registered_sources() if s.rank is not None)})"
        )
    if any(artifact_root(run_dir).glob("rank-*")) and not imported_manifest(run_dir):
        raise InputError(f"{run_dir}: already has sftaudit artifacts recorded by the shim; audit them directly")
    every_checkpoint = checkpoint_dirs(run_dir)
    # A checkpoint folder symlinked out of the run (to `/`) is never read: LOOP-09 reports it.
    checkpoints = [(s, p) for s, p in every_checkpoint if p.resolve().is_relative_to(run_dir.resolve())]
    states, refused = _states(run_dir, checkpoints)
    # The training log kept per (re)start (LLaMA-Factory's, TensorBoard's, ...), by content (`sources`).
    log = find_log(run_dir, source, file)
    segments, earlier = _latest_start(log.segments, log.what) if log else ([], [])
    source = LOGS_SOURCE if states else log.provenance if log else LOGS_SOURCE
    if not states and segments:  # a per-restart log alone: its last restart's history stands in for the state
        states = [_log_state(run_dir, latest_history(segments), log)]
    pointers = lfs_pointers(run_dir, checkpoints)
    if not states:
        hint = f" ({'; '.join(missing_extras(run_dir))})" if missing_extras(run_dir) else ""
        if pointers:
            hint = f" ({len(pointers)} log file(s), {pointers[0]} first, are a {LFS_HINT})"
        elif log and log.records:
            hint = (
                f" ({log.what} holds {log.records} record(s) without a loss or an eval number: "
                "a prediction or evaluation run, nothing was trained)"
            )
        elif refused or _unreadable_logs(run_dir):
            hint = f" ({(refused or _unreadable_logs(run_dir))[0]})"
        raise InputError(
            f"{run_dir}: no readable {TRAINER_STATE} or training log (in the run folder or any checkpoint)" + hint
        )
    # Which run the folder's states belong to, and which is the latest, by what they hold (`runs`).
    glued = _cut_glued(run_dir, states)
    groups = group_runs(states)
    judged = latest(groups)
    others = sorted((describe(g, run_dir) for g in groups if g is not judged), key=lambda o: -o["global_step"])
    # A glued run whose own checkpoints are here is named with them, once.
    named = {(o["first_step"], o["last_step"]) for o in others}
    earlier += [g for g in glued if (g["first_step"], g["last_step"]) not in named]
    others_folders = {s["folder"] for g in groups if g is not judged for s in g}
    checkpoints = [(s, p) for s, p in checkpoints if p not in others_folders]
    newest = _newest(judged)
    timeline, abandoned, resumes = _timeline(newest, judged)
    if segments:
        timeline, abandoned, resumes = _with_log(timeline, abandoned, resumes, segments)
    # A resume whose abandoned steps lie beyond the run's end: nothing replaced them.
    last_step = max(map(itemgetter("step"), timeline), default=0)
    resumes = {r: src for r, src in resumes.items() if r <= last_step}
    abandoned = [(e, r) for e, r in abandoned if r in resumes]
    starts = sorted(resumes)  # segment k + 1 starts at starts[k]
    before_resume = {r: k for k, r in enumerate(starts)}  # the segment a resume abandoned a branch of

    records: dict[str, list[dict[str, Any]]] = {k: [] for k in ("manifest", "checkpoints", "events")}
    # Each logged entry with its segment: an abandoned branch's with the segment the resume ended.
    logged_steps = np.fromiter(map(itemgetter("step"), timeline), dtype=np.int64, count=len(timeline))
    segs = np.concatenate(
        [
            np.array([before_resume[r] for _, r in abandoned], dtype=np.int64),
            np.searchsorted(np.array(starts, dtype=np.int64), logged_steps, side="right"),
        ]
    )
    # What the import's parts each need of the log, gathered once: the training logs, the keys logged.
    logged = [e for e, _ in abandoned] + timeline
    keys = set().union(*timeline)
    logged_keys = keys.union(*(e for e, _ in abandoned))
    training = training_logs(logged, logged_keys)
    steps, metrics = series(segs, logged, training, logged_keys)
    branch_of = {s["folder"]: s["diverged"] for s in judged if s.get("diverged") in resumes}
    outlines = {s["folder"]: s["outline"] for s in states if not s["top_level"]}
    tokenizer, fingerprints, refused = _tokenizer(run_dir, checkpoints)
    for step, folder in every_checkpoint:
        if folder in others_folders:
            continue  # another run's: named once in the notes
        if (step, folder) not in checkpoints:
            records["checkpoints"].append(
                {
                    "seg": 0,
                    "event": "saved",
                    "step": step,
                    "path": folder.name,
                    "files": [],
                    "training_state": {},
                    "tokenizer_fingerprint": None,
                    "time": None,
                }
            )
            continue
        seg = before_resume[branch_of[folder]] if folder in branch_of else bisect_right(starts, step)
        records["checkpoints"].append(
            {
                "seg": seg,
                "event": "saved",
                "step": step,
                "path": folder.name,
                "files": [
                    {"name": str(f.relative_to(run_dir)), "bytes": f.stat().st_size}
                    for f in sorted(folder.rglob("*"))
                    if f.is_file()
                ],
                "training_state": _resume_outline(folder, outlines.get(folder)),
                "tokenizer_fingerprint": fingerprints.get(folder),
                "time": folder.stat().st_mtime,  # a record of the save, never a reason to choose a run
            }
        )
    if data is not None:
        records.update(dataset_records(run_dir, data, newest["train_batch_size"], progress))
    dataset = dataset_description(run_dir)  # this --data, or an earlier one's (its records are kept)
    records["events"] += failure_events(dataset or {})
    described = _described(run_dir, checkpoints, newest, tokenizer, keys)
    notes = (
        other_runs(others)
        + earlier_run_in_log(earlier)
        + lfs(pointers)
        + skipped_records(log.skipped if log else [])
        + ignored_values(
            {**(log.ignored if log else {}), **_ignored(judged)}, log.what if log and not states else TRAINER_STATE
        )
        + log_limits(
            timeline,
            training[len(abandoned) :],
            keys,
            newest,
            _logging_steps(newest),
            log_beyond_checkpoints=newest["top_level"] or bool(segments),
            ended=_ended(newest),
            scaler_in=[p.name for _, p in checkpoints if (p / "scaler.pt").is_file()],
        )
    )
    for seg in range(len(starts) + 1):
        state = _segment_state(judged, newest, starts, seg)
        manifest = _manifest(run_dir, state, described, seg, dataset, source, log, pointers, notes)
        if seg:
            manifest["config"]["resume_from"] = resumes[starts[seg - 1]] or _resumed_from(
                checkpoints, timeline, starts[seg - 1]
            )
        if refused:  # the tokenizer the run saved is not used: the checks that need it say why
            manifest["lacks"]["tokenizer"] = refused
        records["manifest"].append(manifest)
        records["events"].append({"seg": seg, "kind": "start", "time": state["mtime"]})
    write(run_dir, records, {"steps": steps, "metrics": metrics})
    return {
        "steps": steps.height,
        "metrics": metrics.height,
        "checkpoints": len(checkpoints),
        "logging_steps": _logging_steps(newest),
        "resumed_at": starts[0] if starts else None,
        "resumes": starts,
        "abandoned_steps": sorted({e["step"] for e, _ in abandoned if "loss" in e}),
        "other_runs": len(others) + len(earlier),
        "tokenizer": tokenizer is not None,
        "dataset_rows": (dataset or {}).get("rows"),
        "notes": [n["text"] for n in notes],
    }


# ---------------------------------------------------------------------------- trainer states


def _states(run_dir: Path, checkpoints: list[tuple[int, Path]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Every readable trainer_state.json (a truncated one is an interrupted save: LOOP-09's business), each read
    once: its log history, its plan and other fields, and what the checkpoint's resume outline needs; and why each
    unreadable one was refused (a FIFO, a link out of the run, a file too deeply nested)."""
    out, refused = [], []
    places = [(s, p, False) for s, p in checkpoints] + [(None, run_dir, True)]
    places = [(step, folder, top) for step, folder, top in places if os.path.lexists(folder / TRAINER_STATE)]
    reads = TrainerState().read_all([folder / TRAINER_STATE for _, folder, _ in places], run_dir)
    for (step, folder, top_level), read in zip(places, reads):
        path = folder / TRAINER_STATE
        try:
            if isinstance(read, InputError):
                raise read
            mtime = path.stat().st_mtime
        except (OSError, InputError) as exc:
            refused.append(str(exc))
            continue
        fields, plan = read.fields, read.plan
        global_step = fields.get("global_step")
        out.append(
            {
                "folder": folder,
                "step": step,  # the folder's step (None: the state at the top of the folder)
                "top_level": top_level,
                "history": read.segments[0],
                "mtime": mtime,
                "global_step": global_step if isinstance(global_step, int) and not isinstance(global_step, bool) else 0,
                **{k: plan.get(k) for k in PLAN_FIELDS},
                # the state's other fields (best_metric, best_global_step, stateful_callbacks, ...), as written
                "fields": fields,
                "outline": {"step": global_step, "epoch": fields.get("epoch")},
                "ignored": read.ignored,
            }
        )
    return out, refused


def _ignored(run: list[dict[str, Any]]) -> dict[str, str]:
    """The values the judged run's states hold where a number belongs and that are none (each field once)."""
    out: dict[str, str] = {}
    for s in run:
        for k, v in s.get("ignored", {}).items():
            out.setdefault(k, v)
    return out


def _log_state(run_dir: Path, history: list[dict[str, Any]], log: SourceLog) -> dict[str, Any]:
    """The history of a training log's last restart, shaped as `_states` shapes a trainer_state.json, planned as the
    log recorded (TensorBoard's ``args`` text, LLaMA-Factory's ``total_steps``); the model config where it kept one."""
    return {
        "folder": run_dir / "log",
        "file": log.what,
        "step": None,
        "top_level": True,
        "history": history,
        "mtime": None,
        "global_step": max(e["step"] for e in history),
        **{k: log.plan.get(k) for k in PLAN_FIELDS},
        "logging_steps": logging_interval(history) or log.plan.get("logging_steps"),
        "fields": {},
        "model_config": log.identity.get("model_config"),
    }


def _latest_start(
    segments: list[list[dict[str, Any]]], log_file: str
) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]]]:
    """A log kept per (re)start from the last start that began a new run: a restart whose first training log is
    within the first logging interval trained from step 0 (a resume starts past the checkpoint it resumed from).
    Returns those segments and the earlier runs' part of the log, described for the notes."""
    interval = logging_interval([e for seg in segments for e in seg]) or 1
    firsts = [min((e["step"] for e in seg if "loss" in e), default=None) for seg in segments]
    new = [i for i, first in enumerate(firsts) if i and first is not None and first <= interval]
    if not new:
        return segments, []
    cut = new[-1]
    before = [e["step"] for seg in segments[:cut] for e in seg]
    return segments[cut:], [
        {
            "file": log_file,
            "first_step": min(before),
            "last_step": max(before),
            "starts_at": firsts[cut],
            "why": "a run that starts again from its first step",
        }
    ]


def _cut_glued(run_dir: Path, states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cut each state's history at its last reset (`runs.split_glued`), noting where its epoch count started again
    (``epoch_restarts``); the other run's part, described once per file that held one. A history that begins
    another's (an earlier checkpoint's, its entries the same objects: compared in C) where that one has no reset
    and no restart has none either (they are found between consecutive training logs): not looked at again."""
    splits, whole = {}, []  # whole: the histories with no reset and no restart, longest first
    for s in sorted(states, key=lambda s: len(s["history"]), reverse=True):
        history = s["history"]
        if any(w[: len(history)] == history for w in whole):
            splits[id(s)] = [], history, []
            continue
        splits[id(s)] = split = split_glued(history)
        if not split[0] and not split[2]:
            whole.append(history)
    out = []
    for s in states:
        before, after, s["epoch_restarts"] = splits[id(s)]
        if not before:
            continue
        s["history"] = after
        first = next(e for e in after if "loss" in e)
        out.append(
            {
                "file": s.get("file") or str((s["folder"] / TRAINER_STATE).relative_to(run_dir)),
                "first_step": min(e["step"] for e in before),
                "last_step": max(e["step"] for e in before),
                "starts_at": first["step"],
                "why": "its step goes back"
                if first["step"] < max(e["step"] for e in before)
                else "its epoch goes back",
            }
        )
    # One note per other run: a later checkpoint's state repeats what an earlier one held.
    unique = {(p["first_step"], p["last_step"], p["starts_at"]): p for p in out}
    return list(unique.values())


def _newest(run: list[dict[str, Any]]) -> dict[str, Any]:
    """The state of the branch written last (`runs.later`, two states in turn; a state consistent with another
    is its earlier checkpoint, or its continuation)."""
    ordered = sorted(run, key=lambda s: (s["global_step"], s["top_level"], str(s["folder"])), reverse=True)
    best = ordered[0]
    for s in ordered[1:]:
        diverged = _diverged(s, best)
        if diverged is not None and later([s], [best], diverged):
            best = s
    return best


def _diverged(a: dict[str, Any], b: dict[str, Any]) -> int | None:
    """The first step at which two states' logs differ, up to where both logged (None: they agree)."""
    short, long = sorted((a["history"], b["history"]), key=len)
    if short == long[: len(short)]:
        return None  # one is the other's earlier checkpoint (compared in C; a NaN entry takes the long way)
    end = min(max((e["step"] for e in a["history"]), default=-1), max((e["step"] for e in b["history"]), default=-1))
    index = {_key(e): e for e in b["history"] if e["step"] <= end}
    differing = [e["step"] for e in a["history"] if e["step"] <= end and not _same(index.pop(_key(e), None), e)]
    differing += [step for step, _ in index]  # what b logged and a did not
    return min(differing, default=None)


def _with_log(timeline, abandoned, resumes, segments):
    """What a training log kept per (re)start adds to the trainer states (or to its own last restart's history):
    the lines a restart abandoned that no saved state kept (logged between the checkpoint resumed from and the
    crash), and the lines logged after the last saved state (a crash before the next save)."""
    known = {e["step"] for e, _ in abandoned}
    lost = []
    for seg, after in zip(segments, segments[1:]):
        restart = after[0]["step"]
        dropped = [(e, restart) for e in seg if e["step"] >= restart and e["step"] not in known]
        if dropped:
            resumes.setdefault(restart, None)
            lost += dropped
    abandoned = sorted(abandoned + lost, key=lambda x: x[0]["step"])
    last = max(map(itemgetter("step"), timeline), default=0)
    return timeline + [e for e in segments[-1] if e["step"] > last], abandoned, resumes


def _resumed_from(checkpoints: list[tuple[int, Path]], timeline: list[dict[str, Any]], resumed_at: int) -> str | None:
    """The checkpoint on disk the resume can have started from: the newest saved after the last training log
    before the resume and before the first one after it (the logs show the restart only to their resolution)."""
    before = max((e["step"] for e in timeline if "loss" in e and e["step"] < resumed_at), default=0)
    within = [p for step, p in checkpoints if before <= step < resumed_at]
    return within[-1].name if within else None


def _key(entry: dict[str, Any]) -> tuple[int, tuple[str, ...]]:
    return entry["step"], tuple(sorted(entry))


def _timeline(newest: dict[str, Any], run: list[dict[str, Any]]):
    """The newest state's log history, the entries other states of the run hold that it lost (each with the step
    the run resumed at), and the resumes: {first step after the resume: the checkpoint it resumed from, or None}.

    A state whose entries disagree with the newest's from some step on saw another branch of the run: its
    entries from that step are the abandoned branch, and the run resumed there. A state that agrees but
    planned otherwise (another ``max_steps``, batch size or ``logging_steps``) was saved before a resume that
    changed the plan: the run resumed at the first step logged after it, from it. Where the newest log's epoch
    count starts again from the step it fell at (`runs.split_glued`), the run resumed on a streamed dataset."""
    current: dict[tuple, dict[str, Any]] = {}  # the newest's entries by step and keys (made when first needed)
    abandoned: dict[tuple, tuple[dict[str, Any], int]] = {}
    resumes: dict[int, str | None] = {}
    agreeing = []
    for s in run:
        if s is newest:
            continue
        same = s["history"] == newest["history"][: len(s["history"])]  # an earlier checkpoint, compared in C
        if not same and not current:
            current = {_key(e): e for e in newest["history"]}
        differing = [] if same else [e["step"] for e in s["history"] if not _same(current.get(_key(e)), e)]
        if not differing:
            agreeing.append(s)
            continue
        diverged = s["diverged"] = min(differing)
        resumes.setdefault(diverged, None)
        abandoned.update({_key(e): (e, diverged) for e in s["history"] if e["step"] >= diverged})
    for step in newest["epoch_restarts"]:
        resumes.setdefault(step, None)  # a resume on a streamed dataset: its epoch count started again
    history = newest["history"]
    logged = None  # the training logs' steps, sorted (made when a plan changed)
    chain = sorted(agreeing + [newest], key=lambda s: (s["global_step"], s["top_level"]))
    for before, after in zip(chain, chain[1:]):
        if plans_differ(plan(before), plan(after)):
            if logged is None:
                logged = sorted(compress(map(itemgetter("step"), history), holding(history, "loss")))
            i = bisect_right(logged, before["global_step"])
            if i < len(logged):
                resumes.setdefault(logged[i], None if before["top_level"] else before["folder"].name)
    return newest["history"], sorted(abandoned.values(), key=lambda x: x[0]["step"]), resumes


def _same(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    # json.dumps compares NaN == NaN (a NaN loss logged by both states is the same entry)
    return a is not None and (a == b or json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True))


def _segment_state(run: list[dict[str, Any]], newest: dict[str, Any], starts: list[int], seg: int) -> dict[str, Any]:
    """The state that describes a segment's plan: the newest, for the last segment; else the furthest state saved
    within the segment (before the next resume), on the branch the run kept, else on any."""
    if seg == len(starts):
        return newest
    low, high = (starts[seg - 1] if seg else -1), starts[seg]
    within = [s for s in run if low <= s["global_step"] < high]
    kept = [s for s in within if s.get("diverged") is None]
    return tip(kept or within) if (kept or within) else newest


# ---------------------------------------------------------------------------- checkpoints, tokenizer, manifest


def _resume_outline(folder: Path, outline: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the folder holds for an exact resume (the same outline the shim's Trainer callback records); `outline`:
    its trainer state's step and epoch, as `_states` read them (read here only when `_states` could not)."""
    names = {p.name for p in folder.iterdir()}
    state = outline  # None: no state, or one `_states` could not read (never read twice)
    return {
        "step": state.get("global_step") if isinstance(state, dict) else None,
        "epoch": state.get("epoch") if isinstance(state, dict) else None,
        "optimizer": "optimizer.pt" in names,
        "scheduler": "scheduler.pt" in names,
        "rng_states": sorted(n for n in names if n.startswith("rng_state")),
        "trainer_state": state is not None,
        "training_args": "training_args.bin" in names,
    }


def _tokenizer(
    run_dir: Path, checkpoints: list[tuple[int, Path]]
) -> tuple[dict[str, Any] | None, dict[Path, str], str | None]:
    """The newest saved tokenizer (described, and copied to sftaudit/tokenizer/), each checkpoint's fingerprint,
    and, when no saved tokenizer is usable, why the last one was refused (remote code, not whole)."""
    from ..core.tokenizer import TokenizerUnusable, describe_tokenizer, load_tokenizer, tokenizer_fingerprint

    folders = [p for _, p in checkpoints] + [run_dir]
    fingerprints: dict[Path, str] = {}
    newest, refused = None, None
    for folder in folders:
        if not any((folder / name).is_file() for name in ("tokenizer_config.json", "tokenizer.json")):
            continue
        try:
            tok = load_tokenizer(folder)
        except TokenizerUnusable as exc:
            refused = str(exc).partition(": ")[2]
            continue
        except InputError:
            continue
        fingerprints[folder] = tokenizer_fingerprint(tok)
        newest = tok
    if newest is None:
        return None, fingerprints, refused
    target = artifact_root(run_dir) / TOKENIZER_DIR
    shutil.rmtree(target, ignore_errors=True)
    newest.save_pretrained(str(target))
    return describe_tokenizer(newest), fingerprints, None


def _model(run_dir: Path, checkpoints: list[tuple[int, Path]], logged: dict[str, Any] | None = None) -> dict[str, Any]:
    """The newest config.json saved (else the one a log kept: TensorBoard's model_config text)."""
    config = next((c for c in _json_files(run_dir, checkpoints, "config.json")), None)
    config = config or (logged if isinstance(logged, dict) and logged else None)
    if config is None:
        return {}
    architectures = config.get("architectures")
    return {
        "class": architectures[0] if isinstance(architectures, list) and architectures else None,
        "config": config,
        "tie_word_embeddings": config.get("tie_word_embeddings"),
    }


def _json_files(run_dir: Path, checkpoints: list[tuple[int, Path]], name: str):
    """The JSON objects saved under `name`, newest checkpoint first, the run folder's last (lazily: read as taken)."""
    for folder in [p for _, p in reversed(checkpoints)] + [run_dir]:
        value = read_json(folder / name, run_dir)
        if isinstance(value, dict) and value:
            yield value


def _described(
    run_dir: Path,
    checkpoints: list[tuple[int, Path]],
    newest: dict[str, Any],
    tokenizer: dict[str, Any] | None,
    keys: set[str],
) -> dict[str, Any]:
    """What the manifest says of the model, once for every segment: ``model``, ``params``, ``vocab_size``,
    ``task`` (`task.describe_task`: config.json or adapter_config.json, and the `keys` the log holds)."""
    model = _model(run_dir, checkpoints, newest.get("model_config"))
    folders = [p for _, p in reversed(checkpoints)] + [run_dir]
    params = _params(folders[:-1])
    vocab_size = _vocab_size(model, params or _params([run_dir]), tokenizer, folders)
    adapter = next(_json_files(run_dir, checkpoints, "adapter_config.json"), None)
    task = describe_task(model.get("config"), adapter, keys - {"step"})
    task["vocab_size"] = task["vocab_size"] or vocab_size
    return {
        "model": model,
        "params": params,
        "vocab_size": vocab_size,
        "tokenizer": tokenizer or {},
        "task": task,
        "final_model": _final_model(run_dir, newest),
    }


def _final_model(run_dir: Path, newest: dict[str, Any]) -> dict[str, Any] | None:
    """The model saved into the output folder itself at the end (`Trainer.save_model`): the weight files at its top
    (an adapter, safetensors, a torch file), at the newest state's step; None when there are none. Listed only: the
    files are read by LOOP-09, as a checkpoint's are."""
    from ..readers.layouts import final_model_files

    names = final_model_files(run_dir)
    return {"step": newest["global_step"], "files": names} if names else None


def _params(folders: list[Path]) -> list[dict[str, Any]]:
    """The tensors of the first readable folder (file order: a checkpoint does not keep the model's
    parameter order; whether each was trainable is not on disk either)."""
    from ..readers.checkpoints import CheckpointError
    from ..readers.optimizer_state import checkpoint_weights

    for folder in folders:
        try:
            weights = checkpoint_weights(folder)
        except CheckpointError:
            continue
        return [
            {"name": name, "shape": list(e.shape), "dtype": e.dtype, "numel": math.prod(e.shape), "requires_grad": None}
            for name, (_, e) in weights.items()
        ]
    return []


def _planned_steps(newest: dict[str, Any], logged_plan: Any) -> int | None:
    """The run's planned length: the state's ``max_steps``, else the one the log recorded (LLaMA-Factory's
    ``total_steps``, TensorBoard's ``args``), else ``num_train_epochs`` x the steps per epoch of its last training
    log (its step over its epoch)."""
    for planned in (newest["max_steps"], logged_plan):
        if isinstance(planned, int) and not isinstance(planned, bool) and planned > 0:
            return planned
    epochs = newest["num_train_epochs"]
    logs = [
        e
        for e in newest["history"]
        if "loss" in e and isinstance(e.get("epoch"), (int, float)) and 0 < e["epoch"] < MAX_PLAUSIBLE_EPOCHS
    ]
    if isinstance(epochs, (int, float)) and 0 < epochs < MAX_PLAUSIBLE_EPOCHS and logs:
        return round(epochs * logs[-1]["step"] / logs[-1]["epoch"]) or None
    return None


def _vocab_size(
    model: dict[str, Any], params: list[dict[str, Any]], tokenizer: dict[str, Any] | None, folders: list[Path]
) -> int | None:
    """The model's vocabulary: config.json's ``vocab_size`` (a multimodal model's ``text_config``), else the rows
    of its embedding or output head in the weights, else the saved tokenizer's length (when it was saved whole)."""
    config = model.get("config") or {}
    for part in (config, config.get("text_config"), config.get("llm_config")):
        size = part.get("vocab_size") if isinstance(part, dict) else None
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            return size
    rows = [p["shape"][0] for p in params if p["name"].endswith(EMBEDDING_NAMES) and len(p["shape"]) == 2]
    if rows:
        return max(rows)
    whole = any((folder / name).is_file() for folder in folders for name in TOKENIZER_VOCAB_FILES)
    return (tokenizer or {}).get("length") if whole else None


def _logging_steps(newest: dict[str, Any]) -> int | None:
    """``logging_steps`` as the state says it (older states have none), else as the log shows it."""
    steps = newest["logging_steps"]
    if (
        isinstance(steps, (int, float))
        and not isinstance(steps, bool)
        and 1 <= steps < math.inf
        and steps == int(steps)
    ):
        return int(steps)
    return logging_interval(newest["history"])


def _manifest(
    run_dir: Path,
    newest: dict[str, Any],
    described: dict[str, Any],
    seg: int,
    dataset: dict[str, Any] | None,
    source: str,
    log: SourceLog | None = None,
    pointers: list[str] | None = None,
    notes: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The manifest of segment `seg`, planned as `newest` (the segment's state; the last segment's is the newest
    state of the run, with trainer_state.json's own fields in ``newest["fields"]``)."""
    model = described["model"]
    granularity = {
        "logging_steps": _logging_steps(newest),
        "save_steps": newest["save_steps"],
        "eval_steps": newest["eval_steps"],
    }
    posthoc = read_json(artifact_root(run_dir) / POSTHOC_FILE, run_dir)
    posthoc = posthoc if isinstance(posthoc, dict) else {}
    return {
        "probe_prompts": posthoc.get("probe_prompts", []),
        "eval_set": posthoc.get("eval_set", []),
        "schema_version": SCHEMA_VERSION,
        "seg": seg,
        "run_id": run_dir.resolve().name,
        "rank": 0,
        "world_size": None,
        "profile": "imported",
        "imported": True,
        "source": source,
        "granularity": granularity,
        "sources": SOURCES
        | {"steps": source, "metrics": source}
        | ({k: DATASET_SOURCE for k in DATASET_KINDS} if dataset else {}),
        "dataset": {k: v for k, v in dataset.items() if k != "failures"} if dataset else None,
        # What the log cannot hold, when it is the only log (a Trainer state beside it holds it).
        "lacks": (DATASET_LACKS if dataset else {}) | (log.lacks if log and source == log.provenance else {}),
        "schedule": {},
        "started": None,
        "versions": {"transformers": (model.get("config") or {}).get("transformers_version")},
        "model": model,
        "task": described["task"],
        "params": described["params"],
        "tied": {},
        "vocab_size": described["vocab_size"],
        "lfs_pointers": pointers or [],
        "final_model": described["final_model"],
        "notes": notes or [],
        "import_notes": [n["text"] for n in notes or []],
        "grad_norm_source": "pre_clip",
        "selection": run_selection(newest["fields"], newest["history"]),
        "tokenizer": described["tokenizer"],
        "config": {
            "max_steps": _planned_steps(newest, log.plan.get("max_steps") if log else None),
            "trainer_state": granularity
            | {k: newest[k] for k in ("train_batch_size", "num_train_epochs")}
            | _stopping(newest["fields"]),
        },
    }


def _ended(state: dict[str, Any]) -> bool:
    """The state says training ended with it: it reached its ``max_steps``, or the Trainer was told to stop."""
    planned = state["max_steps"]
    reached = isinstance(planned, int) and not isinstance(planned, bool) and 0 < planned <= state["global_step"]
    return reached or _stopping(state["fields"])["should_training_stop"] is True


def _stopping(fields: dict[str, Any]) -> dict[str, Any]:
    """What the state says of how training was ending when it was saved: the Trainer's ``should_training_stop``
    (a callback or the plan told it to stop), and the early-stopping callback's patience and count."""

    def part(value: Any, *keys: str) -> Any:
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    stop = part(fields, "stateful_callbacks", "TrainerControl", "args", "should_training_stop")
    early = part(fields, "stateful_callbacks", "EarlyStoppingCallback")
    early = early[-1] if isinstance(early, list) and early else early  # several instances are saved as a list
    patience = part(early, "args", "early_stopping_patience")
    counter = part(early, "attributes", "early_stopping_patience_counter")
    return {
        "should_training_stop": stop if isinstance(stop, bool) else None,
        "early_stopping": {"patience": patience, "counter": counter} if isinstance(early, dict) else None,
    }
