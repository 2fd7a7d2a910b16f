"""A synthetic run's artifacts in the real format (what the shim writes), with planted anomalies.

`write_synthetic_run(run_dir, steps=100_000, tensors=200)` writes RUN_DIR/sftaudit/ through the
shim's own writer (`sftaudit.shim.writer.JsonlWriter`: the small records as JSONL, the per-tensor
norms into the columnar series, parts rolled in its background thread), the way
`sftaudit.shim.Recorder` does (same record kinds and fields, float32 norms), so ingest and every
check run on it unchanged. `schema_version=1` writes the older layout (norms inside steps.jsonl).
The planted anomalies are returned, so a benchmark can assert that the audit still finds them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from sftaudit.fixtures.recording import bare_manifest

from sftaudit.core.artifacts import SCHEMA_VERSION, rank_dir
from sftaudit.shim.writer import JsonlWriter


def default_anomalies(steps: int, tensors: int) -> dict:
    """Planted at fixed fractions of the run (for 100,000 steps: 60,000 / 20,096 every 128 / 30,000 / 90,000)."""
    return {
        "grad_scale": {"step": steps * 6 // 10, "tensor": min(37, tensors - 2), "factor": 100.0},  # LOOP-05 fail
        "periodic_spike": {"start": steps // 5 + 96, "every": 128, "factor": 30.0},  # LOOP-05 warn, lm_head
        "loss_spike": {"step": steps * 3 // 10, "steps": 2},  # LOOP-10 warn
        "lr_jump": {"step": steps * 9 // 10, "factor": 100.0},  # LOOP-10 warn + fail
        "stale": {
            "step": steps * 7 // 10,
            "tensors": [min(60, tensors - 3) + i for i in range(3)],
            "steps": 3,
        },  # LOOP-15
    }


def write_synthetic_run(
    run_dir: str | Path,
    steps: int = 100_000,
    tensors: int = 200,
    seed: int = 0,
    anomalies: dict | None = None,
    schema_version: int = SCHEMA_VERSION,
    block: int = 10_000,
) -> dict:
    """Write the artifacts; returns the anomalies planted (with defaults filled in). The norms are made
    `block` steps at a time, so a billion of them never sit in memory at once."""
    anomalies = default_anomalies(steps, tensors) if anomalies is None else anomalies
    rng = np.random.default_rng(seed)
    folder = rank_dir(run_dir, 0)
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"model.layers.{i // 8}.block.{i % 8}.weight" for i in range(tensors - 1)] + ["lm_head.weight"]
    params = [
        {"name": n, "shape": [64, 64], "dtype": "torch.bfloat16", "numel": 4096, "requires_grad": True} for n in names
    ]
    now = time.time()
    manifest = bare_manifest(Path(run_dir).name, params, "Synthetic", started=now)

    step = np.arange(1, steps + 1)
    warm = 500
    lr = 3e-4 * np.minimum(1.0, step / warm)
    loss = 2.0 + 1.5 * np.exp(-step / 8000) + 0.05 * rng.standard_normal(steps)
    scale = _scales(seed, tensors)
    if "loss_spike" in anomalies:
        a = anomalies["loss_spike"]
        loss[a["step"] - 1 : a["step"] - 1 + a["steps"]] += 3.0
    if "lr_jump" in anomalies:
        a = anomalies["lr_jump"]
        lr[a["step"] - 1 :] *= a["factor"]
        loss[a["step"] :] += np.linspace(2, 8, steps - a["step"])

    if schema_version == 1:
        folder.mkdir(parents=True, exist_ok=True)
        manifest["schema_version"] = 1
        with open(folder / "manifest.jsonl", "w") as f:
            f.write(json.dumps(manifest) + "\n")
        out = open(folder / "steps.jsonl", "w")
    else:
        writer = JsonlWriter(folder)
        writer.write("manifest", manifest)
        writer.write("events", {"seg": 0, "kind": "start", "time": now})
    previous = None
    for lo in range(0, steps, block):
        hi = min(steps, lo + block)
        norms = _norms(rng, scale, lo, hi, anomalies, previous)
        previous = norms[-1]
        global_norm = np.sqrt((norms.astype(np.float64) ** 2).sum(axis=1))
        for i in range(lo, hi):
            record = {
                "seg": 0,
                "step": int(step[i]),
                "time": now + i,
                "dt": 0.1,
                "loss": float(loss[i]),
                "lr": float(lr[i]),
                "grad_norm": float(global_norm[i - lo]),
                "grad_norms": norms[i - lo],
                "nonfinite_grads": {},
                "micro_batches": 1,
                "tokens": 4096,
            }
            if schema_version == 1:
                out.write(
                    json.dumps(
                        {**record, "grad_norms": norms[i - lo].astype(np.float64).tolist()}, separators=(",", ":")
                    )
                    + "\n"
                )
            else:
                writer.write("steps", record)  # the recorder hands a list; an array of float32 reads the same
    if schema_version == 1:
        out.close()
        with open(folder / "events.jsonl", "w") as f:
            f.write(json.dumps({"seg": 0, "kind": "start", "time": now}) + "\n")
    else:
        writer.close()
    return anomalies


def _scales(seed: int, tensors: int) -> np.ndarray:
    """Each tensor's typical norm: they differ by orders of magnitude, as in a real model (a generator of
    their own, so appended steps continue the same tensors)."""
    return np.exp(np.random.default_rng([seed, 1]).normal(-3, 1.0, tensors))


def _norms(rng, scale: np.ndarray, lo: int, hi: int, anomalies: dict, previous: np.ndarray | None) -> np.ndarray:
    """Steps lo+1..hi of the per-tensor norms (float32, as the shim transfers them), anomalies planted."""
    norms = scale * np.exp(0.15 * rng.standard_normal((hi - lo, scale.size)))
    rows = np.arange(lo + 1, hi + 1)
    if "grad_scale" in anomalies:
        a = anomalies["grad_scale"]
        norms[rows >= a["step"], a["tensor"]] *= a["factor"]
    if "periodic_spike" in anomalies:
        a = anomalies["periodic_spike"]
        norms[(rows >= a["start"]) & ((rows - a["start"]) % a["every"] == 0), -1] *= a["factor"]
    norms = norms.astype(np.float32)
    if "stale" in anomalies:  # a reused buffer: the step before's gradients again, for a few steps
        a = anomalies["stale"]
        for r in np.flatnonzero((rows >= a["step"]) & (rows < a["step"] + a["steps"])):
            norms[r, a["tensors"]] = norms[r - 1, a["tensors"]] if r else previous[a["tensors"]]
    return norms


def append_steps(run_dir: str | Path, after: int, tensors: int, steps: int, seed: int = 0) -> None:
    """`steps` more steps after step `after`, as the same segment still running would write them: the same
    tensors at their level (the planted scale-up kept), the loss and learning rate where the run left them."""
    rng = np.random.default_rng([seed, 2, after])
    writer = JsonlWriter(rank_dir(run_dir, 0))
    anomalies = default_anomalies(after, tensors)
    norms = _norms(rng, _scales(seed, tensors), after, after + steps, {"grad_scale": anomalies["grad_scale"]}, None)
    lr = 3e-4 * anomalies["lr_jump"]["factor"]
    loss = 2.0 + 8.0 + 0.05 * rng.standard_normal(steps)
    for i in range(steps):
        writer.write(
            "steps",
            {
                "seg": 0,
                "step": after + i + 1,
                "time": time.time(),
                "dt": 0.1,
                "loss": float(loss[i]),
                "lr": lr,
                "grad_norm": float(np.sqrt((norms[i].astype(np.float64) ** 2).sum())),
                "grad_norms": norms[i],
                "nonfinite_grads": {},
                "micro_batches": 1,
                "tokens": 4096,
            },
        )
    writer.close()
