"""FSDP2 (`fully_shard`) and any model whose parameters are DTensors (tensor parallel, HSDP).

The gradient of a DTensor parameter is a DTensor with the parameter's placements; its local
tensor (`_local_tensor`, what `to_local()` returns, without FSDP2's padding) is the piece. Read
through `_local_tensor` directly: every op on the DTensor itself would dispatch through DTensor
and may run a collective (`norm` does).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..describe import describe_params
from . import Pieces, whole


class DTensorPieces(Pieces):
    framework = "fsdp2"

    def grads(self) -> list[torch.Tensor | None]:
        return [_local(p.grad) for p in self._tensors]

    def weights(self) -> list[torch.Tensor]:
        return [_local(p.detach()) for p in self._tensors]


def pieces(model: torch.nn.Module, rank: int, world_size: int) -> Pieces | None:
    tensors = [p for _, p in model.named_parameters()]
    if not any(isinstance(p, DTensor) for p in tensors):
        return None
    params, tied = describe_params(model)  # a DTensor's shape and numel are the whole tensor's
    layout = [_layout(p, rank) if isinstance(p, DTensor) else whole("local", p.numel(), rank) for p in tensors]
    result = DTensorPieces(params, tied, tensors, layout)
    result.shards_weights = any(entry["kind"] == "sharded" for entry in layout)
    return result


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t._local_tensor if isinstance(t, DTensor) else t


def _layout(p: DTensor, rank: int) -> dict:
    """Sharded on the mesh dims with a Shard placement; the coordinate on the Replicate dims is
    the replica group (HSDP). A Partial placement cannot be combined from norms: `partial`."""
    mesh, placements = p.device_mesh, p.placements
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    if any(isinstance(pl, Partial) for pl in placements):
        return {"kind": "partial", "start": None, "stop": None, "local_numel": p._local_tensor.numel(), "replica": rank}
    replica_dims = [d for d, pl in enumerate(placements) if isinstance(pl, Replicate)]
    replica = 0
    for d in replica_dims:  # the coordinate on the replicate dims, flattened
        replica = replica * mesh.size(d) + coordinate[d]
    if not any(isinstance(pl, Shard) for pl in placements):
        return whole("replicated", p.numel(), rank)
    local_shape, offset = compute_local_shape_and_global_offset(p.shape, mesh, placements)
    local_numel = math.prod(local_shape)
    entry = {"kind": "sharded", "start": None, "stop": None, "local_numel": local_numel, "replica": replica}
    sharded_dims = [d for d, (n, full) in enumerate(zip(local_shape, p.shape)) if n != full]
    if sharded_dims in ([], [0]):  # rows [offset0, offset0 + rows): one contiguous flat range
        row = math.prod(p.shape[1:])
        entry["start"], entry["stop"] = offset[0] * row, offset[0] * row + local_numel
    return entry
