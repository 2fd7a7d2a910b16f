"""LOOP-09 on the model a Trainer saved into the output folder itself at the end (`save_model`): what is shipped is
judged as a checkpoint's weights are, whatever the checkpoint folders hold; a sound final model adds nothing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from sftaudit.verdict.audit import audit

from .curve_runs import audit_state, history, state_run
from .logged_runs import falling, findings


def _final(verdict):
    return [f for f in findings(verdict, "LOOP-09") if f["checkpoint"] == "the final model"]


def _status(verdict, code):
    return next(c["status"] for c in verdict["checks"] if c["code"] == code)


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32))


def _log():
    return history(falling(40, 2.0, 0.8, noise=0.03, seed=2), 2e-4)


def test_a_sound_final_model_is_judged_and_adds_nothing(tmp_path, tiny_model):
    run = state_run(tmp_path / "sound", _log())
    tiny_model.save_pretrained(run)  # model.safetensors and config.json at the output's top
    # No checkpoint and no final model: not judged. The final model alone: judged, and sound.
    assert _status(audit_state(tmp_path / "log-only", _log()), "LOOP-09") == "not_run"
    judged = audit(run)
    assert _status(judged, "LOOP-09") == "ran" and findings(judged, "LOOP-09") == []


def test_a_final_model_cut_short_fails_and_an_lfs_pointer_warns(tmp_path, tiny_model):
    cut = state_run(tmp_path / "cut", _log())
    tiny_model.save_pretrained(cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    [finding] = _final(audit(cut))
    assert (finding["severity"], finding["step"]) == ("fail", 40)

    zipped = state_run(tmp_path / "zip", _log())
    torch.save(tiny_model.state_dict(), zipped / "pytorch_model.bin")
    data = (zipped / "pytorch_model.bin").read_bytes()
    (zipped / "pytorch_model.bin").write_bytes(data[: len(data) // 2])  # an interrupted copy: no central directory
    [finding] = _final(audit(zipped))
    assert finding["severity"] == "fail" and "cut short" in finding["message"]

    pointer = state_run(tmp_path / "pointer", _log())
    (pointer / "pytorch_model.bin").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 1000000\n"
    )
    [finding] = _final(audit(pointer))
    assert (finding["severity"], finding["step"]) == ("warn", 40) and "Git LFS pointers" in finding["message"]


def test_a_recorded_runs_final_model_is_judged_as_an_imported_runs_is(clean_run, tmp_path):
    """The shim recorded the run and its checkpoints; a model saved at the top of its folder afterwards is read off
    the folder at the audit (recording a run judges no less than importing its logs), its own checkpoints not."""
    assert _final(audit(clean_run)) == []
    run = Path(shutil.copytree(clean_run, tmp_path / "run", symlinks=True))
    (run / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\\noid sha256:" + "0" * 64 + "\\nsize 1000000\\n"
    )
    verdict = audit(run)
    [finding] = _final(verdict)
    last = max(c["step"] for c in verdict["checkpoints"])
    assert finding["severity"] == "warn" and finding["step"] >= last and "Git LFS pointers" in finding["message"]


def test_a_recorded_run_without_checkpoints_has_its_final_model_judged(runs, tmp_path):
    """No checkpoint recorded: LOOP-09 is not run on the bare recording, and runs on the model saved at its top."""
    bare = runs("no-checkpoints", steps=6, checkpoint_every=0)
    assert _status(audit(Path(shutil.copytree(bare, tmp_path / "bare", symlinks=True))), "LOOP-09") == "not_run"
    run = Path(shutil.copytree(bare, tmp_path / "run", symlinks=True))
    (run / "model.safetensors").write_bytes(b"\x00" * 7)  # not even a header: a save cut short
    verdict = audit(run)
    [finding] = _final(verdict)
    assert _status(verdict, "LOOP-09") == "ran" and (finding["severity"], finding["step"]) == ("fail", 6)
