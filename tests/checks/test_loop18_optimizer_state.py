"""LOOP-18 on real Trainer runs trained without the shim: Adam's state and the weights of consecutive
checkpoints, read statically from the checkpoints; a hostile optimizer.pt is refused unrun."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest

from sftaudit.imports import import_run
from sftaudit.readers.checkpoints import CheckpointError
from sftaudit.readers.optimizer_state import UnsafeOptimizerState, checkpoint_weights, map_names, read_adam_state
from sftaudit.verdict.audit import audit

from .dynamics_runs import of
from .posthoc_runs import GRAD_DROPPED, SCALED, SCALED_WEIGHTS, audited, posthoc_run

pytestmark = pytest.mark.slow  # Trainer runs without the shim


def loop18(verdict):
    return of(verdict, "LOOP-18")


def test_a_tensor_the_optimizer_never_updated_is_named(tmp_path_factory, tokenizer_cache):
    _, _, verdict = audited(tmp_path_factory, tokenizer_cache, "window")
    never = [f for f in loop18(verdict) if "never updated" in f["message"]]
    assert len(never) == 1 and never[0]["severity"] == "fail" and never[0]["step"] is None
    assert never[0]["evidence"]["tensors"] == [
        {"tensor": GRAD_DROPPED, "index": 6, "reason": "no optimizer state: never had a gradient"}
    ]


def test_a_nan_in_the_optimizer_state_is_placed_in_its_checkpoint_window(tmp_path_factory, tokenizer_cache, tmp_path):
    """With the NaN in the log, the log places it (logging window); without a logged grad_norm (a
    Trainer without clipping logs none) the optimizer state still does, to its checkpoint window."""
    _, _, verdict = audited(tmp_path_factory, tokenizer_cache, "window")
    assert not [f for f in loop18(verdict) if "optimizer state saved at" in f["message"]]
    run = tmp_path / "run"
    shutil.copytree(
        posthoc_run(tmp_path_factory, tokenizer_cache, "window"), run, ignore=shutil.ignore_patterns("sftaudit")
    )
    for path in run.glob("checkpoint-*/trainer_state.json"):
        state = json.loads(path.read_text(encoding="utf-8"))
        for entry in state["log_history"]:
            entry.pop("grad_norm", None)
        path.write_text(json.dumps(state), encoding="utf-8")
    import_run(run)
    verdict = audit(run)
    state = [f for f in loop18(verdict) if "optimizer state saved at" in f["message"]]
    assert len(state) == 1 and state[0]["step"] == 11 and verdict["rollback_checkpoint"] == "checkpoint-10"
    assert state[0]["evidence"]["resolution"] == {
        "kind": "checkpoint window",
        "first_step": 11,
        "last_step": 15,
        "from": "checkpoint-10",
        "to": "checkpoint-15",
    }


def test_updates_dominated_by_eps(tmp_path_factory, tokenizer_cache):
    _, _, verdict = audited(tmp_path_factory, tokenizer_cache, "window")  # adam_epsilon = 0.05
    eps = [f for f in loop18(verdict) if "dominated by Adam's eps" in f["message"]]
    assert len(eps) == 1 and eps[0]["severity"] == "warn" and eps[0]["evidence"]["eps"] == 0.05
    assert eps[0]["evidence"]["seen_at"] == "checkpoint-10"  # the newest state that is still finite


def test_a_gradient_spike_and_a_weight_jump_are_localised_to_checkpoint_windows(tmp_path_factory, tokenizer_cache):
    _, _, verdict = audited(tmp_path_factory, tokenizer_cache, "exact")
    moments = [f for f in loop18(verdict) if "gradient scale" in f["message"]]
    assert len(moments) == 1 and moments[0]["evidence"]["tensors"][0]["tensor"] == SCALED
    assert moments[0]["step"] == 7 and moments[0]["evidence"]["resolution"]["last_step"] == 12
    moved = [f for f in loop18(verdict) if " moved " in f["message"]]
    assert len(moved) == 1 and moved[0]["evidence"]["tensors"][0]["tensor"] == SCALED_WEIGHTS
    assert moved[0]["step"] == 13 and moved[0]["evidence"]["resolution"]["last_step"] == 18
    assert verdict["first_anomalous_step"] == 7 and verdict["rollback_checkpoint"] == "checkpoint-6"


def test_silent_on_a_clean_run(tmp_path_factory, tokenizer_cache):
    _, _, verdict = audited(tmp_path_factory, tokenizer_cache, "clean_trl")
    assert [f for f in verdict["findings"] if f["code"] == "LOOP-18"] == []
    assert {c["code"]: c["status"] for c in verdict["checks"]}["LOOP-18"] == "ran"


def test_names_come_from_the_weights_and_ambiguity_is_refused(tmp_path_factory, tokenizer_cache):
    """Against the Trainer's own parameter order (decay group, then no-decay, in named_parameters order):
    every name given is right, and most are given."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer

    run = posthoc_run(tmp_path_factory, tokenizer_cache, "window")
    state = read_adam_state(run / "checkpoint-10" / "optimizer.pt")
    names = map_names(state, checkpoint_weights(run / "checkpoint-10"), checkpoint_weights(run / "checkpoint-5"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(run / "checkpoint-10"))
    decay = set(Trainer.get_decay_parameter_names(None, model))
    order = [n for n, _ in model.named_parameters() if n in decay] + [
        n for n, _ in model.named_parameters() if n not in decay
    ]
    assert all(order[i] == name for i, name in names.items())
    assert len(names) >= len(state.entries) - 2
    alone = map_names(state, checkpoint_weights(run / "checkpoint-10"), {})  # nothing to tell same shapes apart
    assert all(order[i] == name for i, name in alone.items()) and len(alone) < len(names)


def _hostile_optimizer(path: Path, sentinel: Path) -> None:
    """A torch-style zip whose pickle would run a shell command when unpickled."""

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {sentinel}",)

    buffer = io.BytesIO()
    pickle.dump({"state": {0: Payload()}, "param_groups": []}, buffer, protocol=2)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", buffer.getvalue())
        z.writestr("archive/version", "3\n")


def test_a_hostile_optimizer_state_is_refused_without_running_it(tmp_path_factory, tokenizer_cache, tmp_path):
    sentinel = tmp_path / "pwned"
    run = tmp_path / "run"
    shutil.copytree(
        posthoc_run(tmp_path_factory, tokenizer_cache, "clean_trl"), run, ignore=shutil.ignore_patterns("sftaudit")
    )
    _hostile_optimizer(run / "checkpoint-8" / "optimizer.pt", sentinel)
    with pytest.raises(UnsafeOptimizerState, match="posix.system|os.system"):
        read_adam_state(run / "checkpoint-8" / "optimizer.pt")
    import_run(run)
    verdict = audit(run)
    assert not sentinel.exists()
    assert verdict["check_errors"] == []
    skipped = [f for f in verdict["findings"] if f["code"] == "LOOP-18"]
    assert [f["severity"] for f in skipped] == ["info"] and "refused without loading it" in skipped[0]["message"]
    assert any(
        f["code"] == "LOOP-09" and f["severity"] == "fail" and f["checkpoint"] == "checkpoint-8"
        for f in verdict["findings"]
    )  # LOOP-09 reports the unsafe pickle itself


def test_not_an_optimizer_state(tmp_path):
    path = tmp_path / "optimizer.pt"
    buffer = io.BytesIO()
    pickle.dump({"weights": [1, 2]}, buffer, protocol=2)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", buffer.getvalue())
    with pytest.raises(CheckpointError, match="not an optimizer state dict"):
        read_adam_state(path)


def test_sgd_state_is_not_read_as_adam_with_every_tensor_never_updated(tmp_path_factory, tokenizer_cache, tmp_path):
    """Plain SGD (the Trainer's `optim="sgd"`) keeps no per-parameter state: the false alarm of the clean sweep's
    Trainer/TRL SGD runs, which LOOP-18 failed as "21 tensors never updated"."""
    import torch

    run = tmp_path / "run"
    shutil.copytree(
        posthoc_run(tmp_path_factory, tokenizer_cache, "clean_trl"), run, ignore=shutil.ignore_patterns("sftaudit")
    )
    for path in run.glob("checkpoint-*/optimizer.pt"):
        count = len(read_adam_state(path).indices)
        params = [torch.nn.Parameter(torch.ones(2)) for _ in range(count)]
        sgd = torch.optim.SGD(params, lr=0.1)
        sum(p.sum() for p in params).backward()
        sgd.step()
        torch.save(sgd.state_dict(), path)
        with pytest.raises(CheckpointError, match="not an Adam state: its parameter groups have no betas .*momentum"):
            read_adam_state(path)
    import_run(run)
    verdict = audit(run)
    assert verdict["check_errors"] == []
    assert {f["severity"] for f in loop18(verdict)} <= {"info"}
