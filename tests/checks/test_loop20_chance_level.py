"""LOOP-20: a loss at or above ln V, from the vocabulary in config.json; clean twins and losses that are no token
cross-entropy stay silent."""

import math

import numpy as np

from .logged_runs import audited, falling, findings, status, trainer_run

GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 50257}


def test_a_model_stuck_at_chance_for_its_whole_run_fails_and_a_learning_twin_does_not(tmp_path):
    # A GPT-2 run logging every 100 steps whose loss never leaves ln 50257 = 10.825.
    verdict = audited(
        trainer_run(tmp_path / "stuck", [10.8312, 10.7825, 10.7671, 10.79, 10.7755], every=100, config=GPT2)
    )
    [finding] = findings(verdict, "LOOP-20")
    assert (finding["severity"], finding["step"]) == ("fail", 1)
    assert (
        finding["evidence"]["vocab_size"] == 50257 and finding["evidence"]["vocab_source"] == "manifest"
    )  # the importer's
    assert abs(finding["evidence"]["chance_loss"] - math.log(50257)) < 1e-9
    assert "ln 50,257 = 10.82" in finding["message"]
    learning = audited(trainer_run(tmp_path / "learning", [10.83, 7.9, 6.2, 5.1, 4.6, 4.3], every=100, config=GPT2))
    assert findings(learning, "LOOP-20") == []
    # The first 8 steps of a model trained from scratch: at chance, too early to call stuck.
    early = audited(
        trainer_run(tmp_path / "early", [10.83, 10.81, 10.82, 10.79, 10.8, 10.78, 10.8, 10.77], config=GPT2)
    )
    assert findings(early, "LOOP-20") == []


def test_a_first_window_above_chance_warns_at_that_window(tmp_path):
    # A 1B instruct model (vocab 262,144: ln V = 12.48) whose first 50-step window logs 14.75, then 0.7.
    config = {"model_type": "gemma3", "text_config": {"vocab_size": 262144}}
    loss = np.r_[14.7538, falling(40, 1.2, 0.45, noise=0.03)]
    [finding] = findings(audited(trainer_run(tmp_path / "start", loss, every=50, config=config)), "LOOP-20")
    assert (finding["severity"], finding["step"]) == ("warn", 1)  # the logging window of step 50
    assert finding["evidence"]["vocab_source"] == "manifest" and finding["evidence"]["steps_above"] == 1
    clean = audited(trainer_run(tmp_path / "clean", falling(41, 1.9, 0.45, noise=0.03), every=50, config=config))
    assert findings(clean, "LOOP-20") == []


def test_without_a_vocabulary_or_with_a_loss_that_is_no_token_cross_entropy_it_is_not_judged(tmp_path):
    verdict = audited(trainer_run(tmp_path / "novocab", [10.8, 10.8, 10.8]))
    assert status(verdict, "LOOP-20") == (
        "not_run",
        "the vocabulary size is unknown (no model config.json, tokenizer or checkpoint header)",
    )
    # A multi-head model logs its loss as the sum of 7 per-head losses: above ln V by construction.
    heads = {f"train/ploss_{k}": np.full(5, 3.5) for k in range(7)}
    verdict = audited(trainer_run(tmp_path / "heads", np.full(5, 24.5), keys=heads, config=GPT2))
    assert status(verdict, "LOOP-20")[0] == "not_run" and "train/ploss_0" in status(verdict, "LOOP-20")[1]
    dpo = {"rewards/margins": np.zeros(5), "logps/chosen": np.full(5, -200.0)}
    verdict = audited(trainer_run(tmp_path / "dpo", np.full(5, 0.6931), keys=dpo, config={"vocab_size": 2}))
    assert status(verdict, "LOOP-20")[0] == "not_run" and "preference" in status(verdict, "LOOP-20")[1]
