"""One process, or data parallel with whole replicas (DDP, the Trainer under DDP)."""

from __future__ import annotations

import torch

from ..describe import describe_params
from . import Pieces, whole


def pieces(model: torch.nn.Module, rank: int, world_size: int) -> Pieces:
    """With more than one rank every parameter is taken as a replica (DDP all-reduces the
    gradients): ranks whose gradients then differ were not synchronised, which LOOP-17 reports."""
    params, tied = describe_params(model)
    tensors = [p for _, p in model.named_parameters()]  # describe_params' order: tied duplicates dropped
    kind = "replicated" if world_size > 1 else "local"
    return Pieces(params, tied, tensors, [whole(kind, p["numel"], rank) for p in params])
