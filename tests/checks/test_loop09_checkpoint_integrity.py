"""LOOP-09: each planted checkpoint fault fails exactly its checkpoint, in a plain loop and a Trainer run;
the clean run's checkpoints pass."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from sftaudit.fixtures.faults.checkpoints import DROPPED_KEY, LEFT_OUT_TENSOR, NAN_TENSOR, PAYLOAD_FILE, STRAY_TENSOR

from sftaudit.checks import AuditContext
from sftaudit.checks.loop09_checkpoint_integrity import CheckpointIntegrity
from sftaudit.store.ingest import ingest
from sftaudit.store.rundb import connect, load_manifest
from sftaudit.verdict.audit import audit

from ..conftest import HF_CHECKPOINT_FAULTS
from ..shared import cached_audit


def loop09(verdict):
    return {f["checkpoint"]: f for f in verdict["findings"] if f["code"] == "LOOP-09" and f["checkpoint"]}


def resume_risk(verdict, category="risk"):
    """The one run-level info naming the checkpoints that cannot resume exactly (a risk, or a
    configuration for weights-only saves): what each part is missing from."""
    found = [f for f in verdict["findings"] if f["code"] == "LOOP-09" and f["checkpoint"] is None]
    assert len(found) <= 1 and all(
        (f["severity"], f["category"], f["step"]) == ("info", category, None) for f in found
    ), found
    return found[0]["evidence"]["missing_state"] if found else {}


@pytest.fixture(scope="module")
def faulty(checkpoint_fault_run):
    return audit(checkpoint_fault_run)


def test_each_fault_fails_only_its_own_checkpoint(faulty, checkpoint_fault_run):
    found = loop09(faulty)
    # checkpoint-2 is sound, its weights saved with torch.save: read statically, it passes.
    assert (checkpoint_fault_run / "checkpoint-2" / "pytorch_model.bin").is_file()
    # param_left_out from step 17: identical at checkpoint-18 (vs 16) and checkpoint-20 (vs 18).
    # checkpoint-16 lacks its RNG states: a resume risk for the run (info), not a fail of its own.
    assert sorted(found, key=lambda n: int(n.split("-")[1])) == [
        f"checkpoint-{s}" for s in (4, 6, 8, 10, 12, 14, 18, 20)
    ]
    assert {f["severity"] for f in found.values()} == {"fail"}
    assert all(f["step"] == int(name.split("-")[1]) for name, f in found.items())
    verdicts = {c["name"]: c["verdict"] for c in faulty["checkpoints"]}
    assert verdicts["checkpoint-2"] == "pass" and verdicts["checkpoint-16"] == "pass"
    assert all(v == "fail" for name, v in verdicts.items() if name not in ("checkpoint-2", "checkpoint-16"))
    # File faults are not training anomalies; the parameter left out of the optimizer from step 17
    # is one, and LOOP-05 names it from the gradients and weight norms at that step.
    assert faulty["first_anomalous_step"] == 17
    assert {
        f["code"]
        for f in faulty["findings"]
        if f["scope"] == "run" and f["severity"] != "info" and f["step"] is not None
    } == {"LOOP-05"}


def test_missing_key_stray_dtype_and_nan_are_named(faulty):
    found = loop09(faulty)
    assert found["checkpoint-4"]["evidence"]["keys"] == {"missing": [DROPPED_KEY], "unexpected": []}
    assert found["checkpoint-6"]["evidence"]["dtypes"] == [
        {"tensor": STRAY_TENSOR, "dtype": "float32", "expected": "bfloat16"}
    ]
    nan = found["checkpoint-8"]["evidence"]
    assert nan["tensors"] == [{"tensor": NAN_TENSOR, "nonfinite_elements": 1, "shape": [64, 64]}]


def test_truncated_and_hostile_headers_are_clear_errors(faulty):
    found = loop09(faulty)
    assert found["checkpoint-10"]["evidence"]["file"] == "checkpoint-10/model.safetensors"
    assert "the file is truncated" in found["checkpoint-10"]["message"]
    hostile = found["checkpoint-12"]
    assert hostile["evidence"]["file"] == "checkpoint-12/model.safetensors"
    assert NAN_TENSOR in hostile["message"] and "pointing outside the file" in hostile["message"]


def test_code_running_pickle_is_named_and_never_run(faulty, checkpoint_fault_run):
    finding = loop09(faulty)["checkpoint-14"]
    assert finding["evidence"] == {"file": f"checkpoint-14/{PAYLOAD_FILE}", "imports": ["builtins.exec"]}
    marker = checkpoint_fault_run / "PICKLE_RAN"
    assert not marker.exists()
    # The payload is live: a plain unpickle of the same file runs it (in a child process).
    with zipfile.ZipFile(checkpoint_fault_run / "checkpoint-14" / PAYLOAD_FILE) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    subprocess.run(
        [sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"], input=data, check=True
    )
    assert marker.read_text() == "pickle code ran"
    marker.unlink()


def test_missing_rng_state_and_parameter_left_out_of_the_optimizer(faulty):
    found = loop09(faulty)
    assert resume_risk(faulty) == {"rng_states": ["checkpoint-16"]}
    for name, previous in (("checkpoint-18", "checkpoint-16"), ("checkpoint-20", "checkpoint-18")):
        stale = found[name]["evidence"]
        assert [t["tensor"] for t in stale["tensors"]] == [LEFT_OUT_TENSOR]
        assert stale["tensors"][0]["max_grad_norm"] > 0 and stale["previous_checkpoint"] == previous


def test_only_the_sound_checkpoints_are_intact(faulty):
    # checkpoint-16 loads (weights sound); it only cannot resume the RNG streams exactly.
    assert [c["name"] for c in faulty["checkpoints"] if c["intact"]] == ["checkpoint-2", "checkpoint-16"]


def test_resume_state_fails_each_checkpoint_under_require_resume_state(checkpoint_fault_run):
    ingest(checkpoint_fault_run)  # the shared run may not have been audited yet by an earlier test
    con = connect(checkpoint_fault_run, read_only=True)
    try:
        ctx = AuditContext(con, checkpoint_fault_run, load_manifest(con))
        findings = CheckpointIntegrity(require_resume_state=True).run(ctx)
    finally:
        con.close()
    lacking = [f for f in findings if "cannot resume exactly" in f.message]
    assert [(f.checkpoint, f.severity, f.evidence["missing_state"]) for f in lacking] == [
        ("checkpoint-16", "fail", ["rng_states"])
    ]


def test_trainer_checkpoints(hf_checkpoint_fault_run):
    verdict = audit(hf_checkpoint_fault_run)
    found = loop09(verdict)
    assert set(found) == {"checkpoint-10"}
    assert found["checkpoint-10"]["evidence"]["tensors"][0]["tensor"] == NAN_TENSOR
    assert resume_risk(verdict) == {"rng_states": [f"checkpoint-{HF_CHECKPOINT_FAULTS['ckpt_no_rng']}"]}


def test_clean_run_checkpoints_pass(clean_run):
    verdict = cached_audit(clean_run)
    assert loop09(verdict) == {} and resume_risk(verdict) == {}
    assert all(c["intact"] for c in verdict["checkpoints"]) and len(verdict["checkpoints"]) == 3


def test_a_configured_dtype_names_every_other_tensor(clean_run):
    con = connect(clean_run, read_only=True)
    try:
        ctx = AuditContext(con, clean_run, load_manifest(con))
        findings = CheckpointIntegrity(expected_dtype="bfloat16").run(ctx)
        n_params = len(ctx.manifest["params"])
    finally:
        con.close()
    assert [f.checkpoint for f in findings] == ["checkpoint-10", "checkpoint-20", "checkpoint-30"]
    assert all(f.evidence["tensor_count"] == n_params for f in findings)
    assert findings[0].evidence["dtypes"][0]["expected"] == "bfloat16"


@pytest.mark.slow
def test_updates_that_round_away_are_not_stale(tmp_path):
    """Plain SGD at lr 1e-5 leaves the norm weights (1.0, tiny gradients) byte-identical between saves:
    their updates round away in float32. That is not a tensor missing from the optimizer."""
    from sftaudit.fixtures.train import train_plain

    run = train_plain(
        tmp_path / "sgd-tiny-lr",
        steps=6,
        optimizer="sgd",
        lr=1e-5,
        checkpoint_every=3,
        profile="prod",
        tokenizer_cache=tmp_path / "tok",
    )
    verdict = audit(run)
    assert loop09(verdict) == {}
    assert [c["name"] for c in verdict["checkpoints"] if c["intact"]] == ["checkpoint-3", "checkpoint-6"]


# ---------------------------------------------------------------- training state: wherever saved, what the run has


def step_folder_loop(
    run,
    steps=4,
    every=2,
    state=("step", "optimizer", "rng_states", "data_position"),
    scheduler=False,
    weights="step-{step}/model.safetensors",
):
    """A plain loop through the recorder (AdamW, a warmup LambdaLR only with `scheduler`) that saves
    `weights` (``step-N/model.safetensors``) and, beside it, ``trainer.pt`` holding the `state` parts;
    the recorder gets the weight file's path."""
    import random

    import numpy as np
    import torch
    from safetensors.torch import save_file
    from sftaudit.fixtures import build_model, build_tokenizer, collate, load_dataset
    from sftaudit.fixtures.layouts import untied_state_dict

    from sftaudit.shim import Recorder

    tok = build_tokenizer(run.parent / "tokenizer")
    model = build_model(tok)
    rows = load_dataset()[:8]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3)) if scheduler else None
    with Recorder(run, model, tok, profile="prod", scheduler=sched) as rec:
        for step in range(1, steps + 1):
            data = collate(tok, rows)
            rec.on_batch(step, data)
            loss = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"], labels=data["labels"]).loss
            loss.backward()
            rec.on_backward(step, loss)
            opt.step()
            if sched:
                sched.step()
            rec.on_step_end(step, lr=opt.param_groups[0]["lr"])
            opt.zero_grad()
            if step % every == 0:
                path = run / weights.format(step=step)
                path.parent.mkdir(parents=True, exist_ok=True)
                save_file(untied_state_dict(model), str(path))
                full = {
                    "step": step,
                    "optimizer": opt.state_dict(),
                    "data_position": {"epoch": 0, "position": step},
                    "rng_states": {
                        "python": random.getstate(),
                        "numpy": np.random.get_state(),
                        "torch": torch.get_rng_state(),
                    },
                    **({"scheduler": sched.state_dict()} if sched else {}),
                }
                torch.save(
                    {
                        k: v
                        for k, v in full.items()
                        if k in state or k == "scheduler" and scheduler and "scheduler" in state
                    },
                    path.parent / "trainer.pt",
                )
                rec.on_checkpoint(step, path)
    return run


def test_training_state_beside_a_weight_file_is_read(tmp_path):
    """step-N/model.safetensors next to trainer.pt (step, optimizer, RNG, data position), no scheduler in
    the run: the checkpoints resume exactly and LOOP-09 says nothing (it once demanded all six parts)."""
    verdict = audit(step_folder_loop(tmp_path / "beside"))
    assert [c["name"] for c in verdict["checkpoints"]] == ["step-2", "step-4"]
    assert [f for f in verdict["findings"] if f["code"] == "LOOP-09"] == []


def test_a_part_missing_beside_the_weights_is_one_risk(tmp_path):
    run = step_folder_loop(tmp_path / "no-rng", state=("step", "optimizer", "data_position"))
    assert resume_risk(audit(run)) == {"rng_states": ["step-2", "step-4"]}  # not the scheduler the run never had


def test_a_scheduler_is_demanded_where_the_run_had_one(tmp_path):
    run = step_folder_loop(
        tmp_path / "sched", scheduler=True, state=("step", "optimizer", "rng_states", "data_position")
    )
    assert resume_risk(audit(run)) == {"scheduler": ["step-2", "step-4"]}
    twin = step_folder_loop(
        tmp_path / "sched-saved",
        scheduler=True,
        state=("step", "optimizer", "rng_states", "data_position", "scheduler"),
    )
    assert resume_risk(audit(twin)) == {}


def test_state_in_a_folder_shared_by_several_checkpoints_is_not_theirs(tmp_path):
    """ckpts/model-N.safetensors for every save, one ckpts/trainer.pt overwritten each time: that state
    belongs to no one save (it is the last one's), so these are weights-only saves."""
    run = step_folder_loop(tmp_path / "shared", weights="ckpts/model-{step}.safetensors")
    verdict = audit(run)
    names = ["model-2.safetensors", "model-4.safetensors"]
    assert resume_risk(verdict, category="configuration") == {
        part: names for part in ("step", "optimizer", "rng_states", "data_position")
    }
    [stated] = [f for f in verdict["findings"] if f["code"] == "LOOP-09"]
    assert stated["message"].startswith(f"2 checkpoint(s) are weights-only saves ({', '.join(names)})")


REAL_RUNS = Path(__file__).resolve().parents[2] / ".." / "shared" / "realruns"


@pytest.mark.skipif(not (REAL_RUNS / "tiny-gpt2-as-checkpoint").is_dir(), reason="no real runs here")
@pytest.mark.slow  # a real run
def test_a_released_trainer_checkpoint_resumes_exactly(tmp_path):
    """A Trainer checkpoint as published (weights, optimizer.pt, scheduler.pt, rng_state.pth,
    trainer_state.json; no training_args.bin, no collator state): nothing is missing."""
    import json

    from sftaudit.cli import main

    run = tmp_path / "tiny-gpt2"
    shutil.copytree(REAL_RUNS / "tiny-gpt2-as-checkpoint", run)
    # Imported as it lies. The run itself is stuck at chance (LOOP-20 fails it); its checkpoint is sound.
    assert main(["audit", str(run), "--no-report", "--out", str(tmp_path / "out")]) == 1
    verdict = json.loads((tmp_path / "out" / "verdict.json").read_text())
    assert {f["code"] for f in verdict["findings"] if f["severity"] == "fail"} == {"LOOP-20"}
    assert [c["name"] for c in verdict["checkpoints"]] == ["checkpoint-250"]
    assert [f for f in verdict["findings"] if f["code"] == "LOOP-09"] == []
