"""The weights' and the optimizer's identity at a segment's start and at each checkpoint: per-tensor
norms, exact bit fingerprints, the optimizer's step count. What a resume must have restored (LOOP-11),
what a parameter left out of the optimizer never changes (LOOP-05), what replicas must agree on (LOOP-17).

Never per step: each is one pass over the weights and one host transfer.
"""

from __future__ import annotations

import torch

from .pieces import Pieces


def param_norms(pieces: Pieces) -> list[float]:
    """Per-tensor weight L2 norms (of this rank's pieces) in float64 (one transfer): equal norms at
    two saves mean the tensor did not move, which is how LOOP-05 finds parameters left out of the
    optimizer. NaN where the rank holds none of a tensor: an empty piece says nothing about it."""
    weights = pieces.weights()
    if not weights:
        return []
    with torch.no_grad():
        norms = torch.stack([w.double().norm() for w in weights]).cpu().tolist()
    return [n if w.numel() else float("nan") for n, w in zip(norms, weights)]


def param_fingerprints(pieces: Pieces) -> list[int]:
    """Per tensor, the integer sum of the bit patterns of this rank's piece (one transfer): exact
    and independent of summation order, so replicas holding the same weights agree bit for bit
    (LOOP-17 compares data-parallel replicas at each checkpoint)."""
    weights = pieces.weights()
    with torch.no_grad():
        return torch.stack([_bit_sum(w) for w in weights]).cpu().tolist() if weights else []


def optimizer_step(opt: torch.optim.Optimizer | None) -> int | None:
    """Adam-style optimizers count their steps in each parameter's state: 0 when the state is
    empty (fresh); None for optimizers that keep no step count, or when none was given."""
    if opt is None:
        return None
    state = next(iter(opt.state.values()), None)
    if state:
        return int(state["step"]) if "step" in state else None
    return 0 if "betas" in getattr(opt, "defaults", {}) else None


def _bit_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of a tensor's elements read as integers of their width (int64 wraps on overflow)."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(bits).sum(dtype=torch.int64)
