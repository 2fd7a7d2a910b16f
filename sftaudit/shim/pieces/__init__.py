"""Where each parameter's gradient lives on this rank: one small interface, one file per framework.

A `Pieces` object names the model's parameters as a checkpoint of the whole model does (full
shapes) and hands the recorder, for each of them, this rank's *local piece* of the gradient and of
the weight: a plain tensor, never a DTensor, so nothing the recorder computes on it runs a
collective. Its `layout` says how the analyzer combines the ranks' pieces (`sftaudit.store.ingest`):

* ``local``: the rank's own tensor, not synchronised with any other (one process);
* ``replicated``: every rank of the replica holds the whole tensor (DDP after the all-reduce):
  the analyzer takes one rank's value and expects the others to be bit-identical;
* ``sharded``: the rank holds ``local_numel`` of the ``numel`` elements (flattened range
  ``[start, stop)`` when contiguous); the ranks with the same ``replica`` hold disjoint pieces
  whose sums of squares add up to the whole tensor's.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch


class Pieces:
    """The parameters of a model that one rank holds whole (no sharding): the plain case, DDP."""

    framework = "plain"
    # A forward pass needs every rank (each gathers the others' shards): probes then run on all ranks.
    shards_weights = False

    def __init__(self, params: list[dict], tied: dict[str, str], tensors: list[torch.nn.Parameter], layout: list[dict]):
        self.params = [{**p, **kind} for p, kind in zip(params, layout)]  # the manifest's entries
        self.tied = tied
        self._tensors = tensors

    def grads(self) -> list[torch.Tensor | None]:
        """This rank's piece of each parameter's gradient (None: no gradient)."""
        return [p.grad for p in self._tensors]

    def step_grads(self) -> list[torch.Tensor | None]:
        """After the optimizer step (the histograms a suspicious step triggers): this step's pieces
        as `grads` read them. Here they stay in `p.grad` until the loop zeroes them."""
        return self.grads()

    def weights(self) -> list[torch.Tensor]:
        """This rank's piece of each parameter."""
        return [p.detach() for p in self._tensors]

    def generation_context(self) -> AbstractContextManager:
        """Where the model's `generate` may run (FSDP1 must gather its root unit's weights for it)."""
        return nullcontext()


def whole(kind: str, numel: int, replica: int) -> dict[str, Any]:
    return {"kind": kind, "start": 0, "stop": numel, "local_numel": numel, "replica": replica}


def local_pieces(model: torch.nn.Module, rank: int, world_size: int) -> Pieces:
    """The `Pieces` of the framework that wraps `model` (FSDP2, FSDP1, DeepSpeed ZeRO, else plain/DDP)."""
    from . import deepspeed, fsdp1, fsdp2, plain

    for framework in (fsdp2, fsdp1, deepspeed):
        pieces = framework.pieces(model, rank, world_size)
        if pieces is not None:
            return pieces
    return plain.pieces(model, rank, world_size)
