"""The planted-fault runs the dynamics checks (LOOP-05..08, LOOP-10) share: each is trained once per
session through the real shim; names and options must stay identical wherever a run is requested."""

from sftaudit.fixtures.faults.dynamics import DEFAULT_SCALED_TENSOR  # noqa: F401 - re-exported for the tests

SCALE_STEP, SPIKE_START, SPIKE_EVERY, LR_JUMP_STEP, LEAK_STEP, COLLAPSE_STEP = 12, 10, 5, 15, 7, 18
MEAN_OF_MEANS_STEP, STALE_STEP, PACKED_STEP = 5, 5, 3
FROZEN_TENSOR = "model.layers.0.mlp.up_proj.weight"
QUIET = dict(checkpoint_every=0, probe_every=0)

RUNS = {
    "grad_scale": dict(steps=20, faults={"grad_scale_from": SCALE_STEP}, grad_hist_every=4, **QUIET),
    "periodic": dict(steps=25, faults={"grad_spike_every": {"step": SPIKE_EVERY, "start": SPIKE_START}}, **QUIET),
    "frozen": dict(steps=20, faults={"frozen_param": FROZEN_TENSOR}, checkpoint_every=10, probe_every=0),
    "lr_jump": dict(steps=22, faults={"lr_jump_at": LR_JUMP_STEP}, **QUIET),
    # From step COLLAPSE_STEP the second layer's attention input vanishes: its gradients collapse by 1e6 and more.
    "collapse": dict(steps=26, faults={"attention_input_vanishes_from": COLLAPSE_STEP}, **QUIET),
    "eval_leak": dict(steps=10, faults={"eval_leak_at": LEAK_STEP}, **QUIET),
    "template": dict(
        steps=20,
        faults={"template_from": 1},
        lr=1e-2,
        checkpoint_every=0,
        probe_every=2,
        generate_every=4,
        max_new_tokens=16,
    ),
    # Gradient accumulation over 4 micro-batches, correctly token-normalised, then the mean of means (Z22).
    "mean_of_means": dict(
        steps=8, grad_accum=4, batch_size=4, faults={"loss_mean_of_means_from": MEAN_OF_MEANS_STEP}, **QUIET
    ),
    # A cosine schedule (warmup 3 of 12 steps) whose scheduler is stepped twice per optimizer step (Z28).
    "scheduler_twice": dict(
        steps=12, lr_schedule="cosine", warmup_steps=3, batch_size=4, faults={"scheduler_steps_per_step": 2}, **QUIET
    ),
    # Z26 (layers without gradients), Z27 (lm_head declared trainable, frozen) and Z29 (stale layer-1 gradients
    # from step STALE_STEP) are independent: one run, three findings.
    "trainable_set": dict(
        steps=8,
        batch_size=4,
        trainable=["lm_head.*"],
        faults={"reentrant_checkpointing": True, "frozen_module": "lm_head.*"},
        **QUIET,
    ),
    "stale_grads": dict(steps=8, batch_size=4, faults={"stale_grads_from": STALE_STEP}, **QUIET),
    # Z16: from step PACKED_STEP three samples per row, positions running on, plain causal attention.
    "packed": dict(steps=4, batch_size=6, faults={"packed_from": PACKED_STEP}, **QUIET),
    # Clean, with every probe the dynamics checks read (the session's clean_run has no generations or evals).
    "clean_probed": dict(
        steps=20, checkpoint_every=0, probe_every=2, generate_every=4, eval_every=4, max_new_tokens=16
    ),
}


def run(runs, name):
    return runs(name, **RUNS[name])


def of(verdict, code, severities=("warn", "fail")):
    """The verdict's findings of one check; a check that crashed (reported, not raised) fails the test."""
    assert verdict["check_errors"] == []
    return [f for f in verdict["findings"] if f["code"] == code and f["severity"] in severities]


def recorded_series_run(run_dir, lr, loss, norms, names, manifest_keys=None):
    """A run's step records (lr, loss, per-tensor gradient norms) written as the shim writes them: for
    statistics regressions on series recorded by longer real runs (the false-alarm sweep) than the suite
    can afford to train. `manifest_keys` are added to its manifest."""
    import json

    import numpy as np
    from sftaudit.fixtures.recording import bare_manifest

    from sftaudit.core.artifacts import rank_dir

    folder = rank_dir(run_dir, 0)
    folder.mkdir(parents=True)
    params = [
        {"name": n, "shape": [64, 64], "dtype": "torch.float32", "numel": 4096, "requires_grad": True} for n in names
    ]
    manifest = {**bare_manifest("series", params, "Recorded"), **(manifest_keys or {})}
    (folder / "manifest.jsonl").write_text(json.dumps(manifest) + "\n")
    norms = np.asarray(norms, dtype=float)
    with open(folder / "steps.jsonl", "w") as f:
        for i in range(len(lr)):
            f.write(
                json.dumps(
                    {
                        "seg": 0,
                        "step": i + 1,
                        "time": float(i),
                        "dt": 0.1,
                        "loss": loss[i],
                        "lr": lr[i],
                        "grad_norm": float(np.sqrt((norms[i] ** 2).sum())),
                        "grad_norms": norms[i].tolist(),
                        "nonfinite_grads": {},
                        "micro_batches": 1,
                        "tokens": 1000,
                    }
                )
                + "\n"
            )
    (folder / "events.jsonl").write_text(json.dumps({"seg": 0, "kind": "start", "time": 0.0}) + "\n")
    return run_dir


def recorded_loop(run_dir, tokenizer_cache, steps=1, rows=4, batch=lambda data: data, loss=None, break_model=None):
    """A few real steps of the tiny model through the Recorder, in a loop written out as users write it:
    `batch(data)` is what the loop hands the model (a collator's output), `loss(model, batch)` a loss computed
    outside the model (default: the model's own), `break_model(model)` damages it before training."""
    import torch
    from sftaudit.fixtures import build_model, build_tokenizer, collate, load_dataset

    from sftaudit.shim import Recorder

    tok = build_tokenizer(tokenizer_cache)
    model = build_model(tok)
    if break_model is not None:
        with torch.no_grad():
            break_model(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = load_dataset()
    with Recorder(run_dir, model, tok, profile="prod") as rec:
        for step in range(1, steps + 1):
            b = batch(collate(tok, data[(step - 1) * rows : step * rows]))
            rec.on_batch(step, b)
            inputs = {k: v for k, v in b.items() if k != "sample_ids"}
            value = loss(model, inputs) if loss is not None else model(**inputs, use_cache=False).loss
            value.backward()
            rec.on_backward(step, value)
            opt.step()
            rec.on_step_end(step, lr=1e-3)
            opt.zero_grad()
    return run_dir
