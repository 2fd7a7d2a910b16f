"""Checkpoint layouts as trainers and libraries save them, read behind one interface.

`read_weights(path)` finds what wrote a checkpoint (a file or a folder) and returns its
`Weights`: tensor keys, dtypes and shapes, a streamed scan of each tensor's values where the
format allows it, and the pickles that hold its training state. LOOP-09, LOOP-11 and gate
never branch on formats. Nothing is unpickled; each reader says how it stays safe:

* ``safetensors`` (plain loops, ``save_pretrained``; sharded with ``*.safetensors.index.json``):
  header validated against the file, values streamed (`sftaudit.readers.checkpoints`).
* ``torch`` (``torch.save`` of a state dict, also nested ``{"model": ..., "optimizer": ...}``;
  ``pytorch_model.bin``): the pickle walked with `pickletools`, storages streamed from the zip.
* ``peft`` (``adapter_model.safetensors`` / ``.bin`` + ``adapter_config.json``): as above; the
  adapter's config (target modules, rank) kept to judge the keys against.
* ``dcp`` (``torch.distributed.checkpoint``: ``.metadata`` + ``__<r>_0.distcp``): the metadata
  pickle walked statically and every import it asks for checked against an allowlist; keys,
  shapes and dtypes come from it (values are not scanned).
* ``deepspeed`` (``global_stepN/mp_rank_00_model_states.pt`` + ``*_optim_states.pt``, ``latest``):
  the model-states pickle walked statically; ``zero_to_fp32.py`` saved beside it is never run.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.safe_io import read_json
from ..errors import InputError
from .checkpoints import (
    TRAINER_GLOBALS,
    Call,
    CheckpointError,
    Global,
    MissingWeights,
    PickleContents,
    TensorScan,
    read_pickle,
    read_safetensors_header,
    safetensors_files,
    scan_safetensors,
    scan_torch_zip,
    state_dict_tensors,
)

PICKLE_SUFFIXES = (".pt", ".bin", ".pth", ".pkl")
# Weights saved with torch.save(model.state_dict()), read when a folder has no safetensors.
TORCH_WEIGHT_FILES = ("pytorch_model.bin", "model.bin", "model.pt", "model.pth")
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
DCP_METADATA = ".metadata"
# Classes a torch.distributed.checkpoint .metadata pickle is built from (torch's own dataclasses).
DCP_GLOBALS = (
    "torch.distributed.checkpoint.metadata.*",
    "torch.distributed.checkpoint.filesystem._StorageInfo",
    "torch.distributed.checkpoint.planner.*",
    "torch.serialization._get_layout",
    "torch.Size",
    "pathlib.PosixPath",
    "pathlib.WindowsPath",
    "pathlib.PurePosixPath",
    "collections.OrderedDict",
    "torch.float*",
    "torch.bfloat16",
    "torch.int*",
    "torch.uint8",
    "torch.bool",
    "torch.complex*",
)
DEEPSPEED_MODEL_STATES = "mp_rank_00_model_states.pt"


class FileError(CheckpointError):
    """One file of a checkpoint cannot be read safely (truncated, hostile header, bad archive)."""

    def __init__(self, file: Path, message: str):
        super().__init__(message)
        self.file = file


class UnsafePickle(CheckpointError):
    """A pickle that would import and call something a weights-only load refuses."""

    def __init__(self, file: Path, imports: list[str]):
        super().__init__(f"{file.name} would import {imports[0]}")
        self.file, self.imports = file, imports


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]


@dataclass
class Weights:
    """What a checkpoint's weight files hold, whatever wrote them."""

    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    scans: dict[str, TensorScan] = field(default_factory=dict)  # absent keys: values not read
    files: list[Path] = field(default_factory=list)
    state: dict[str, PickleContents] = field(default_factory=dict)  # training-state pickles by file name
    state_keys: set[str] = field(default_factory=set)  # top-level training-state names (DCP)
    adapter: dict[str, Any] | None = None  # PEFT adapter_config.json
    config: dict[str, Any] | None = None  # config.json saved beside the weights


def final_model_files(run_dir: Path) -> list[str]:
    """The weight files at the top of an output folder (an adapter, safetensors, a torch file): the model the
    Trainer's `save_model` wrote there when training ended. Regular files only, links not followed."""
    return sorted(
        e.name
        for e in os.scandir(run_dir)
        if e.is_file(follow_symlinks=False)
        and (e.name in ADAPTER_FILES or e.name in TORCH_WEIGHT_FILES or e.name.endswith(".safetensors"))
    )


def read_weights(path: Path, trusted: tuple[str, ...] = TRAINER_GLOBALS) -> Weights:
    """The checkpoint at `path` (file or folder), read by the reader its layout needs."""
    if path.is_file():
        return _pickle_or_safetensors(path, trusted)
    config = _json(path / "config.json")
    if any((path / name).is_file() for name in ADAPTER_FILES):
        weights = _peft(path, trusted)
    elif (path / DCP_METADATA).is_file():
        weights = _dcp(path)
    else:
        files = safetensors_files(path) or sorted(p for p in path.iterdir() if p.name in TORCH_WEIGHT_FILES)
        deepspeed = _deepspeed_folder(path)
        if deepspeed is not None and not files:  # the engine's own save: weights in its model states
            weights = _deepspeed(deepspeed, trusted)
        elif not files:
            raise MissingWeights(
                f"holds no model weights (model.safetensors, shards with an index, "
                f"{TORCH_WEIGHT_FILES[0]}, an adapter, a DCP or DeepSpeed folder)"
            )
        else:
            weights = Weights()
            for f in files:
                _merge(weights, _pickle_or_safetensors(f, trusted))
            if deepspeed is not None:  # the Trainer under DeepSpeed: weights beside the engine's state
                weights.state.update(_deepspeed(deepspeed, trusted).state)
    weights.config = weights.config or (config if isinstance(config, dict) else None)
    return weights


def _pickle_or_safetensors(f: Path, trusted: tuple[str, ...]) -> Weights:
    try:
        return _read_file(f, trusted)
    except (UnsafePickle, FileError):
        raise
    except (CheckpointError, OSError) as exc:
        raise FileError(f, str(exc)) from None


def _read_file(f: Path, trusted: tuple[str, ...]) -> Weights:
    if f.suffix == ".safetensors":
        header, _ = read_safetensors_header(f)
        out = Weights(files=[f])
        for entry, scan in scan_safetensors(f, header):
            out.tensors[entry.name], out.scans[entry.name] = TensorInfo(entry.dtype, entry.shape), scan
        return out
    contents = _safe_pickle(f, trusted)
    refs = state_dict_tensors(contents)
    out = Weights({n: TensorInfo(r.dtype, r.shape) for n, r in refs.items()}, scan_torch_zip(f, refs), [f])
    out.state[f.name] = contents  # a nested {"model": ..., "optimizer": ...} is its own training state
    return out


def _safe_pickle(f: Path, trusted: tuple[str, ...]) -> PickleContents:
    contents = read_pickle(f)
    unsafe = contents.unsafe_globals(trusted)
    if unsafe:
        raise UnsafePickle(f, unsafe)
    return contents


def _merge(into: Weights, part: Weights) -> None:
    into.tensors.update(part.tensors)
    into.scans.update(part.scans)
    into.files += part.files
    into.state.update(part.state)


# ---------------------------------------------------------------------------- PEFT


def _peft(folder: Path, trusted: tuple[str, ...]) -> Weights:
    config = _json(folder / "adapter_config.json")
    if not isinstance(config, dict):
        raise CheckpointError("adapter_config.json is missing or not a JSON object")
    f = next(folder / n for n in ADAPTER_FILES if (folder / n).is_file())
    weights = _pickle_or_safetensors(f, trusted)
    weights.adapter = config
    weights.state.pop(f.name, None)
    return weights


ADAPTER_KEY = re.compile(
    r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B)"
    r"(?:\.[^.]+)?\.weight$|^(?P<plain_module>.+)\.(?P<plain>lora_[AB])$"
)


def adapter_module(key: str) -> tuple[str, str] | None:
    """(module path, lora_A|lora_B|...) of a LoRA key, with or without the adapter name."""
    m = ADAPTER_KEY.match(key)
    if not m:
        return None
    return (m["module"], m["kind"]) if m["module"] else (m["plain_module"], m["plain"])


def targeted(module: str, target_modules: Any) -> bool:
    """PEFT's rule: a regex string must match the whole module path; a list names module-path suffixes."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, module) is not None or target_modules == "all-linear"
    return any(module == t or module.endswith(f".{t}") for t in (target_modules or []))


# ---------------------------------------------------------------------------- torch.distributed.checkpoint


def _dcp(folder: Path) -> Weights:
    contents = read_pickle(folder / DCP_METADATA)
    unsafe = sorted(g for g in contents.globals if not any(fnmatch.fnmatchcase(g, p) for p in DCP_GLOBALS))
    if unsafe:
        raise UnsafePickle(folder / DCP_METADATA, unsafe)
    meta = _state(contents.value)
    entries = _state(meta.get("state_dict_metadata")) if isinstance(meta, dict) else {}
    if not isinstance(entries, dict) or not entries:
        raise CheckpointError(f"{DCP_METADATA}: no state_dict_metadata (not a torch.distributed.checkpoint)")
    out = Weights(files=sorted(folder.glob("*.distcp")))
    if not out.files:
        raise CheckpointError("a DCP .metadata without any .distcp data file")
    model_prefix = "model." if any(str(k).startswith("model.") for k in entries) else ""
    for fqn, spec in entries.items():
        spec = _state(spec)
        fqn = str(fqn)
        if not (isinstance(spec, dict) and "size" in spec):  # BytesStorageMetadata: pickled extras
            out.state_keys.add(fqn.split(".")[0])
            continue
        if model_prefix and not fqn.startswith(model_prefix):
            out.state_keys.add(fqn.split(".")[0])
            continue
        props = _state(spec.get("properties"))  # TensorProperties pickles as (dtype, layout, ...)
        dtype = props.get("dtype") if isinstance(props, dict) else props[0] if isinstance(props, tuple) else None
        out.tensors[fqn.removeprefix(model_prefix)] = TensorInfo(
            dtype.name if isinstance(dtype, Global) else "unknown", tuple(_state(spec["size"]) or ())
        )
    return out


def _state(value: Any) -> Any:
    """A pickled object's state as plain data (dataclasses pickle as NEWOBJ + BUILD of their dict)."""
    while isinstance(value, Call):
        state = value.state
        if isinstance(state, tuple) and len(state) == 2 and all(isinstance(x, dict) or x is None for x in state):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict state, slots state)
        if state is None and isinstance(value.args, tuple) and value.args:
            return value.args[0] if str(value.func) == "torch.Size" else value.args
        value = state
    return value


# ---------------------------------------------------------------------------- DeepSpeed


def _deepspeed_folder(path: Path) -> Path | None:
    """The global_stepN folder of a DeepSpeed save: the folder itself, or the one `latest` names."""
    if (path / DEEPSPEED_MODEL_STATES).is_file():
        return path
    latest = path / "latest"
    if latest.is_file():
        tag = latest.read_text(encoding="utf-8", errors="replace").strip()
        target = (path / tag).resolve()
        if target.parent == path.resolve() and (target / DEEPSPEED_MODEL_STATES).is_file():
            return target
    steps = sorted(path.glob(f"global_step*/{DEEPSPEED_MODEL_STATES}"))
    return steps[-1].parent if steps else None


def _deepspeed(folder: Path, trusted: tuple[str, ...]) -> Weights:
    """Model states (weights under "module", scheduler, global_steps, client state at the top) and
    the optimizer shards; a ZeRO-3 save keeps no weights there (use its 16-bit export)."""
    out = _pickle_or_safetensors(folder / DEEPSPEED_MODEL_STATES, trusted)
    for f in sorted(folder.glob("*optim_states.pt")):
        try:
            out.state[f.name] = _safe_pickle(f, trusted)
        except (CheckpointError, OSError) as exc:
            raise exc if isinstance(exc, UnsafePickle) else FileError(f, str(exc)) from None
        out.files.append(f)
    return out


def _json(path: Path) -> Any:
    try:
        return read_json(path) if path.is_file() else None
    except (OSError, InputError):
        return None
