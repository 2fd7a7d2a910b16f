"""Shared real runs: each is trained once per pytest invocation through the real shim (the first xdist
worker to ask builds it, the others wait and copy it: tests/shared.py), into a copy of its own per worker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from sftaudit.fixtures.train import train_plain

from .shared import invocation_dir, shared_dir

if os.environ.get("PYTEST_XDIST_WORKER"):  # the suite runs on two workers (pyproject): one thread each
    torch.set_num_threads(1)

# CI gates a landing on the same examples every time (derived from each test's code); a run elsewhere draws
# new ones, and a failing draw prints the example to keep (`@example`).
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

NAN_STEP = 13

# Fixtures that train a model (or launch a training): a test using one, itself or through another fixture,
# is marked slow, so that `pytest -m "not slow"` runs what needs no training run.
TRAINING_FIXTURES = {
    # this file's
    "runs",
    "nan_probed_run",
    "checkpoint_fault_run",
    "hf_checkpoint_fault_run",
    "trl_packing_run",
    "resumed_run",
    "distributed_runs",
    # module fixtures of the test files
    "pad_eos_default_profile",
    "killed_at_3_of_80",
    "rotated_run",
    "trainer_resumed_run",
    "order_runs",
    "trainer_run",
    "head_runs",
    "trainer_nan_run",
    "trainer_grads_x1000",
    "window_run",
    "clean_trl_run",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if TRAINING_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def database_cache(tmp_path_factory) -> Path:
    """The run databases of this invocation (sftaudit keeps them in its cache, outside the runs): under its own
    base temp, not the user's cache; the CLI subprocesses the tests start inherit it."""
    from sftaudit.store.rundb import CACHE_ENV

    folder = invocation_dir(tmp_path_factory) / "sftaudit-cache"
    os.environ[CACHE_ENV] = str(folder)
    return folder


@pytest.fixture(scope="session")
def tokenizer_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tokenizer")


@pytest.fixture(scope="session")
def runs(tmp_path_factory, tokenizer_cache):
    """Train a named run once per invocation: runs(name, **train_plain options) -> this worker's run_dir.
    A name stands for one set of options wherever it is requested."""
    made: dict[str, Path] = {}

    def make(name: str, **options) -> Path:
        if name not in made:
            made[name] = (
                shared_dir(
                    tmp_path_factory,
                    name,
                    lambda folder: train_plain(folder / name, tokenizer_cache=tokenizer_cache, **options),
                )
                / name
            )
        return made[name]

    return make


@pytest.fixture(scope="session")
def clean_run(runs) -> Path:
    return runs("clean", steps=30)


@pytest.fixture(scope="session")
def nan_run(runs) -> Path:
    return runs("nan", steps=20, faults={"nan_at": NAN_STEP})


@pytest.fixture(scope="session")
def nan_probed_run(runs) -> Path:
    """Probes every 2 steps, generations and evaluations every 4, a NaN at step 7 (the probe at 8 is not
    finite): checks left with too little, or partly unusable, evidence (LOOP-06/07/08)."""
    return runs(
        "nan_probed",
        steps=8,
        checkpoint_every=4,
        probe_every=2,
        generate_every=4,
        eval_every=4,
        faults={"nan_at": 7},
    )


# Checkpoint faults (issue 5), each on its own checkpoint of one plain run (checkpoint every 2 steps);
# checkpoint-2 is sound but saved with torch.save (pytorch_model.bin).
CHECKPOINT_FAULTS = {
    "ckpt_torch_weights": 2,
    "ckpt_missing_key": 4,
    "ckpt_stray_dtype": 6,
    "ckpt_nan_tensor": 8,
    "ckpt_truncated": 10,
    "ckpt_header_outside": 12,
    "ckpt_pickle_payload": 14,
    "ckpt_no_rng": 16,
    "param_left_out": 17,
}
HF_CHECKPOINT_FAULTS = {"ckpt_nan_tensor": 10, "ckpt_no_rng": 15}


@pytest.fixture(scope="session")
def checkpoint_fault_run(tmp_path_factory, tokenizer_cache) -> Path:
    # Trained by each worker where it lies, not shared: checkpoint-14's pickle payload names the absolute
    # path of the marker it would write (inside the run), and a copy elsewhere cannot rewrite it.
    return train_plain(
        tmp_path_factory.mktemp("checkpoint-faults") / "checkpoint-faults",
        steps=20,
        checkpoint_every=2,
        faults=CHECKPOINT_FAULTS,
        tokenizer_cache=tokenizer_cache,
    )


@pytest.fixture(scope="session")
def hf_checkpoint_fault_run(tmp_path_factory, tokenizer_cache) -> Path:
    from sftaudit.fixtures.train import train_hf

    return (
        shared_dir(
            tmp_path_factory,
            "hf-ckpt",
            lambda folder: train_hf(
                folder / "hf-checkpoint-faults",
                steps=20,
                save_steps=5,
                faults=HF_CHECKPOINT_FAULTS,
                tokenizer_cache=tokenizer_cache,
            ),
        )
        / "hf-checkpoint-faults"
    )


# One plain run resumed four times from its checkpoints (every 5 steps): cleanly at 10 (the first
# segment ran on to step 12, as a run killed after its last checkpoint does), then each resume with
# one fault: the LR warmup restarted (15), the weights not restored (20), the data position lost (25).
RESUMES = [(10, None), (15, "resume_restarts_warmup"), (20, "resume_fresh_weights"), (25, "resume_rereads_data")]


@pytest.fixture(scope="session")
def trl_packing_run(tmp_path_factory, tokenizer_cache) -> Path:
    """TRL's SFTTrainer with packing=True on a `messages` dataset (its defaults): BFD-packed rows flattened
    padding-free, per-sample position_ids, no attention mask, use_cache=False; every token trained."""
    from sftaudit.fixtures.train import train_hf

    return (
        shared_dir(
            tmp_path_factory,
            "trl-packing",
            lambda folder: train_hf(
                folder / "run",
                steps=3,
                save_steps=100,
                trl=True,
                packing=True,
                batch_size=4,
                max_length=96,
                tokenizer_cache=tokenizer_cache,
            ),
        )
        / "run"
    )


@pytest.fixture(scope="session")
def resumed_run(tmp_path_factory, tokenizer_cache) -> Path:
    def build(folder: Path) -> None:
        run = folder / "resumed"
        train_plain(run, steps=12, checkpoint_every=5, tokenizer_cache=tokenizer_cache)
        for step, fault in RESUMES:
            train_plain(
                run,
                steps=step + 5,
                checkpoint_every=5,
                tokenizer_cache=tokenizer_cache,
                resume_from=run / f"checkpoint-{step}",
                faults={fault: True} if fault else None,
            )

    return shared_dir(tmp_path_factory, "resumed", build) / "resumed"


# Distributed runs (issue 14): every 2-rank scenario of sftaudit.fixtures.distributed in one torchrun
# launch (a launch costs ~10 s of imports on 2 cores), each into DISTRIBUTED_ROOT/<name>.
DISTRIBUTED_SCENARIOS = (
    "dcp",
    "ddp",
    "fsdp1",
    "fsdp1_flat",
    "fsdp2",
    "trainer_ddp",
    "fsdp2_spike",
    "ddp_nan_loss",
    "ddp_same_samples",
    "fsdp2_stop",
    "ddp_perturb",
    "fsdp1_local_clip",
    "zero1",
    "zero2",
    "zero3",
    "zero2_loss_x10",
    "zero2_spike",
    "zero3_spike",
    "zero2_bf16_spike",
)


@pytest.fixture(scope="session")
def distributed_runs(tmp_path_factory) -> Path:
    import subprocess
    import sys

    def launch(folder: Path) -> None:
        # The bound only stops a wedged launch from hanging the suite: a loaded machine takes many minutes.
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                "-m",
                "sftaudit.fixtures.distributed",
                "runs",
                str(folder),
                *DISTRIBUTED_SCENARIOS,
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=1800,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )

    return shared_dir(tmp_path_factory, "distributed", launch)
