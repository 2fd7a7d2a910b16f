"""FSDP1 (`FullyShardedDataParallel`), `use_orig_params` True or False.

Each FSDP unit flattens its parameters into one `FlatParameter` and keeps a 1-D shard of it per
rank (zero-padded at the tail; with `NO_SHARD` the whole flat parameter). `_shard_param_infos`
says, per original parameter, which slice of the local shard holds which of its flattened
elements; with `use_orig_params=True` the original parameters are 1-D views of those slices.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp._flat_param import HandleShardingStrategy
from torch.distributed.fsdp._traversal_utils import _get_fsdp_handles

from ..describe import canonical_name
from . import Pieces, whole

HYBRID = (HandleShardingStrategy.HYBRID_SHARD, HandleShardingStrategy._HYBRID_SHARD_ZERO2)


class FlatParamPieces(Pieces):
    framework = "fsdp1"

    def __init__(self, model, params, slots, layout):
        super().__init__(params, {}, [], layout)
        self._model = model
        self._slots = slots  # per parameter: (its FSDP handle, its index in the flat parameter)
        self.shards_weights = any(handle._sharding_strategy != HandleShardingStrategy.NO_SHARD for handle, _ in slots)

    def grads(self) -> list[torch.Tensor | None]:
        return [_piece(handle, i, grad=True) for handle, i in self._slots]

    def weights(self) -> list[torch.Tensor]:
        return [_piece(handle, i, grad=False) for handle, i in self._slots]

    def generation_context(self):
        """`generate` runs the wrapped module's forward, not the root unit's (which gathers the root's
        own weights, the embeddings and the head): they are gathered around it. Nested units gather
        their own in their forward."""
        return FullyShardedDataParallel.summon_full_params(self._model, writeback=False, recurse=False)


def pieces(model: torch.nn.Module, rank: int, world_size: int) -> Pieces | None:
    if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        return None
    prefixes = {id(m): canonical_name(name) for name, m in model.named_modules()}
    params, slots, layout = [], [], []
    for handle in _get_fsdp_handles(model):
        flat = handle.flat_param
        owner = prefixes.get(id(handle._fully_sharded_module), "")
        sharded = handle._sharding_strategy != HandleShardingStrategy.NO_SHARD
        replica = rank // handle.process_group.size() if handle._sharding_strategy in HYBRID else 0
        for i, (fqn, shape, numel) in enumerate(zip(flat._fqns, flat._shapes, flat._numels)):
            params.append(
                {
                    "name": canonical_name(f"{owner}.{fqn}" if owner else fqn),
                    "shape": list(shape),
                    "dtype": str(flat.dtype).removeprefix("torch."),
                    "numel": numel,
                    "requires_grad": flat.requires_grad,
                }
            )
            slots.append((handle, i))
            info = flat._shard_param_infos[i]
            if not sharded:
                layout.append(whole("replicated", numel, rank))
            elif info.in_shard:
                layout.append(
                    {
                        "kind": "sharded",
                        "start": info.intra_param_start_idx,
                        "stop": info.intra_param_end_idx + 1,
                        "local_numel": info.numel_in_shard,
                        "replica": replica,
                    }
                )
            else:
                layout.append({"kind": "sharded", "start": 0, "stop": 0, "local_numel": 0, "replica": replica})
    return FlatParamPieces(model, params, slots, layout)


def _piece(handle, i: int, grad: bool) -> torch.Tensor | None:
    """The parameter's slice of this rank's shard; empty (not None) when the shard holds none of
    it, so every rank of a step has a piece of every tensor that got a gradient."""
    flat = handle.flat_param
    info = flat._shard_param_infos[i]
    if handle._use_orig_params:
        p = flat._params[i]
        if not grad:
            return p.detach()
        if p.grad is None and not info.in_shard and any(q.grad is not None for q in flat._params):
            return p.detach()  # the empty view this rank holds of a parameter outside its shard
        return p.grad
    source = flat.grad if grad else flat.detach()
    if source is None:
        return None
    if not info.in_shard:
        return source[:0]
    return source[info.offset_in_shard : info.offset_in_shard + info.numel_in_shard]
