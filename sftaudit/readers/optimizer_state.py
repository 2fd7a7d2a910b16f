"""Adam's moments from a Trainer checkpoint's ``optimizer.pt``, read without torch and without
running the pickle, and mapped to parameter names by the weights saved next to it.

The pickle is walked symbolically (`sftaudit.readers.checkpoints.read_pickle`: imports and calls are
recorded as data, never performed); a file asking for anything outside the weights-only allowlist
is refused. Tensors are rebuilt from the archive's raw storage records with numpy.

``optimizer.pt`` keys its state by parameter index (the order the Trainer handed parameters to the
optimizer: its decay group, then the no-decay group, each in ``named_parameters()`` order); names
are not saved. The analyzer has no model to ask, so the mapping is recovered from the weights: a
state entry belongs to a saved tensor of its shape, and when several tensors share that shape, to
the one whose movement since the previous checkpoint follows the entry's first moment (Adam moves
a weight against its gradient's running mean). An entry whose moments are all zero (it never had a
non-zero gradient) has no direction to follow: it belongs to the tensor of its shape that did not move
at all, when exactly one did; and an entry left alone with a single tensor of its shape, once the others
are named, is that tensor's (by elimination, when every tensor of the shape has an entry). An assignment
that is not clearly better than the alternatives is refused: such entries stay unnamed.
"""

from __future__ import annotations

import math
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoints import (
    SAFETENSORS_DTYPES,
    CheckpointError,
    TensorEntry,
    TensorRef,
    read_pickle,
    read_safetensors_header,
    safetensors_files,
)

OPTIMIZER_FILE = "optimizer.pt"
# Elements compared per candidate pair when names must be told apart by movement (enough for a
# correlation of 0.1 to stand ~6 sigma out of noise; bounded so large tensors stay cheap).
SAMPLE_ELEMENTS = 4096
# A shape-ambiguous assignment is accepted when each entry correlates with its tensor's movement at
# least this much, and this much more than with any other candidate.
MIN_CORRELATION, MIN_MARGIN = 0.2, 0.1


class UnsafeOptimizerState(CheckpointError):
    """The pickle asks for imports outside the weights-only allowlist: it could run code."""


@dataclass
class MomentEntry:
    """One parameter's Adam state."""

    index: int
    group: int
    step: float
    exp_avg: np.ndarray
    exp_avg_sq: np.ndarray


@dataclass
class AdamState:
    groups: list[dict[str, Any]]  # lr, betas, eps, weight_decay, params (indices) per group
    entries: dict[int, MomentEntry]  # parameter index -> its state (no entry: never had a gradient)
    names: dict[int, str] = field(default_factory=dict)  # index -> parameter name, where unambiguous

    @property
    def indices(self) -> list[int]:
        return [i for g in self.groups for i in g["params"]]


def read_adam_state(path: Path) -> AdamState:
    """Adam/AdamW state of a torch.save'd optimizer state dict; CheckpointError on anything else."""
    contents = read_pickle(path)
    unsafe = contents.unsafe_globals(trusted=())
    if unsafe:
        raise UnsafeOptimizerState(
            f"{path.name}: refused without loading it: its pickle imports {', '.join(unsafe)}, "
            f"which a weights-only load would not allow"
        )
    value = contents.value
    if not (
        isinstance(value, dict) and isinstance(value.get("state"), dict) and isinstance(value.get("param_groups"), list)
    ):
        raise CheckpointError(f"{path.name}: not an optimizer state dict (no state / param_groups)")
    groups = []
    for g in value["param_groups"]:
        if not isinstance(g, dict) or not isinstance(g.get("params"), list):
            raise CheckpointError(f"{path.name}: a parameter group without a params list")
        # SGD keeps no state without momentum: an empty state there is no sign of tensors never updated.
        if "betas" not in g:
            settings = ", ".join(sorted(k for k in g if k != "params"))
            raise CheckpointError(f"{path.name}: not an Adam state: its parameter groups have no betas ({settings})")
        betas = g["betas"] if isinstance(g["betas"], (tuple, list)) else (0.9, 0.999)  # tensor betas: the defaults
        groups.append(
            {
                "lr": g.get("lr"),
                "betas": tuple(float(b) for b in betas),
                "eps": float(g.get("eps") or 1e-8),
                "weight_decay": g.get("weight_decay"),
                "params": [int(i) for i in g["params"]],
            }
        )
    group_of = {i: k for k, g in enumerate(groups) for i in g["params"]}
    entries = {}
    with zipfile.ZipFile(path) as archive:
        prefix = next(i.filename for i in archive.infolist() if i.filename.endswith("data.pkl"))[: -len("data.pkl")]
        for index, state in value["state"].items():
            if not isinstance(state, dict) or not isinstance(state.get("exp_avg_sq"), TensorRef):
                raise CheckpointError(f"{path.name}: parameter {index} has no exp_avg_sq: not an Adam state")
            step = state.get("step")
            step = (
                float(_tensor(archive, prefix, step, path).reshape(-1)[0])
                if isinstance(step, TensorRef)
                else float(step or 0)
            )
            entries[int(index)] = MomentEntry(
                int(index),
                group_of.get(int(index), 0),
                step,
                _tensor(archive, prefix, state["exp_avg"], path),
                _tensor(archive, prefix, state["exp_avg_sq"], path),
            )
    return AdamState(groups, entries)


def _tensor(archive: zipfile.ZipFile, prefix: str, ref: TensorRef, path: Path) -> np.ndarray:
    """A contiguous tensor from its storage record, as float32."""
    raw = archive.read(f"{prefix}data/{ref.storage}")
    bits = {"float32": "<f4", "float64": "<f8", "float16": "<f2", "bfloat16": "<u2"}.get(ref.dtype)
    if bits is None:
        raise CheckpointError(f"{path.name}: optimizer tensor of dtype {ref.dtype} is not a float")
    values = np.frombuffer(raw, dtype=bits)
    if values.size != math.prod(ref.shape):  # a view into a larger storage: not how optimizers save moments
        raise CheckpointError(f"{path.name}: optimizer tensor {ref.shape} does not fill its storage")
    if ref.dtype == "bfloat16":
        values = (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32).reshape(ref.shape)


# ---------------------------------------------------------------------------- weights


def checkpoint_weights(folder: Path) -> dict[str, tuple[Path, TensorEntry]]:
    """The tensors saved in a checkpoint folder (model or adapter safetensors, headers validated):
    name -> (file, entry)."""
    files = safetensors_files(folder)
    if not files:
        raise CheckpointError(f"{folder.name}: no safetensors weights")
    return {e.name: (f, e) for f in files for e in read_safetensors_header(f)[0]}


def load_weight(located: tuple[Path, TensorEntry]) -> np.ndarray:
    """One tensor as float32 (memory-mapped, then converted)."""
    path, entry = located
    bits = _FLOAT_BITS.get(entry.raw, SAFETENSORS_DTYPES[entry.raw][0])
    count = math.prod(entry.shape)
    values = np.memmap(path, dtype=bits, mode="r", offset=entry.begin, shape=(count,)) if count else np.zeros(0, bits)
    if entry.raw == "BF16":
        values = (np.asarray(values).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(values, dtype=np.float32).reshape(entry.shape)


# safetensors float codes -> the numpy dtype of their values (bfloat16 is widened from its raw bits)
_FLOAT_BITS = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}


# ---------------------------------------------------------------------------- names


def map_names(
    state: AdamState, weights: dict[str, tuple[Path, TensorEntry]], before: dict[str, tuple[Path, TensorEntry]]
) -> dict[int, str]:
    """Parameter index -> name for the entries whose tensor can be told apart (see the module doc)."""
    by_shape: dict[tuple[int, ...], list[str]] = {}
    for name, (_, e) in weights.items():
        by_shape.setdefault(e.shape, []).append(name)
    names: dict[int, str] = {}
    classes: dict[tuple[int, ...], list[MomentEntry]] = {}
    for entry in state.entries.values():
        classes.setdefault(tuple(entry.exp_avg.shape), []).append(entry)
    rng = np.random.default_rng(0)
    for shape, entries in classes.items():
        candidates = by_shape.get(shape, [])
        if len(candidates) == 1 and len(entries) == 1:
            names[entries[0].index] = candidates[0]
            continue
        candidates = [c for c in candidates if c in before and before[c][1].shape == shape]
        if len(candidates) < len(entries) or not candidates:
            continue  # ambiguous and nothing to tell the tensors apart by: refuse
        complete = len(candidates) == len(entries)  # every tensor of the shape has an entry: elimination holds
        still = [
            c for c in candidates if np.array_equal(load_weight(weights[c]), load_weight(before[c]), equal_nan=True)
        ]
        idle = [e for e in entries if not np.any(e.exp_avg) and not np.any(e.exp_avg_sq)]
        if len(still) == 1 and len(idle) == 1:  # the entry that never updated is the tensor that never moved
            names[idle[0].index] = still[0]
            entries = [e for e in entries if e is not idle[0]]
            candidates = [c for c in candidates if c != still[0]]
        if entries:
            names.update(_by_movement(entries, candidates, weights, before, rng))
        left = [e for e in entries if e.index not in names]
        unnamed = [c for c in candidates if c not in names.values()]
        if complete and len(left) == 1 and len(unnamed) == 1:
            names[left[0].index] = unnamed[0]
    return names


def _by_movement(entries: list[MomentEntry], candidates: list[str], weights, before, rng) -> dict[int, str]:
    """The entries whose first moment follows one candidate's movement clearly better than any other's."""
    shape = tuple(entries[0].exp_avg.shape)
    size = math.prod(shape)
    picks = rng.choice(size, size=min(size, SAMPLE_ELEMENTS), replace=False)
    moves = np.stack(
        [load_weight(weights[c]).reshape(-1)[picks] - load_weight(before[c]).reshape(-1)[picks] for c in candidates]
    )
    firsts = np.stack([-e.exp_avg.reshape(-1)[picks] for e in entries])
    # entries x candidates; a tensor that did not move (or went non-finite) matches nothing by movement
    corr = np.nan_to_num(_correlations(firsts, moves), nan=0.0, posinf=0.0, neginf=0.0)
    from scipy.optimize import linear_sum_assignment

    names = {}
    rows, cols = linear_sum_assignment(-corr)
    for r, c in zip(rows, cols):
        others = np.delete(corr[r], c)
        if corr[r, c] >= MIN_CORRELATION and (others.size == 0 or corr[r, c] - others.max() >= MIN_MARGIN):
            names[entries[r].index] = candidates[c]
    return names


def _correlations(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a - a.mean(axis=1, keepdims=True)
    b = b - b.mean(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (a @ b.T) / np.outer(np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1))
