"""Static descriptions for the manifest: model parameters, dataset fields, training state.

Computed once when a recorder starts, never per step. The tokenizer's description lives in
`sftaudit.tokenizer_info` (torch-free: `preflight` describes tokenizers too).
"""

from __future__ import annotations

from typing import Any

import torch


# Module names that wrappers insert inside the tree (FSDP1 with use_orig_params, activation
# checkpointing, torch.compile of a submodule); a saved state dict does not have them.
WRAPPER_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DistributedDataParallel / DataParallel (also as accelerate prepares it) and
    torch.compile: the module whose state dict the checkpoints hold."""
    while True:
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def canonical_name(name: str) -> str:
    """A parameter's name as a checkpoint writes it: wrapper modules inside the tree dropped."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def describe_params(model: torch.nn.Module) -> tuple[list[dict], dict[str, str]]:
    """Unique parameters in `named_parameters()` order, and tied aliases -> canonical name; names
    as a checkpoint of the unwrapped model writes them (pass the model `unwrap_model` returns)."""
    canonical: dict[int, str] = {}
    params, tied = [], {}
    for raw_name, p in model.named_parameters(remove_duplicate=False):
        name = canonical_name(raw_name)
        if id(p) in canonical:
            tied[name] = canonical[id(p)]
            continue
        canonical[id(p)] = name
        params.append({
            "name": name,
            "shape": list(p.shape),
            "dtype": str(p.dtype).removeprefix("torch."),
            "numel": p.numel(),
            "requires_grad": p.requires_grad,
        })
    return params, tied


def describe_dataset(dataset: Any, limit: int = 1000) -> dict[str, Any]:
    """Field names the rows use, top level and inside chat messages (for the template check)."""
    fields: set[str] = set()
    message_fields: set[str] = set()
    n = len(dataset) if hasattr(dataset, "__len__") else None
    for i, row in enumerate(dataset):
        if i >= limit:
            break
        fields.update(row.keys())
        for value in row.values():
            if isinstance(value, list):
                message_fields.update(k for m in value if isinstance(m, dict) for k in m)
    return {"rows": n, "fields": sorted(fields), "message_fields": sorted(message_fields)}


def jsonable(obj: Any) -> Any:
    """A JSON-safe copy of a config-like object (unknown leaves become their repr)."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    return repr(obj)


def describe_state(obj: Any, depth: int = 0) -> Any:
    """Structure of a saved training state: scalars kept, tensors and blobs summarised.

    LOOP-09 checks that a checkpoint can resume exactly (step, optimizer, scheduler,
    RNG states, data position, collator config) from this outline, not from the values.
    """
    if isinstance(obj, dict):
        if depth >= 4:
            return {"type": "dict", "keys": len(obj)}
        return {str(k): describe_state(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (bool, int, float, str)) or obj is None:
        return obj if not isinstance(obj, str) or len(obj) <= 200 else obj[:200]
    if isinstance(obj, torch.Tensor):
        return {"type": "tensor", "shape": list(obj.shape), "dtype": str(obj.dtype).removeprefix("torch.")}
    if isinstance(obj, (list, tuple)):
        if depth >= 4 or len(obj) > 16:
            return {"type": type(obj).__name__, "len": len(obj)}
        return [describe_state(v, depth + 1) for v in obj]
    return {"type": type(obj).__name__}
