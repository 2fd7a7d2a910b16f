"""Safe, torch-free checkpoint readers for the analyzer.

* safetensors: the header is validated before anything is read from the data region
  (header length within the file and a sane cap, JSON shape, known dtypes, every
  tensor's byte range inside the file and the size its shape and dtype imply, no
  overlaps); tensors are then streamed in bounded chunks: a checkpoint is never wholly
  in memory. Sharded checkpoints (``*.safetensors.index.json``) are read shard by shard.
* pickles (``.pt``, ``.bin``, ``.pth``, torch's zip format or a bare pickle): never
  unpickled. `read_pickle` walks the opcodes with `pickletools` and rebuilds the plain
  structure (dicts, lists, tuples, scalars) symbolically; every import the pickle asks
  for is collected instead of performed, so a payload that would run code is named,
  not run. Tensors come back as `TensorRef` (dtype, shape, storage record).
* paths: everything is resolved inside the run directory (`inside_run`).

Problems with a file are raised as `CheckpointError` (an `InputError`): one clear line.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import math
import os
import pickletools
import struct
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.safe_io import is_lfs_pointer, open_regular, read_text
from ..errors import InputError, one_line

# The safetensors library's own cap on the header; anything larger is hostile or broken.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# Bytes read at once while streaming tensor data.
CHUNK_BYTES = 8 * 1024 * 1024
# Pickles larger than this are not walked (a state-dict pickle is small: tensors live in records).
MAX_PICKLE_BYTES = 64 * 1024 * 1024

# safetensors dtype -> (numpy dtype used to read raw bits, torch-style name, mask of the
# exponent bits: a float is non-finite exactly when all its exponent bits are set).
SAFETENSORS_DTYPES: dict[str, tuple[str, str, int | None]] = {
    "F64": ("<u8", "float64", 0x7FF0000000000000),
    "F32": ("<u4", "float32", 0x7F800000),
    "F16": ("<u2", "float16", 0x7C00),
    "BF16": ("<u2", "bfloat16", 0x7F80),
    "F8_E5M2": ("u1", "float8_e5m2", 0x7C),
    "F8_E4M3": ("u1", "float8_e4m3fn", 0x7F),  # no infinities; NaN is S.1111.111
    "I64": ("<i8", "int64", None),
    "I32": ("<i4", "int32", None),
    "I16": ("<i2", "int16", None),
    "I8": ("i1", "int8", None),
    "U64": ("<u8", "uint64", None),
    "U32": ("<u4", "uint32", None),
    "U16": ("<u2", "uint16", None),
    "U8": ("u1", "uint8", None),
    "BOOL": ("u1", "bool", None),
}

# torch storage class name -> (torch dtype name, element bytes)
TORCH_STORAGES = {
    "DoubleStorage": ("float64", 8),
    "FloatStorage": ("float32", 4),
    "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2),
    "LongStorage": ("int64", 8),
    "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2),
    "CharStorage": ("int8", 1),
    "ByteStorage": ("uint8", 1),
    "BoolStorage": ("bool", 1),
}

# Imports a weights-only loader allows (torch's own allowlist, in spirit): rebuilding tensors,
# containers, dtypes/devices, numpy arrays for RNG states. Everything else is reported.
SAFE_GLOBALS = frozenset(
    {
        "collections.OrderedDict",
        "builtins.set",
        "builtins.frozenset",
        "builtins.slice",
        "builtins.complex",
        "builtins.bytearray",
        "_codecs.encode",
        "torch.Size",
        "torch.device",
        "torch.serialization._get_layout",
        "torch._utils._rebuild_tensor",
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_tensor_v3",
        "torch._utils._rebuild_parameter",
        "torch._utils._rebuild_parameter_with_state",
        "torch._tensor._rebuild_from_type_v2",
        "torch.storage.UntypedStorage",
        "torch.storage.TypedStorage",
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct",
        "numpy.ndarray",
        "numpy.dtype",
        "numpy.core.multiarray.scalar",
        "numpy._core.multiarray.scalar",
        *(f"torch.{name}" for name in TORCH_STORAGES),
        *(
            f"torch.{name}"
            for name in (
                "float64",
                "float32",
                "float16",
                "bfloat16",
                "int64",
                "int32",
                "int16",
                "int8",
                "uint8",
                "bool",
                "strided",
                "sparse_coo",
            )
        ),
    }
)
# Classes the Hugging Face Trainer itself pickles into training_args.bin (plain config objects).
TRAINER_GLOBALS = (
    "transformers.training_args.*",
    "transformers.training_args_seq2seq.*",
    "transformers.trainer_utils.*",
    "transformers.trainer_pt_utils.AcceleratorConfig",
    "accelerate.state.PartialState",
    "accelerate.utils.dataclasses.*",
    "trl.trainer.*_config.*",
    "numpy.dtypes.*",
    # DeepSpeed's optimizer shards: its loss scaler and bf16 fragment addresses (plain objects).
    "deepspeed.runtime.fp16.loss_scaler.*",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


class CheckpointError(InputError):
    """A checkpoint file that cannot be read safely (truncated, hostile header, bad archive)."""


class MissingWeights(CheckpointError):
    """A checkpoint folder with no weight files at all (deleted, rotated, or left out of a copy): nothing
    corrupt to report, but nothing to verify or roll back to either."""


class LfsPointer(CheckpointError):
    """A Git LFS pointer file where the weights should be (a clone made without git-lfs)."""


def lfs_pointer(path: Path) -> None:
    """Raise `LfsPointer` before anything parses a pointer file as weights or a pickle."""
    if is_lfs_pointer(path):
        raise LfsPointer(f"{path.name} is a Git LFS pointer, not the weights: run `git lfs pull`")


def _open_checkpoint_file(path: Path):
    """A checkpoint file opened for reading: a regular file that stays in its own folder (a symlink to
    `/etc/passwd` or into another tree is refused, as shards outside the folder are)."""
    if path.resolve().parent != path.parent.resolve():
        raise CheckpointError(f"{path.name} is a symlink to {path.resolve()}, outside its checkpoint folder; not read")
    try:
        return open_regular(path)
    except InputError as exc:
        raise CheckpointError(str(exc)) from None


def inside_run(run_dir: str | Path, relative: str) -> Path:
    """`relative` resolved inside the run directory; a path that escapes it is refused."""
    root = Path(run_dir).resolve()
    target = (root / relative).resolve()
    if target != root and root not in target.parents:
        raise CheckpointError(f"path {relative!r} points outside the run directory {root}")
    return target


# ---------------------------------------------------------------------------- safetensors


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # torch-style name: "float32", "bfloat16", ...
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int
    raw: str  # safetensors dtype code


@dataclass(frozen=True)
class TensorScan:
    """What streaming one tensor's bytes found."""

    nonfinite: int
    digest: str  # blake2b of the raw bytes: equal digests = identical values
    all_zero: bool  # every byte zero (a LoRA B matrix never trained is exactly zero)


def read_safetensors_header(path: Path) -> tuple[list[TensorEntry], dict[str, str]]:
    """Validate a safetensors header against the file; the entries in file order, and the metadata."""
    lfs_pointer(path)
    with _open_checkpoint_file(path) as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path.name}: {size} bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES or length > size - 8:
            raise CheckpointError(
                f"{path.name}: header claims {length} bytes but the file holds {size} (truncated or hostile header)"
            )
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path.name}: header is not valid JSON ({exc})") from None
    except RecursionError:
        raise CheckpointError(f"{path.name}: header is nested too deeply to be a safetensors header") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start, data_size = 8 + length, size - 8 - length
    entries = [_entry(path, name, spec, data_start, data_size) for name, spec in header.items()]
    entries.sort(key=lambda e: e.begin)
    for a, b in zip(entries, entries[1:]):
        if b.begin < a.end:
            raise CheckpointError(f"{path.name}: tensors {a.name} and {b.name} overlap in the file")
    return entries, metadata if isinstance(metadata, dict) else {}


def _entry(path: Path, name: str, spec: Any, data_start: int, data_size: int) -> TensorEntry:
    bad = f"{path.name}: tensor {name!r}"
    if not isinstance(spec, dict) or spec.get("dtype") not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{bad} has an unknown dtype or malformed entry")
    shape, offsets = spec.get("shape"), spec.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise CheckpointError(f"{bad} has a malformed shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise CheckpointError(f"{bad} has malformed data_offsets {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise CheckpointError(f"{bad} has malformed data_offsets [{begin}, {end}]")
    if begin > data_size:
        raise CheckpointError(
            f"{bad} has data_offsets [{begin}, {end}] pointing outside the file's {data_size} "
            f"data bytes (hostile or corrupt header)"
        )
    if end > data_size:
        raise CheckpointError(f"{bad} ends at data byte {end} but the file holds {data_size}: the file is truncated")
    item = np.dtype(SAFETENSORS_DTYPES[spec["dtype"]][0]).itemsize
    if end - begin != math.prod(shape) * item:
        raise CheckpointError(
            f"{bad}: shape {shape} needs {math.prod(shape) * item} bytes, data_offsets give {end - begin}"
        )
    return TensorEntry(
        name, SAFETENSORS_DTYPES[spec["dtype"]][1], tuple(shape), data_start + begin, data_start + end, spec["dtype"]
    )


def scan_safetensors(path: Path, entries: list[TensorEntry]) -> Iterator[tuple[TensorEntry, TensorScan]]:
    """Stream every tensor once, in file order: non-finite count and a digest of its bytes."""
    with _open_checkpoint_file(path) as f:
        for e in entries:
            bits, _, mask = SAFETENSORS_DTYPES[e.raw]
            f.seek(e.begin)
            h, nonfinite, left, zero = hashlib.blake2b(digest_size=16), 0, e.end - e.begin, True
            item = np.dtype(bits).itemsize
            while left:
                chunk = f.read(min(left, CHUNK_BYTES - CHUNK_BYTES % item))
                if not chunk:
                    raise CheckpointError(f"{path.name}: file ended inside tensor {e.name}")
                left -= len(chunk)
                h.update(chunk)
                zero = zero and not chunk.strip(b"\0")
                if mask is not None:
                    values = np.frombuffer(chunk, dtype=bits)
                    nonfinite += int(np.count_nonzero((values & values.dtype.type(mask)) == mask))
            yield e, TensorScan(nonfinite, h.hexdigest(), zero)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a checkpoint folder: the shards an index names, or every *.safetensors."""
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if not indexes:
        return sorted(folder.glob("*.safetensors"))
    try:
        weight_map = json.loads(read_text(indexes[0].name, folder, MAX_HEADER_BYTES))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{indexes[0].name}: unreadable shard index ({one_line(exc)})") from None
    except RecursionError:
        raise CheckpointError(f"{indexes[0].name}: unreadable shard index (nested too deeply)") from None
    files = []
    for shard in shards:
        target = (folder / str(shard)).resolve()
        if target.parent != folder.resolve():
            raise CheckpointError(f"{indexes[0].name}: shard {shard!r} is outside the checkpoint folder")
        if not target.is_file():
            raise CheckpointError(f"{indexes[0].name}: shard {shard} is missing")
        files.append(target)
    return files


# ---------------------------------------------------------------------------- pickles


@dataclass(frozen=True)
class Global:
    """An import the pickle asks for (module.name); recorded, never performed."""

    module: str
    name: str

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass
class Call:
    """A call the pickle would make (REDUCE / NEWOBJ / BUILD), kept as data."""

    func: Any
    args: Any
    state: Any = None


@dataclass(frozen=True)
class TensorRef:
    dtype: str
    shape: tuple[int, ...]
    storage: str  # the storage record's key in the archive
    storage_numel: int | None = None  # elements of that storage, as the pickle declares them


@dataclass
class PickleContents:
    value: Any
    globals: set[str] = field(default_factory=set)

    def unsafe_globals(self, trusted: tuple[str, ...] = TRAINER_GLOBALS) -> list[str]:
        """Imports a weights-only load would refuse (and that could run code on a plain load)."""
        return sorted(
            g for g in self.globals if g not in SAFE_GLOBALS and not any(fnmatch.fnmatchcase(g, p) for p in trusted)
        )


_MARK = object()
# Protocol 0-2 pickles name Python 3's modules by their Python 2 names (as pickle itself maps them).
_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}
_LEGACY_TORCH_MAGIC = 0x1950A86A20F9469CFC6C
_SCALARS = (str, int, float, bool, bytes, type(None), Global)


ZIP_LOCAL_HEADER = b"PK\x03\x04"  # how a zip archive, torch.save's default format, starts


def read_pickle(path: Path) -> PickleContents:
    """The structure of a torch.save file or bare pickle, rebuilt without executing anything.

    The walk is bounded (opcodes, seconds, nesting depth, size of the rebuilt structure); a pickle it
    cannot walk whole is `UnreadablePickle`, which names the imports it had seen by then."""
    lfs_pointer(path)
    try:
        with _open_checkpoint_file(path) as f:
            if zipfile.is_zipfile(f):
                with zipfile.ZipFile(f) as z:
                    names = [i for i in z.infolist() if i.filename.endswith("data.pkl")]
                    if len(names) != 1:
                        raise CheckpointError(f"{path.name}: a zip archive without exactly one data.pkl")
                    if names[0].file_size > MAX_PICKLE_BYTES:
                        raise CheckpointError(
                            f"{path.name}: its pickle is {names[0].file_size} bytes, too large to inspect"
                        )
                    data = z.read(names[0])
            else:
                f.seek(0)
                data = f.read(MAX_PICKLE_BYTES + 1)
                if data.startswith(ZIP_LOCAL_HEADER):
                    raise CheckpointError(
                        f"{path.name}: a zip archive (torch.save's format) cut short, with no central directory at its "
                        f"end ({os.fstat(f.fileno()).st_size:,} bytes): an interrupted save or copy; it cannot be loaded"
                    )
                if len(data) > MAX_PICKLE_BYTES:
                    raise CheckpointError(
                        f"{path.name}: over {MAX_PICKLE_BYTES} bytes, too large to inspect as a pickle"
                    )
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as exc:
        raise CheckpointError(f"{path.name}: not a readable file ({type(exc).__name__}: {one_line(exc)})") from None
    seen: set[str] = set()
    try:
        return _walk(data, seen)
    except _Unwalkable as exc:
        why = str(exc)
    except (
        ValueError,
        IndexError,
        KeyError,
        TypeError,
        EOFError,
        AttributeError,
        RecursionError,
        MemoryError,
        OverflowError,
    ) as exc:
        why = f"{type(exc).__name__}: {one_line(exc, 120)}"
    raise UnreadablePickle(path, why, sorted(seen))


class UnreadablePickle(CheckpointError):
    """A pickle the static walk could not finish: refuse to load it (it may hide anything)."""

    def __init__(self, path: Path, why: str, seen: list[str]):
        unsafe = [
            g for g in seen if g not in SAFE_GLOBALS and not any(fnmatch.fnmatchcase(g, p) for p in TRAINER_GLOBALS)
        ]
        also = f"; before that it asked to import {', '.join(unsafe[:3])}" if unsafe else ""
        super().__init__(f"{path.name}: unreadable pickle ({why}): refuse to load{also}")
        self.imports = unsafe


class _Unwalkable(Exception):
    """The walk stopped on a budget or a shape no torch.save writes."""


# Budgets of one walk: far above what any state dict, optimizer or RNG pickle needs (their tensors
# live in storage records, not in the pickle).
MAX_PICKLE_OPS = 5_000_000
MAX_PICKLE_SECONDS = 60.0
MAX_PICKLE_DEPTH = 200
MAX_PICKLE_NODES = 5_000_000  # values of the rebuilt structure, a shared one counted each time it recurs


def _walk(data: bytes, seen: set[str]) -> PickleContents:
    """Symbolic pickle machine: containers and scalars are rebuilt, imports and calls recorded."""
    stream = io.BytesIO(data)
    budget = [MAX_PICKLE_OPS, time.monotonic() + MAX_PICKLE_SECONDS]
    value = _walk_one(stream, seen, budget)
    if type(value) is int and value == _LEGACY_TORCH_MAGIC:
        for _ in range(3):  # a legacy torch.save file: protocol, sys info, then the object
            value = _walk_one(stream, seen, budget)
    _check_shape(value)
    return PickleContents(value, seen)


def _walk_one(stream: io.BytesIO, seen: set[str], budget: list) -> Any:
    stack: list[Any] = []
    marks: list[int] = []  # stack heights at each MARK (as pickle's own metastack: no search)
    memo: dict[int, Any] = {}

    def pop_mark() -> list[Any]:
        if not marks:
            raise _Unwalkable("an opcode needs a MARK that was never pushed")
        i = marks.pop()
        items = stack[i:]
        del stack[i:]
        return items

    for op, arg, _ in pickletools.genops(stream):
        budget[0] -= 1
        if budget[0] < 0:
            raise _Unwalkable(f"more than {MAX_PICKLE_OPS} opcodes")
        if not budget[0] % 65536 and time.monotonic() > budget[1]:
            raise _Unwalkable(f"walk took over {MAX_PICKLE_SECONDS:.0f} s")
        name = op.name
        if name in ("PROTO", "FRAME"):
            continue
        if name == "STOP":
            return stack.pop() if stack else None
        if name == "MARK":
            marks.append(len(stack))
        elif name in ("EMPTY_DICT",):
            stack.append({})
        elif name in ("EMPTY_LIST",):
            stack.append([])
        elif name in ("EMPTY_SET",):
            stack.append(set())
        elif name == "EMPTY_TUPLE":
            stack.append(())
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            if len(stack) < n:
                raise _Unwalkable(f"{name} on a stack of {len(stack)}")
            items = tuple(stack[-n:])
            del stack[-n:]
            stack.append(items)
        elif name == "TUPLE":
            stack.append(tuple(pop_mark()))
        elif name == "LIST":
            stack.append(pop_mark())
        elif name == "DICT":
            items = pop_mark()
            stack.append(_as_dict(items))
        elif name == "FROZENSET":
            stack.append(frozenset(_key(v) for v in pop_mark()))
        elif name == "APPEND":
            v = stack.pop()
            if isinstance(stack[-1], list):
                stack[-1].append(v)
        elif name == "APPENDS":
            items = pop_mark()
            if isinstance(stack[-1], list):
                stack[-1].extend(items)
        elif name == "ADDITEMS":
            items = pop_mark()
            if isinstance(stack[-1], set):
                stack[-1].update(_key(v) for v in items)
        elif name == "SETITEM":
            v, k = stack.pop(), stack.pop()
            if isinstance(stack[-1], dict):
                stack[-1][_key(k)] = v
        elif name == "SETITEMS":
            items = pop_mark()
            if isinstance(stack[-1], dict):
                stack[-1].update(_as_dict(items))
        elif name in ("GLOBAL", "INST"):
            module, _, attr = arg.partition(" ")
            g = Global(_PY2_MODULES.get(module, module), attr)
            seen.add(str(g))
            if name == "INST":
                stack.append(Call(g, tuple(pop_mark())))
            else:
                stack.append(g)
        elif name == "STACK_GLOBAL":
            attr, module = stack.pop(), stack.pop()
            if type(module) is not str or type(attr) is not str:
                raise _Unwalkable("STACK_GLOBAL with a name that is not a string")
            g = Global(module, attr)
            seen.add(str(g))
            stack.append(g)
        elif name in ("REDUCE", "NEWOBJ"):
            args, func = stack.pop(), stack.pop()
            stack.append(_call(func, args))
        elif name == "NEWOBJ_EX":
            kwargs, args, cls = stack.pop(), stack.pop(), stack.pop()
            stack.append(Call(cls, args, kwargs))
        elif name == "OBJ":
            items = pop_mark()
            stack.append(Call(items[0], tuple(items[1:])) if items else None)
        elif name == "BUILD":
            state = stack.pop()
            target = stack[-1]
            if isinstance(target, Call):
                target.state = state
            elif isinstance(target, dict) and isinstance(state, dict):
                target.update(state)
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = stack[-1]
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo[int(arg)])
        elif name in ("PERSID", "BINPID", "BINPERSID"):
            stack.append(("persistent", stack.pop() if name == "BINPERSID" else arg))
        elif name == "POP":
            if stack:
                stack.pop()
            else:
                pop_mark()  # POP of a bare MARK drops the mark, as pickle does
        elif name == "POP_MARK":
            pop_mark()
        elif name == "DUP":
            stack.append(stack[-1])
        elif name in ("NONE",):
            stack.append(None)
        elif name in ("NEWTRUE", "NEWFALSE"):
            stack.append(name == "NEWTRUE")
        elif name in ("EXT1", "EXT2", "EXT4"):
            g = Global("copyreg", f"extension_{arg}")
            seen.add(str(g))
            stack.append(g)
        elif name in ("NEXT_BUFFER", "READONLY_BUFFER"):
            if name == "NEXT_BUFFER":
                stack.append(b"")
        else:  # every remaining opcode pushes its decoded argument (ints, floats, strings, bytes)
            stack.append(arg)
    raise _Unwalkable("the pickle ends without STOP")


def _key(v: Any) -> Any:
    """A dict key or set member as the walk keeps it: scalars (and flat tuples of them) as they are,
    anything else as a placeholder string. Never `repr` or `hash` of an untrusted structure: a deeply
    nested one raises RecursionError, a shared one takes exponential time."""
    if type(v) in _SCALARS or (type(v) is tuple and len(v) <= 16 and all(type(x) in _SCALARS for x in v)):
        return v
    return f"<unhashable {type(v).__name__} key>"


def _as_dict(items: list[Any]) -> dict:
    return {_key(k): v for k, v in zip(items[::2], items[1::2])}


def _children(node: Any) -> Any:
    if type(node) is dict:
        return node.values()
    if type(node) in (list, tuple, set, frozenset):
        return node
    if type(node) is Call:
        return (node.func, node.args, node.state)
    return None


def _check_shape(value: Any) -> None:
    """Refuse a rebuilt structure that a plain recursive reader of it could not handle: nested deeper
    than MAX_PICKLE_DEPTH, larger than MAX_PICKLE_NODES once shared parts are counted each time
    (a list of itself twice, 60 times over), or holding itself. Iterative, each value visited once."""
    done: dict[int, tuple[int, int]] = {}  # id -> (depth, expanded size)
    open_: set[int] = set()
    todo: list[tuple[Any, bool]] = [(value, False)]
    while todo:
        node, finished = todo.pop()
        children = _children(node)
        if children is None:
            continue
        i = id(node)
        if finished:
            open_.discard(i)
            inner = [done.get(id(c), (0, 1)) for c in children]
            depth, size = 1 + max((d for d, _ in inner), default=0), 1 + sum(s for _, s in inner)
            if depth > MAX_PICKLE_DEPTH:
                raise _Unwalkable(f"nested deeper than {MAX_PICKLE_DEPTH} levels")
            if size > MAX_PICKLE_NODES:
                raise _Unwalkable(f"shared references expand to over {MAX_PICKLE_NODES} values")
            done[i] = (depth, size)
        elif i not in done:
            if i in open_:
                raise _Unwalkable("a structure that contains itself")
            open_.add(i)
            todo.append((node, True))
            todo.extend((c, False) for c in children)


def _call(func: Any, args: Any) -> Any:
    """Calls whose result is plain data are rebuilt; every other call stays a `Call`."""
    name = str(func) if isinstance(func, Global) else ""
    args = args if isinstance(args, tuple) else ()
    if name == "collections.OrderedDict":
        return (
            _as_dict([x for pair in (args[0] if args and isinstance(args[0], list) else []) for x in pair])
            if args
            else {}
        )
    if name.startswith("torch._utils._rebuild_tensor") and len(args) >= 3:
        storage = args[0]
        pid = storage[1] if isinstance(storage, tuple) and len(storage) == 2 else ()
        dtype = "unknown"
        if isinstance(pid, tuple) and len(pid) >= 3:
            kind = pid[1]
            dtype = TORCH_STORAGES.get(kind.name, ("unknown",))[0] if isinstance(kind, Global) else "unknown"
            key = pid[2] if type(pid[2]) in (str, int) else ""
            numel = pid[4] if len(pid) >= 5 and type(pid[4]) is int else None
            return TensorRef(dtype, tuple(args[2]) if isinstance(args[2], (tuple, list)) else (), str(key), numel)
        return TensorRef(dtype, tuple(args[2]) if isinstance(args[2], (tuple, list)) else (), "")
    if name.startswith("torch._utils._rebuild_parameter") and args:
        return args[0]
    if name == "torch.Size" and args:
        return tuple(args[0]) if isinstance(args[0], (list, tuple)) else ()
    return Call(func, args)


# ---------------------------------------------------------------------------- torch.save state dicts

_BITS_BY_TORCH_DTYPE = {name: (bits, mask) for bits, name, mask in SAFETENSORS_DTYPES.values()}


def state_dict_tensors(contents: PickleContents) -> dict[str, TensorRef]:
    """The tensors of a pickled state dict (top level, or under "model"/"state_dict"/"module")."""
    value = contents.value
    if isinstance(value, dict):
        for key in ("state_dict", "model", "module"):
            if isinstance(value.get(key), dict):
                value = value[key]
                break
    if not isinstance(value, dict):
        return {}
    return {str(k): v for k, v in value.items() if isinstance(v, TensorRef)}


def scan_torch_zip(path: Path, tensors: dict[str, TensorRef]) -> dict[str, TensorScan]:
    """Stream the storage records of a torch zip archive: non-finite count and digest per storage,
    given to every tensor that views it."""
    scans: dict[str, TensorScan] = {}
    try:
        with _open_checkpoint_file(path) as f, zipfile.ZipFile(f) as z:
            pkl = next(i.filename for i in z.infolist() if i.filename.endswith("data.pkl"))
            prefix = pkl[: -len("data.pkl")]
            by_storage: dict[str, TensorScan] = {}
            for name, ref in tensors.items():
                if ref.storage not in by_storage:
                    bits, mask = _BITS_BY_TORCH_DTYPE.get(ref.dtype, ("u1", None))
                    record = z.getinfo(f"{prefix}data/{ref.storage}")
                    _check_storage_size(path, ref, record)
                    by_storage[ref.storage] = _scan_stream(z.open(record), bits, mask)
                scans[name] = by_storage[ref.storage]
    except (OSError, KeyError, StopIteration, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"{path.name}: tensor data unreadable ({type(exc).__name__}: {exc})") from None
    return scans


def _check_storage_size(path: Path, ref: TensorRef, record: zipfile.ZipInfo) -> None:
    """Before a storage record is decompressed: its size must be what the pickle declares for it
    (elements x element size), and a view must fit in it. A record claiming more (a zip64 entry that
    inflates to 64 GB behind a small tensor) is hostile."""
    item = np.dtype(_BITS_BY_TORCH_DTYPE.get(ref.dtype, ("u1", None))[0]).itemsize
    declared = ref.storage_numel * item if ref.storage_numel is not None else None
    if declared is None or record.file_size != declared:
        raise CheckpointError(
            f"{path.name}: storage record {ref.storage} holds {record.file_size} bytes but the "
            f"pickle declares {declared if declared is not None else 'no size'} for it "
            f"({ref.dtype} x {ref.storage_numel}); refusing to decompress it (hostile or corrupt)"
        )
    if record.compress_type != zipfile.ZIP_STORED and record.file_size > 1100 * max(record.compress_size, 1):
        raise CheckpointError(
            f"{path.name}: storage record {ref.storage} claims to inflate {record.compress_size} "
            f"bytes to {record.file_size}, more than deflate can; refusing to decompress it"
        )


def _scan_stream(stream: Any, bits: str, mask: int | None) -> TensorScan:
    item = np.dtype(bits).itemsize
    h, nonfinite, tail, zero = hashlib.blake2b(digest_size=16), 0, b"", True
    with stream:
        while chunk := stream.read(CHUNK_BYTES):
            h.update(chunk)
            zero = zero and not chunk.strip(b"\0")
            if mask is not None:
                data = tail + chunk
                cut = len(data) - len(data) % item
                values = np.frombuffer(data[:cut], dtype=bits)
                nonfinite += int(np.count_nonzero((values & values.dtype.type(mask)) == mask))
                tail = data[cut:]
    return TensorScan(nonfinite, h.hexdigest(), zero)
