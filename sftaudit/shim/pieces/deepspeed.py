"""DeepSpeed ZeRO stages 1-3: the engine's model (or the model inside it, as the Trainer passes it).

* ZeRO-1/2: every rank holds the whole weights; the optimizer owns one contiguous partition of
  each parameter group's flattened gradients, so a parameter's gradient may be split in
  fragments held by different ranks. DeepSpeed links each parameter to the fragment this rank
  owns (`_hp_mapping`, None when it owns none): `lp_fragment_address` is the flattened element
  range, and the fragment's gradient lives in the optimizer from the reduction at a step's last
  backward until the optimizer step frees it. DeepSpeed has no public local accessor for these
  stages (`safe_get_local_grad` is ZeRO-3's); the fragment is read as its `get_full_hp_grad` does.
* ZeRO-3: every parameter is partitioned: rank r of its partition group holds elements
  ``[r*n, (r+1)*n)`` of the flattened parameter (``n = ceil(numel / world)``, the last piece
  zero-padded): `deepspeed.utils.safe_get_local_grad` and `ds_tensor` are those pieces.

Under accelerate (the Trainer) the engine runs its optimizer step inside `backward`, so the
gradients are gone by the time a callback runs: `read_before_step` reads them inside the ZeRO
optimizer's step instead.

After the optimizer step (where a suspicious step's histograms are taken) ZeRO-1/2 have dropped
their fragments (`get_lp_grad_fragment` raises): `step_grads` hands back the fragments `grads`
last read, which stay alive until the next forward. The step itself flattens a copy of them to
clip and update, so they still hold the step's pre-clip gradients, except where DeepSpeed steps on
its own fp32 accumulation buffer (bf16 with fp32 `grad_accum_dtype`) and clips it in place. ZeRO-3
keeps its gradient partitions until the next backward. The recorder checks, on that rare path,
that the pieces still have the norms it recorded before taking histograms of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..describe import describe_params
from . import Pieces


class ZeroPieces(Pieces):
    framework = "deepspeed"

    def __init__(self, params, tied, tensors, layout, stage3: bool):
        super().__init__(params, tied, tensors, layout)
        self._stage3 = stage3
        self._ranges = [(p["start"], p["stop"]) for p in self.params]
        self.shards_weights = stage3  # ZeRO-3 gathers weights in the forward: every rank must take part
        self._read: list[torch.Tensor | None] = []  # ZeRO-1/2: the fragments last read, until the next forward

    def release(self, *_) -> None:
        self._read = []

    def step_grads(self) -> list[torch.Tensor | None]:
        if self._stage3:
            return self.grads()
        grads = self.grads()
        return grads if any(g is not None for g in grads) else self._read or grads

    def grads(self) -> list[torch.Tensor | None]:
        if self._stage3:
            from deepspeed.utils import safe_get_local_grad

            return [
                safe_get_local_grad(p)[: stop - start] if p.requires_grad else None
                for p, (start, stop) in zip(self._tensors, self._ranges)
            ]
        fragments = [_fragment_grad(p, start, stop) for p, (start, stop) in zip(self._tensors, self._ranges)]
        if all(g is None for g in fragments):
            return fragments  # between the optimizer step and the next reduction: no gradient anywhere
        # A parameter with no fragment on this rank gets an empty piece (the other ranks hold it all).
        self._read = [
            g if g is not None or getattr(p, "_hp_mapping", True) is not None else p.detach().reshape(-1)[:0]
            for g, p in zip(fragments, self._tensors)
        ]
        return self._read

    def weights(self) -> list[torch.Tensor]:
        if self._stage3:
            return [p.ds_tensor.detach()[: stop - start] for p, (start, stop) in zip(self._tensors, self._ranges)]
        return [p.detach().reshape(-1)[start:stop] for p, (start, stop) in zip(self._tensors, self._ranges)]


def pieces(model: torch.nn.Module, rank: int, world_size: int) -> Pieces | None:
    tensors = [p for _, p in model.named_parameters()]
    stage3 = any(hasattr(p, "ds_id") for p in tensors)
    if not stage3 and not any(hasattr(p, "_hp_mapping") for p in tensors):
        return None
    params, tied = describe_params(model)
    layout = []
    for i, p in enumerate(tensors):
        if stage3:  # a partitioned parameter's own shape is empty: the whole one is ds_shape
            params[i] = {**params[i], "shape": list(p.ds_shape), "numel": p.ds_numel}
            n = p.ds_tensor.ds_numel
            start = min(dist.get_rank(group=p.ds_process_group) * n, p.ds_numel)
            stop = min(start + n, p.ds_numel)
        else:
            address = getattr(p, "_hp_mapping", None) and p._hp_mapping.lp_fragment_address
            start, stop = (address.start, address.start + address.numel) if address else (0, 0)
        layout.append({"kind": "sharded", "start": start, "stop": stop, "local_numel": stop - start, "replica": 0})
    zero = ZeroPieces(params, tied, tensors, layout, stage3)
    if not stage3:  # the fragments kept for `step_grads` are let go before the next step's forward
        model.register_forward_pre_hook(zero.release)
    return zero


def _fragment_grad(p: torch.nn.Parameter, start: int, stop: int) -> torch.Tensor | None:
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is None:
        return None
    try:
        grad = mapping.get_lp_grad_fragment(p._index_in_param_group).reshape(-1)
    except ValueError:  # "Gradients are only available immediately after backward and before engine step"
        return None
    # The BF16 optimizer keeps the whole parameter's gradient on every rank: this rank's fragment of it.
    return grad[start:stop] if grad.numel() == p.numel() != stop - start else grad


def zero_optimizer(optimizer):
    """The ZeRO optimizer: `optimizer` itself, or the one an accelerate wrapper holds as `.optimizer`
    (None when there is none)."""
    return next(
        (
            o
            for o in (optimizer, getattr(optimizer, "optimizer", None))
            if any(c.__name__ == "ZeROOptimizer" for c in type(o).__mro__)
        ),
        None,
    )


def read_before_step(zero, read: Callable[[], None]) -> None:
    """Call `read` at the start of every step of the ZeRO optimizer `zero`, where the step's
    gradients are complete and not yet clipped (pre-clip norms)."""
    step = zero.step

    def step_after_reading(*args, **kwargs):
        read()
        return step(*args, **kwargs)

    zero.step = step_after_reading
