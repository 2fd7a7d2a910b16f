"""Checkpoints rotated out or deleted are info, never a rollback target, and cannot be gated;
a run is judged only on the evidence recorded, and never passed without any."""

import json
import shutil

import pytest
import torch
from sftaudit.fixtures import build_model, build_tokenizer, collate, load_dataset
from sftaudit.fixtures.train import train_hf

from sftaudit.cli import main
from sftaudit.shim import Recorder
from sftaudit.verdict.audit import audit

from .shared import shared_dir


def gate(run, checkpoint, *extra):
    return main(["gate", str(run), "--checkpoint", str(checkpoint), *map(str, extra)])


@pytest.fixture(scope="module")
def rotated_run(tmp_path_factory, tokenizer_cache):
    """The Trainer with save_total_limit=2: checkpoint-5 and -10 rotated out; checkpoint-15 has a NaN."""
    return (
        shared_dir(
            tmp_path_factory,
            "rotated",
            lambda folder: train_hf(
                folder / "rotated",
                steps=20,
                save_steps=5,
                save_total_limit=2,
                faults={"ckpt_nan_tensor": 15},
                tokenizer_cache=tokenizer_cache,
                profile="prod",
            ),
        )
        / "rotated"
    )


def test_rotated_checkpoints_are_info_and_cannot_be_gated(rotated_run, capsys):
    verdict = audit(rotated_run)
    assert [(c["name"], c["on_disk"]) for c in verdict["checkpoints"]] == [
        ("checkpoint-5", False),
        ("checkpoint-10", False),
        ("checkpoint-15", True),
        ("checkpoint-20", True),
    ]
    loop09 = [(f["checkpoint"], f["severity"]) for f in verdict["findings"] if f["code"] == "LOOP-09"]
    assert loop09 == [("checkpoint-5", "info"), ("checkpoint-10", "info"), ("checkpoint-15", "fail")]
    assert gate(rotated_run, "checkpoint-20") == 0
    assert gate(rotated_run, "checkpoint-15") == 1
    capsys.readouterr()
    assert gate(rotated_run, 5) == 2
    assert "no longer on disk" in capsys.readouterr().err


def test_rollback_target_is_on_disk_and_the_deleted_one_is_named(nan_run, tmp_path, capsys):
    run = tmp_path / "nan"
    shutil.copytree(nan_run, run)
    shutil.rmtree(run / "checkpoint-10")  # the last checkpoint before the NaN at step 13
    verdict = audit(run)
    assert verdict["first_anomalous_step"] == 13
    assert (verdict["rollback_checkpoint"], verdict["rollback_deleted"]) == (None, "checkpoint-10")
    main(["replay", str(run)])
    out = capsys.readouterr().out
    assert "checkpoint-10 would have been, but it is no longer on disk: restart from scratch" in out


def record(run, steps, batch=lambda rows: rows, break_model=lambda model: None, **options):
    """A few real steps of the tiny model through the recorder; `batch` may break the batches,
    `break_model` the model."""
    tok = build_tokenizer(run.parent / "tokenizer")
    model = build_model(tok)
    break_model(model)
    rows = load_dataset()[:8]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(run, model, tok, profile="prod", **options) as rec:
        for step in range(1, steps + 1):
            data = collate(tok, rows)
            rec.on_batch(step, batch(data))
            loss = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"], labels=data["labels"]).loss
            loss.backward()
            rec.on_backward(step, loss)
            opt.step()
            rec.on_step_end(step, lr=0.1)
            opt.zero_grad()
    return run


def test_no_recorded_step_is_never_a_pass(tmp_path, capsys):
    run = record(tmp_path / "empty", steps=0)
    assert main(["audit", str(run), "--no-report", "--out", str(tmp_path / "out")]) == 2
    assert "could not judge: no training step was recorded" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "verdict.json").read_text())["verdict"] == "unjudged"


def test_batches_switched_off_from_the_start_cannot_be_judged(tmp_path, capsys):
    run = record(tmp_path / "nobatches", steps=3, batch=lambda data: {"ids": data["input_ids"]})
    assert main(["audit", str(run), "--no-report", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "rank 0's batches recording was switched off from the start (step 1: KeyError: 'input_ids')" in err


def test_a_component_lost_mid_run_is_judged_on_what_it_has(tmp_path, capsys):
    class BrokenGenerate(Exception):
        pass

    def generate_once(model):
        original = model.generate
        calls = {"n": 0}

        def generate(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] > 1:
                raise BrokenGenerate("generation exploded")
            return original(*args, **kwargs)

        model.generate = generate

    run = record(
        tmp_path / "partial",
        steps=4,
        break_model=generate_once,
        probe_prompts=["hi"],
        generate_every=2,
        generations_per_prompt=2,
        max_new_tokens=4,
    )
    # One line on stderr, no Python warning with its source line (which reads like a crash).
    assert [line for line in capsys.readouterr().err.splitlines() if "sftaudit" in line] == [
        "sftaudit: generations recording failed at step 4 and was switched off (BrokenGenerate: generation "
        "exploded); training goes on, further shim errors go to the run's events only"
    ]
    verdict = audit(run)
    assert verdict["verdict"] != "unjudged" and verdict["cannot_judge"] is None
    assert verdict["evidence"]["components_off"] == [
        {"rank": 0, "component": "generations", "from_step": 4, "error": "BrokenGenerate: generation exploded"}
    ]
    assert verdict["evidence"]["partial"][0].startswith("rank 0's generations recording stopped at step 4")


def test_a_run_with_too_few_logged_losses_is_unjudged_unless_something_was_found(tmp_path):
    """One logged loss (a GRPO run logged once) tells no trend, spike or plateau: nothing found on it is
    not a pass. What was found on so little still stands (a NaN at the one logged step fails)."""
    from tests.checks.logged_runs import audited, trainer_run

    once = audited(trainer_run(tmp_path / "once", [0.91]))
    assert once["verdict"] == "unjudged" and "too little to judge the training" in once["cannot_judge"]
    nan = audited(trainer_run(tmp_path / "nan", [float("nan")]))
    assert nan["verdict"] == "fail" and nan["cannot_judge"] is None
    three = audited(trainer_run(tmp_path / "three", [0.91, 0.85, 0.80]))
    assert three["verdict"] != "unjudged" and three["evidence"]["too_little"] is None
