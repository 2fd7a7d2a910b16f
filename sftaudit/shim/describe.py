"""The run description: the manifest's model, parameters, library versions, chat-marker rows, dataset
fields, LR schedule, and the outline of a saved training state.

Computed once when a recorder starts (the state outline: at each checkpoint), never per step. The tokenizer's description lives in
`sftaudit.core.tokenizer` (torch-free: `preflight` describes tokenizers too).
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from typing import Any

import torch

# Module names that wrappers insert inside the tree (FSDP1 with use_orig_params, activation
# checkpointing, torch.compile of a submodule); a saved state dict does not have them.
WRAPPER_PARTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DistributedDataParallel / DataParallel (also as accelerate prepares it), a
    DeepSpeed engine and torch.compile: the module whose state dict the checkpoints hold."""
    while True:
        if (
            isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel))
            or type(model).__name__ == "DeepSpeedEngine"
        ):
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
        params.append(
            {
                "name": name,
                "shape": list(p.shape),
                "dtype": str(p.dtype).removeprefix("torch."),
                "numel": p.numel(),
                "requires_grad": p.requires_grad,
            }
        )
    return params, tied


def describe_model(model: torch.nn.Module) -> dict:
    config = getattr(model, "config", None)
    return {
        "class": type(model).__name__,
        "config": jsonable(config.to_dict()) if hasattr(config, "to_dict") else None,
        "tie_word_embeddings": getattr(config, "tie_word_embeddings", None),
        # What generate() stops on (LOOP-02 compares it with the template's end-of-turn marker).
        "generation_eos": jsonable(getattr(getattr(model, "generation_config", None), "eos_token_id", None)),
        "attn_implementation": getattr(config, "_attn_implementation", None),
        "dropout": {
            k: v
            for k, v in (config.to_dict().items() if hasattr(config, "to_dict") else [])
            if "dropout" in k and isinstance(v, (int, float))
        },
    }


def marker_rows(model: torch.nn.Module, tokenizer: Any) -> dict | None:
    """Embedding and output row norms of the added tokens the chat template writes, with the median
    row norm, at start: a base model's untrained chat markers are near zero. One host sync."""
    template = getattr(tokenizer, "chat_template", None)
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids = sorted(int(i) for i, t in added.items() if isinstance(template, str) and t.content and t.content in template)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not ids or embed is None or max(ids) >= embed.weight.shape[0]:
        return None
    with torch.no_grad():
        rows = [embed.weight] + ([output.weight] if output is not None and output.weight.shape[0] > max(ids) else [])
        norms = [w.float().norm(dim=1) for w in rows]
        stats = torch.stack([torch.cat([n[ids], n.median().reshape(1)]) for n in norms]).cpu().tolist()
    return {
        "ids": ids,
        "tokens": [added[i].content for i in ids],
        "embed_norm": stats[0][:-1],
        "embed_median": stats[0][-1],
        "embed_trainable": bool(embed.weight.requires_grad),
        "output_norm": stats[1][:-1] if len(stats) > 1 else None,
        "output_median": stats[1][-1] if len(stats) > 1 else None,
        "output_trainable": bool(output.weight.requires_grad) if len(stats) > 1 else None,
    }


# What the optimizer sits inside: accelerate's AcceleratedOptimizer (the Trainer's, also around FSDP's),
# DeepSpeed's ZeRO and bf16 optimizers, ... each keep the optimizer that updates the weights as `.optimizer`.
MAX_WRAPPERS = 8
MAX_GROUPS = 256
# Group hyperparameters kept in the manifest (tensors read once, at start); the parameters are counted.
GROUP_KEYS = ("lr", "initial_lr", "betas", "eps", "weight_decay", "momentum", "nesterov", "amsgrad", "foreach", "fused")


def optimizer_chain(optimizer: Any) -> list[Any]:
    """The optimizer and each optimizer inside it, outermost first; the last updates the weights."""
    chain = [optimizer]
    while len(chain) <= MAX_WRAPPERS:
        inner = getattr(chain[-1], "optimizer", None)
        if inner is None or any(inner is o for o in chain) or not hasattr(inner, "param_groups"):
            break
        chain.append(inner)
    return chain


def describe_optimizer(optimizer: Any) -> dict[str, Any]:
    """The optimizer that updates the weights, read through its wrappers: its class (what LOOP-22 judges the
    learning rate against), the wrappers' classes, and per parameter group its hyperparameters and size.
    `initial_lr` is the group's configured learning rate when a scheduler is attached (a warmup may have set
    `lr` to 0 already)."""
    chain = optimizer_chain(optimizer)
    inner = chain[-1]
    groups = []
    for group in getattr(inner, "param_groups", [])[:MAX_GROUPS]:
        params = [p for p in group.get("params", []) if isinstance(p, torch.Tensor)]
        entry = {k: _plain_number(group[k]) for k in GROUP_KEYS if k in group}
        groups.append({**entry, "params": len(params), "numel": sum(p.numel() for p in params)})
    return {
        "class": type(inner).__name__,
        "module": type(inner).__module__,
        "wrappers": [type(o).__name__ for o in chain[:-1]],
        "groups": groups,
    }


def describe_loss_scaler(optimizer: Any, grad_scaler: Any = None) -> dict[str, Any]:
    """Whether anything in this run skips an optimizer step whose gradients are non-finite, and what: only
    then can a step with non-finite gradients and finite ones after it be a benign skip. A GradScaler given
    to the recorder, or held by accelerate's optimizer wrapper (`scaler`: the Trainer's fp16), skips when it
    is enabled; DeepSpeed's ZeRO and bf16 optimizers skip every step they find an overflow in (`overflow`)."""
    scaler, source = find_loss_scaler(optimizer, grad_scaler)
    if scaler is None:
        return {"present": False, "skips_nonfinite_steps": False}
    enabled = source == "deepspeed" or not hasattr(scaler, "is_enabled") or bool(scaler.is_enabled())
    return {
        "present": True,
        "class": type(scaler).__name__,
        "source": source,
        "enabled": enabled,
        "skips_nonfinite_steps": enabled,
    }


def find_loss_scaler(optimizer: Any, grad_scaler: Any = None) -> tuple[Any, str | None]:
    """(the run's loss scaler, where it was found: "recorder", "accelerate" or "deepspeed"), or (None, None)."""
    if grad_scaler is not None:
        return grad_scaler, "recorder"
    for o in optimizer_chain(optimizer) if optimizer is not None else []:
        if getattr(o, "scaler", None) is not None:
            return o.scaler, "accelerate"
        if hasattr(o, "overflow") and hasattr(o, "loss_scaler"):
            return o.loss_scaler, "deepspeed"
    return None, None


def _plain_number(value: Any) -> Any:
    """A group hyperparameter as JSON: tensors (a capturable optimizer's lr) as numbers, tuples as lists."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, (list, tuple)):
        return [_plain_number(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


def library_versions() -> dict[str, str]:
    """Versions of the training libraries installed, from their package metadata (importing them here
    would cost seconds), so two runs in one environment record the same, whatever each imported."""
    found = {}
    for name in ("transformers", "trl", "accelerate", "peft", "deepspeed"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


# The oldest releases sftaudit supports (pyproject's floors): older ones lack what the shim hooks into
# (transformers 4.44 calls no on_pre_optimizer_step: no learning rate, no post-clip norms) or what the
# analyzer renders chat templates with.
OLDEST_SUPPORTED = {"transformers": "4.45", "trl": "0.11"}


def unsupported_versions(versions: dict[str, str]) -> dict[str, dict[str, str]]:
    """The installed libraries older than sftaudit supports: name -> {installed, oldest_supported}."""
    return {
        name: {"installed": versions[name], "oldest_supported": oldest}
        for name, oldest in OLDEST_SUPPORTED.items()
        if name in versions and _release(versions[name]) < _release(oldest)
    }


def _release(version: str) -> tuple[int, ...]:
    """A version's leading numbers (4.45.2 -> (4, 45, 2); 0.11.0.dev0 -> (0, 11, 0))."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


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


def describe_scheduler(scheduler: Any, steps: int | None = None) -> dict[str, Any]:
    """An LR scheduler's class, numeric state and the schedule it will follow: `lr` is the
    learning rate of the first parameter group after 0, 1, 2, ... scheduler steps, from
    `trace_start` on (for a LambdaLR: base_lr x lr_lambda(s) from s = 0, its lambdas evaluated
    directly; otherwise a copy stepped on a one-tensor optimizer). The trace covers `steps`
    scheduler steps (the run's max_steps when known, else the scheduler's own horizon)."""
    state = {
        k: v
        for k, v in scheduler.state_dict().items()
        if isinstance(v, (int, float, str, bool, list, type(None))) and k != "_last_lr"
    }
    out: dict[str, Any] = {"class": type(scheduler).__name__, "state": jsonable(state), "trace_start": 0, "lr": None}
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas and isinstance(lambdas[0], functools.partial):
        out["lr_lambda"] = {
            "function": getattr(lambdas[0].func, "__name__", None),
            "arguments": jsonable(lambdas[0].keywords),
        }
    horizon = steps or _horizon(scheduler)
    if not horizon:
        return out
    horizon = min(int(horizon), MAX_SCHEDULE_TRACE)
    if lambdas and type(scheduler).__name__ == "LambdaLR":
        base = scheduler.base_lrs[0]
        out["lr"] = [float(f"{base * lambdas[0](s):.7g}") for s in range(horizon + 1)]
    elif not hasattr(scheduler, "_schedulers"):  # chained schedulers hold the real optimizer: not copied
        out["trace_start"] = int(getattr(scheduler, "last_epoch", 0))
        out["lr"] = _simulate(scheduler, horizon)
    return out


MAX_SCHEDULE_TRACE = 50_000


def _horizon(scheduler: Any) -> int | None:
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas and isinstance(lambdas[0], functools.partial) and "num_training_steps" in lambdas[0].keywords:
        return lambdas[0].keywords["num_training_steps"]
    for name in ("total_steps", "T_max", "total_iters"):
        if isinstance(getattr(scheduler, name, None), int):
            return getattr(scheduler, name)
    return None


def _simulate(scheduler: Any, steps: int) -> list[float]:
    """Step a copy of the scheduler on a one-tensor optimizer with the same groups and LRs."""
    import copy
    import warnings

    groups = [
        {"params": [torch.zeros(1, requires_grad=True)], **{k: v for k, v in g.items() if k != "params"}}
        for g in scheduler.optimizer.param_groups
    ]
    clone = copy.copy(scheduler)
    clone.__dict__ = copy.deepcopy({k: v for k, v in scheduler.__dict__.items() if k != "optimizer"})
    clone.optimizer = torch.optim.SGD(groups, lr=groups[0]["lr"])
    lrs = [clone.optimizer.param_groups[0]["lr"]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            clone.optimizer.step()
            clone.step()
            lrs.append(clone.optimizer.param_groups[0]["lr"])
    return [float(f"{v:.7g}") for v in lrs]
