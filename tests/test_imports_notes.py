"""What an imported run's logs cannot show (the manifest's `notes`, each under a stable key, decided from what the
files hold: each shape with its clean twin), and what the run trained (the manifest's `task`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sftaudit.imports import import_run
from sftaudit.imports.task import describe_task, objective_of

from .checks.logged_runs import falling, logged, save_state, trainer_run


def _manifest(run_dir) -> dict:
    return json.loads((run_dir / "sftaudit" / "rank-0" / "manifest.jsonl").read_text(encoding="utf-8").splitlines()[-1])


def _keys(run_dir) -> set[str]:
    import_run(run_dir)
    manifest = _manifest(run_dir)
    assert manifest["import_notes"] == [n["text"] for n in manifest["notes"]]
    return {n["key"] for n in manifest["notes"]}


def test_a_logging_window_is_said_and_a_per_step_log_is_not(tmp_path):
    assert "logging_window" in _keys(trainer_run(tmp_path / "every5", falling(20), every=5))
    assert "logging_window" not in _keys(trainer_run(tmp_path / "every1", falling(20)))


def test_no_evaluation_is_said_only_when_none_was_logged(tmp_path):
    assert "no_evaluation" in _keys(trainer_run(tmp_path / "none", falling(20)))
    assert "no_evaluation" not in _keys(trainer_run(tmp_path / "evals", falling(20), evals=[(10, 1.2), (20, 1.1)]))


def test_the_nan_filter_is_said_unless_the_log_shows_a_non_finite_loss(tmp_path):
    """A log with only finite losses may hide NaN steps (logging_nan_inf_filter); one that logged a NaN loss ran
    with the filter off: it shows them."""
    assert "nan_inf_filter" in _keys(trainer_run(tmp_path / "finite", falling(20)))
    loss = falling(20)
    loss[7] = np.nan
    assert "nan_inf_filter" not in _keys(trainer_run(tmp_path / "shown", loss))


def test_a_log_without_gradient_norms_is_said(tmp_path):
    assert "no_grad_norm" in _keys(trainer_run(tmp_path / "old", falling(20)))
    assert "no_grad_norm" not in _keys(trainer_run(tmp_path / "new", falling(20), grad_norm=[1.0] * 20))


def test_fp16_loss_scaling_is_read_from_a_saved_scaler(tmp_path):
    history = logged(range(1, 21), falling(20), [1e-4] * 20)
    for name, scaler in (("fp16", True), ("bf16", False)):
        run = save_state(tmp_path / name, "checkpoint-20", history, max_steps=20)
        if scaler:
            (run / "checkpoint-20" / "scaler.pt").write_bytes(b"PK")
        import_run(run)
        notes = {n["key"]: n for n in _manifest(run)["notes"]}
        assert ("fp16_skipped_steps" in notes) == scaler
        assert notes.get("fp16_skipped_steps", {}).get("checkpoints") == (["checkpoint-20"] if scaler else None)


@pytest.mark.parametrize("logging_steps, said", [(500, True), (10, False)])
def test_logging_steps_longer_than_the_run_is_named_as_why_nothing_was_logged(tmp_path, logging_steps, said):
    """87 steps, logging_steps 500: the Trainer logged no training step, and the note says why. The twin logged
    every 10 steps."""
    history = [] if said else logged(range(10, 81, 10), falling(8), [1e-4] * 8)
    run = save_state(tmp_path / "run", ".", history, max_steps=87, logging_steps=logging_steps, global_step=87)
    import_run(run)
    notes = {n["key"]: n for n in _manifest(run)["notes"]}
    if said:
        assert notes["nothing_logged"]["text"] == (
            "logging_steps 500 is more than the 87 step(s) the run trained: the Trainer logged no training step"
        )
    else:
        assert "nothing_logged" not in notes


def test_a_log_that_ends_with_a_checkpoint_short_of_its_plan_is_said(tmp_path):
    """Only checkpoint-200's state, 200 of 350 planned: nothing after it is on disk. Twins: a checkpoint that ends the
    plan, and the same log at the top of the folder."""
    history = logged(range(1, 201), falling(200), [1e-4] * 200)
    short = save_state(tmp_path / "short", "checkpoint-200", history, max_steps=350)
    ended = save_state(tmp_path / "ended", "checkpoint-200", history, max_steps=200)
    top = save_state(tmp_path / "top", ".", history, max_steps=350)
    assert "log_ends_at_checkpoint" in _keys(short)
    assert "log_ends_at_checkpoint" not in _keys(ended) | _keys(top)


# ---------------------------------------------------------------------------- the task


def test_a_classifier_a_seq2seq_model_a_causal_lm_and_an_adapter_are_told_apart(tmp_path):
    steps = range(1, 21)
    configs = {
        "roberta": {
            "architectures": ["RobertaForSequenceClassification"],
            "model_type": "roberta",
            "id2label": {"0": "objective", "1": "subjective"},
            "vocab_size": 50265,
        },
        "bert-default-labels": {"architectures": ["BertForSequenceClassification"], "model_type": "bert"},
        "t5": {"architectures": ["T5ForConditionalGeneration"], "is_encoder_decoder": True, "vocab_size": 32128},
        "qwen": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936},
    }
    tasks = {}
    for name, config in configs.items():
        run = save_state(tmp_path / name, "checkpoint-20", logged(steps, falling(20), [1e-4] * 20), max_steps=20)
        (run / "checkpoint-20" / "config.json").write_text(json.dumps(config), encoding="utf-8")
        import_run(run)
        tasks[name] = _manifest(run)["task"]
    assert {k: tasks["roberta"][k] for k in ("kind", "num_labels", "labels", "vocab_size")} == {
        "kind": "sequence_classification",
        "num_labels": 2,
        "labels": ["objective", "subjective"],
        "vocab_size": 50265,
    }
    assert (tasks["bert-default-labels"]["kind"], tasks["bert-default-labels"]["num_labels"]) == (
        "sequence_classification",
        2,
    )
    assert (tasks["t5"]["kind"], tasks["t5"]["is_encoder_decoder"], tasks["t5"]["num_labels"]) == (
        "seq2seq",
        True,
        None,
    )
    assert (tasks["qwen"]["kind"], tasks["qwen"]["architecture"], tasks["qwen"]["family"]) == (
        "causal_lm",
        "Qwen2ForCausalLM",
        "sft",
    )
    adapter = save_state(tmp_path / "lora", "checkpoint-20", logged(steps, falling(20), [1e-4] * 20), max_steps=20)
    (adapter / "checkpoint-20" / "adapter_config.json").write_text(
        json.dumps({"task_type": "SEQ_CLS", "base_model_name_or_path": "roberta-base", "r": 8}), encoding="utf-8"
    )
    import_run(adapter)
    assert _manifest(adapter)["task"]["adapter"] == {"task_type": "SEQ_CLS", "base_model": "roberta-base"}
    assert _manifest(adapter)["task"]["kind"] == "sequence_classification"


@pytest.mark.parametrize(
    "keys, objective, family",
    [
        ({"loss", "rewards/chosen", "rewards/margins", "logps/chosen", "logits/chosen"}, "dpo", "preference"),
        ({"loss", "rewards/chosen", "log_odds_ratio", "log_odds_chosen", "nll_loss"}, "orpo", "preference"),
        ({"loss", "rewards/chosen_sum", "logps/chosen_sum", "count/chosen", "kl"}, "kto", "preference"),
        ({"loss", "rewards/chosen", "logps/chosen", "kl"}, "kto", "preference"),
        ({"loss", "rewards/chosen", "logps/chosen", "nll_loss"}, "cpo", "preference"),
        ({"loss", "reward", "reward_std", "kl", "rewards/format/mean", "completions/mean_length"}, "grpo", "rl"),
        ({"loss", "objective/kl", "objective/rlhf_reward", "policy/entropy_avg"}, "ppo", "rl"),
        ({"loss", "mean_token_accuracy", "entropy", "num_tokens"}, None, "sft"),
    ],
)
def test_the_objective_is_named_by_the_logged_statistics(keys, objective, family):
    assert objective_of(keys)[:2] == (objective, family)
    assert describe_task(None, None, keys)["objective"] == objective


def test_a_dpo_log_is_recorded_as_a_preference_run(tmp_path):
    keys = {"rewards/margins": [0.1] * 20, "logps/chosen": [-50.0] * 20}
    run = trainer_run(tmp_path / "dpo", falling(20, 0.69, 0.3), keys=keys)
    import_run(run)
    task = _manifest(run)["task"]
    assert (task["objective"], task["family"], task["objective_keys"]) == (
        "dpo",
        "preference",
        ["logps/chosen", "rewards/margins"],
    )
