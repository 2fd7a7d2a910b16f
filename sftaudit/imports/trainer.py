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
import re
import shutil
from pathlib import Path
from typing import Any

from ..core.artifacts import DATABASE_FILE, SCHEMA_VERSION, TOKENIZER_DIR, artifact_root, rank_dir
from ..errors import InputError
from .dataset import (
    DATASET_KINDS,
    DATASET_SOURCE,
    DATASET_UNJUDGED,
    dataset_description,
    dataset_records,
    failure_events,
)
from .llamafactory import LOG_SOURCE, NO_GRAD_NORM, TRAINER_LOG, log_segments, planned_steps, read_lines
from .logs import LFS_HINT, is_lfs_pointer, log_histories, logging_interval, normalised
from .selection import run_selection
from .tensorboard import EVENTS_SOURCE, event_files, event_segments

TRAINER_STATE = "trainer_state.json"
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
# Keys of the end-of-training log entry: a summary of the run, not a training step.
SUMMARY_KEYS = ("train_runtime", "train_loss")
LOGS_SOURCE = "imported logs: trainer_state.json"
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
        elif not p.is_symlink() and (step := _global_step(p / TRAINER_STATE)) is not None:
            named[p] = step
    taken = set(numbered.values())
    return sorted([(s, p) for p, s in numbered.items()] + [(s, p) for p, s in named.items() if s not in taken])


def _global_step(path: Path) -> int | None:
    try:
        step = json.loads(path.read_text(encoding="utf-8")).get("global_step") if path.is_file() else None
    except (OSError, ValueError, AttributeError, UnicodeDecodeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def lfs_pointers(run_dir: Path, checkpoints: list[tuple[int, Path]]) -> list[str]:
    """The log files (trainer states, trainer_log.jsonl, event files) that are Git LFS pointers, relative to
    the run folder. Checkpoint weights and training state are LOOP-09's to name."""
    candidates = [
        run_dir / TRAINER_STATE,
        run_dir / TRAINER_LOG,
        *(p / TRAINER_STATE for _, p in checkpoints),
        *event_files(run_dir),
    ]
    return sorted(str(p.relative_to(run_dir)) for p in candidates if is_lfs_pointer(p))


def is_trainer_output(run_dir: str | Path) -> bool:
    run_dir = Path(run_dir)
    return (
        (run_dir / TRAINER_STATE).is_file()
        or (run_dir / TRAINER_LOG).is_file()
        or bool(checkpoint_dirs(run_dir))
        or bool(event_files(run_dir))
    )


def imported_manifest(run_dir: str | Path) -> dict[str, Any] | None:
    """The manifest an earlier import wrote (None: no artifacts, or the shim's)."""
    path = rank_dir(run_dir, 0) / "manifest.jsonl"
    if not path.is_file():  # a FIFO or device must not block here: ingest refuses it with its reason
        return None
    try:
        with open(path, "rb") as f:
            first = json.loads(f.readline(2**24))  # bounded: a manifest record is a few hundred KB
    except (OSError, ValueError, RecursionError):
        return None
    return first if isinstance(first, dict) and first.get("imported") else None


def ensure_artifacts(run_dir: str | Path, data: str | Path | None = None) -> bool:
    """Before an audit: import a Trainer output that has no artifacts, or refresh an earlier import
    (the run may have gone on since), with its training data when given. Returns whether it imported.
    Shim artifacts are left alone (and `data` refused: the shim recorded the batches)."""
    run_dir = Path(run_dir)
    has_artifacts = any(artifact_root(run_dir).glob("rank-*"))
    if (not has_artifacts and is_trainer_output(run_dir)) or (has_artifacts and imported_manifest(run_dir)):
        import_run(run_dir, data)
        return True
    if data is not None:
        raise InputError(
            f"{run_dir}: --data is for runs trained without the shim (the shim recorded this run's batches)"
        )
    return False


def import_run(run_dir: str | Path, data: str | Path | None = None, progress: bool = False) -> dict[str, Any]:
    """Write ``RUN_DIR/sftaudit/rank-0/*.jsonl`` from a Trainer output (and from its training data, when
    given: `dataset.dataset_records`); returns what was imported."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: no such run directory")
    if data is not None and not Path(data).exists():  # before anything is read or written
        raise InputError(f"{data}: no such dataset file or folder")
    if not is_trainer_output(run_dir):
        raise InputError(
            f"{run_dir}: not a Trainer output (no {TRAINER_STATE}, {TRAINER_LOG}, "
            "TensorBoard event file or checkpoint-*/ folder)"
        )
    if any(artifact_root(run_dir).glob("rank-*")) and not imported_manifest(run_dir):
        raise InputError(f"{run_dir}: already has sftaudit artifacts recorded by the shim; audit them directly")
    every_checkpoint = checkpoint_dirs(run_dir)
    # A checkpoint folder symlinked out of the run (to `/`) is never read: LOOP-09 reports it.
    checkpoints = [(s, p) for s, p in every_checkpoint if p.resolve().is_relative_to(run_dir.resolve())]
    states = _states(run_dir, checkpoints)
    # A training log kept per (re)start: LLaMA-Factory's, else TensorBoard's (when the extra is installed).
    lines, args = read_lines(run_dir), {}
    segments, log_source = log_segments(run_dir, lines), LOG_SOURCE
    if not segments:
        segments, texts = event_segments(run_dir)
        args = texts.get("args", {}) | {"model_config": texts.get("model_config")}
        log_source = EVENTS_SOURCE
    source = LOGS_SOURCE if states else log_source
    if not states:  # a per-restart log alone: each restart's history stands in for a trainer_state.json
        states = [_log_state(run_dir, i, history, args) for i, history in enumerate(log_histories(segments))]
    pointers = lfs_pointers(run_dir, checkpoints)
    if not states:
        hint = " (TensorBoard event files need: pip install 'sftaudit[tensorboard]')" if event_files(run_dir) else ""
        if pointers:
            hint = f" ({len(pointers)} log file(s), {pointers[0]} first, are a {LFS_HINT})"
        elif lines:
            hint = (
                f" ({TRAINER_LOG} holds {len(lines)} progress line(s) without a loss or an eval number: "
                "a prediction or evaluation run, nothing was trained)"
            )
        raise InputError(
            f"{run_dir}: no readable {TRAINER_STATE} or {TRAINER_LOG} (in the run folder or any checkpoint)" + hint
        )
    # The state written last is the branch the run ended on (after a resume from an earlier checkpoint,
    # a checkpoint of the abandoned branch may hold a higher step).
    newest = max(states, key=lambda s: (s["mtime"], s["global_step"], s["top_level"]))
    timeline, abandoned, resumed_at = _timeline(newest, states)
    if source == LOGS_SOURCE and segments:
        timeline, abandoned, resumed_at = _with_log(timeline, abandoned, resumed_at, segments)
    if resumed_at is not None and not any(e["step"] >= resumed_at for e in timeline):
        abandoned, resumed_at = [], None  # the abandoned steps lie beyond the run's end: nothing replaced them

    records: dict[str, list[dict[str, Any]]] = {
        k: [] for k in ("manifest", "steps", "metrics", "checkpoints", "events")
    }
    for seg, entries in (
        (0, abandoned),
        (0, [e for e in timeline if resumed_at is None or e["step"] < resumed_at]),
        (1, [e for e in timeline if resumed_at is not None and e["step"] >= resumed_at]),
    ):
        for e in entries:
            records["metrics"] += [
                {"seg": seg, "step": e["step"], "name": k, "value": float(v)}
                for k, v in e.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
            ]
            if "loss" in e and not any(k in e for k in SUMMARY_KEYS):
                records["steps"].append(
                    {
                        "seg": seg,
                        "step": e["step"],
                        "loss": e["loss"],
                        "lr": e.get("learning_rate"),
                        "grad_norm": e.get("grad_norm"),
                    }
                )
    abandoned_states = {s["folder"] for s in states if s["abandoned"]}
    tokenizer, fingerprints, refused = _tokenizer(run_dir, checkpoints)
    for step, folder in every_checkpoint:
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
        seg = 0 if folder in abandoned_states or resumed_at is None or step < resumed_at else 1
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
                "training_state": _resume_outline(folder),
                "tokenizer_fingerprint": fingerprints.get(folder),
                "time": folder.stat().st_mtime,
            }
        )
    if data is not None:
        records.update(dataset_records(run_dir, data, newest["train_batch_size"], progress))
    dataset = dataset_description(run_dir)  # this --data, or an earlier one's (its records are kept)
    records["events"] += failure_events(dataset or {})
    resumed_from = _resumed_from(checkpoints, timeline, resumed_at)
    for seg in [0] + ([1] if resumed_at is not None else []):
        manifest = _manifest(
            run_dir, newest, checkpoints, tokenizer, seg, dataset, source, planned_steps(lines), pointers
        )
        if seg and resumed_from is not None:
            manifest["config"]["resume_from"] = resumed_from
        if refused:  # the tokenizer the run saved is not used: the checks that need it say why
            manifest["unjudged"].update({code: refused for code in ("LOOP-01", "LOOP-02")})
        records["manifest"].append(manifest)
        records["events"].append({"seg": seg, "kind": "start", "time": newest["mtime"]})
    _write(run_dir, records)
    return {
        "steps": len(records["steps"]),
        "metrics": len(records["metrics"]),
        "checkpoints": len(checkpoints),
        "logging_steps": _logging_steps(newest),
        "resumed_at": resumed_at,
        "abandoned_steps": sorted({e["step"] for e in abandoned if "loss" in e}),
        "tokenizer": tokenizer is not None,
        "dataset_rows": (dataset or {}).get("rows"),
        "notes": _notes(pointers),
    }


# ---------------------------------------------------------------------------- trainer states


def _states(run_dir: Path, checkpoints: list[tuple[int, Path]]) -> list[dict[str, Any]]:
    """Every readable trainer_state.json (a truncated one is an interrupted save: LOOP-09's business)."""
    out = []
    for folder, top_level in [(p, False) for _, p in checkpoints] + [(run_dir, True)]:
        path = folder / TRAINER_STATE
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
            history = [
                normalised(e) for e in state["log_history"] if isinstance(e, dict) and isinstance(e.get("step"), int)
            ]
        except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
            continue
        out.append(
            {
                "folder": folder,
                "top_level": top_level,
                "history": history,
                "mtime": path.stat().st_mtime,
                "global_step": int(state.get("global_step") or 0),
                "max_steps": state.get("max_steps"),
                "logging_steps": state.get("logging_steps"),
                "save_steps": state.get("save_steps"),
                "eval_steps": state.get("eval_steps"),
                "train_batch_size": state.get("train_batch_size"),
                "num_train_epochs": state.get("num_train_epochs"),
                "abandoned": False,
            }
        )
    return out


def _log_state(run_dir: Path, index: int, history: list[dict[str, Any]], args: dict[str, Any]) -> dict[str, Any]:
    """A restart's history from a training log, shaped as `_states` shapes a trainer_state.json; the run's
    arguments and model config where the log kept them (TensorBoard's ``args`` and ``model_config`` texts)."""
    return {
        "folder": run_dir / f"log-{index}",
        "top_level": True,
        "history": history,
        "mtime": index,
        "global_step": max(e["step"] for e in history),
        "max_steps": args.get("max_steps"),
        "logging_steps": logging_interval(history) or args.get("logging_steps"),
        "save_steps": args.get("save_steps"),
        "eval_steps": args.get("eval_steps"),
        "train_batch_size": args.get("per_device_train_batch_size"),
        "num_train_epochs": args.get("num_train_epochs"),
        "abandoned": False,
        "model_config": args.get("model_config"),
    }


def _with_log(timeline, abandoned, resumed_at, segments):
    """What a training log kept per (re)start adds to the trainer states: the lines a restart abandoned
    that no saved state kept (logged between the checkpoint resumed from and the crash), and the lines logged after
    the last saved state (a crash before the next save)."""
    known = {e["step"] for e in abandoned}
    for seg, after in zip(segments, segments[1:]):
        restart = after[0]["step"]
        lost = [e for e in seg if e["step"] >= restart and e["step"] not in known]
        if lost:
            abandoned = sorted(abandoned + lost, key=lambda e: e["step"])
            resumed_at = restart if resumed_at is None else min(resumed_at, restart)
    last = max((e["step"] for e in timeline), default=0)
    return timeline + [e for e in segments[-1] if e["step"] > last], abandoned, resumed_at


def _resumed_from(
    checkpoints: list[tuple[int, Path]], timeline: list[dict[str, Any]], resumed_at: int | None
) -> str | None:
    """The checkpoint on disk the resume can have started from: the newest saved after the last training log
    before the resume and before the first one after it (the logs show the restart only to their resolution)."""
    if resumed_at is None:
        return None
    before = max((e["step"] for e in timeline if "loss" in e and e["step"] < resumed_at), default=0)
    within = [p for step, p in checkpoints if before <= step < resumed_at]
    return within[-1].name if within else None


def _key(entry: dict[str, Any]) -> tuple[int, tuple[str, ...]]:
    return entry["step"], tuple(sorted(entry))


def _timeline(newest: dict[str, Any], states: list[dict[str, Any]]):
    """The newest state's log history, the entries older states hold that it lost (a resume
    restarts the log from the checkpoint it resumed from), and the first step after the resume.

    An older state whose entries disagree with the newest's from some step on saw another branch
    of the run: its entries from that step are the abandoned branch, and the run resumed there."""
    current = {_key(e): e for e in newest["history"]}
    abandoned: dict[tuple, dict[str, Any]] = {}
    resumed_at = None
    for s in states:
        if s is newest:
            continue
        differing = [e["step"] for e in s["history"] if not _same(current.get(_key(e)), e)]
        if not differing:
            continue
        s["abandoned"] = True
        diverged = min(differing)
        resumed_at = diverged if resumed_at is None else min(resumed_at, diverged)
        abandoned.update({_key(e): e for e in s["history"] if e["step"] >= diverged})
    return newest["history"], sorted(abandoned.values(), key=lambda e: e["step"]), resumed_at


def _same(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    # json.dumps compares NaN == NaN (a NaN loss logged by both states is the same entry)
    return a is not None and json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


# ---------------------------------------------------------------------------- checkpoints, tokenizer, manifest


def _resume_outline(folder: Path) -> dict[str, Any]:
    """What the folder holds for an exact resume (the same outline the shim's Trainer callback records)."""
    names = {p.name for p in folder.iterdir()}
    state = None
    if TRAINER_STATE in names:
        try:
            state = json.loads((folder / TRAINER_STATE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            state = None
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
        if not (folder / "tokenizer_config.json").is_file():
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
    configs = []
    for folder in [p for _, p in reversed(checkpoints)] + [run_dir]:
        try:
            configs.append(json.loads((folder / "config.json").read_text(encoding="utf-8")))
        except (OSError, ValueError, UnicodeDecodeError):
            continue
    config = next((c for c in configs + [logged] if isinstance(c, dict) and c), None)
    if config is None:
        return {}
    architectures = config.get("architectures")
    return {
        "class": architectures[0] if isinstance(architectures, list) and architectures else None,
        "config": config,
        "tie_word_embeddings": config.get("tie_word_embeddings"),
    }


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


def _planned_steps(newest: dict[str, Any], total_steps: int | None) -> int | None:
    """The run's planned length: the state's ``max_steps``, else LLaMA-Factory's ``total_steps``, else
    ``num_train_epochs`` x the steps per epoch of its last training log (its step over its epoch)."""
    if isinstance(newest["max_steps"], int) and newest["max_steps"] > 0:
        return newest["max_steps"]
    if total_steps:
        return total_steps
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


def _notes(pointers: list[str]) -> list[str]:
    """What the import could not read, said once."""
    if not pointers:
        return []
    return [f"{len(pointers)} log file(s) ({pointers[0]}{', ...' if len(pointers) > 1 else ''}) are a {LFS_HINT}"]


def _logging_steps(newest: dict[str, Any]) -> int | None:
    """``logging_steps`` as the state says it (older states have none), else as the log shows it."""
    steps = newest["logging_steps"]
    if isinstance(steps, (int, float)) and not isinstance(steps, bool) and steps >= 1 and steps == int(steps):
        return int(steps)
    return logging_interval(newest["history"])


def _manifest(
    run_dir: Path,
    newest: dict[str, Any],
    checkpoints,
    tokenizer,
    seg: int,
    dataset: dict[str, Any] | None,
    source: str,
    total_steps: int | None = None,
    pointers: list[str] | None = None,
) -> dict[str, Any]:
    model = _model(run_dir, checkpoints, newest.get("model_config"))
    folders = [p for _, p in reversed(checkpoints)] + [run_dir]
    params = _params(folders[:-1])
    vocab_size = _vocab_size(model, params or _params([run_dir]), tokenizer, folders)
    granularity = {
        "logging_steps": _logging_steps(newest),
        "save_steps": newest["save_steps"],
        "eval_steps": newest["eval_steps"],
    }
    try:
        posthoc = json.loads((artifact_root(run_dir) / POSTHOC_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        posthoc = {}
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
        "unjudged": (DATASET_UNJUDGED if dataset else {}) | (NO_GRAD_NORM if source == LOG_SOURCE else {}),
        "schedule": {},
        "started": None,
        "versions": {"transformers": (model.get("config") or {}).get("transformers_version")},
        "model": model,
        "params": params,
        "tied": {},
        "vocab_size": vocab_size,
        "lfs_pointers": pointers or [],
        "import_notes": _notes(pointers or []),
        "grad_norm_source": "pre_clip",
        "selection": run_selection(newest["folder"] / TRAINER_STATE, newest["history"]),
        "tokenizer": tokenizer or {},
        "config": {
            "max_steps": _planned_steps(newest, total_steps),
            "trainer_state": granularity | {k: newest[k] for k in ("train_batch_size", "num_train_epochs")},
        },
    }


def _write(run_dir: Path, records: dict[str, list[dict[str, Any]]]) -> None:
    """Replace an earlier import's files (and its database: ingest is incremental by file offset);
    the records `sftaudit probe` added are kept."""
    folder = rank_dir(run_dir, 0)
    for kind in records:
        (folder / f"{kind}.jsonl").unlink(missing_ok=True)  # probe records (`sftaudit probe`) stay
    (artifact_root(run_dir) / DATABASE_FILE).unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    for kind, rows in records.items():
        (folder / f"{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
