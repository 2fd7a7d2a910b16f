"""LOOP-20: a loss at chance (ln K labels of a classification head, ln V tokens), back at it, above it; clean
twins, preference losses and losses that are no single cross-entropy stay silent."""

import json
import math

import numpy as np

from .curve_runs import audit_state, history, state_run
from .logged_runs import audited, falling, findings, status, trainer_run

GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 50257}
PRETRAINED_GPT2 = GPT2 | {"_name_or_path": "gpt2"}
# A two-label classifier as xlm-roberta-large's config.json saves it: no id2label (transformers' default is 2).
CLASSIFIER = {
    "_name_or_path": "xlm-roberta-large",
    "architectures": ["XLMRobertaForSequenceClassification"],
    "model_type": "xlm-roberta",
    "problem_type": "single_label_classification",
    "vocab_size": 250002,
}


def test_a_model_stuck_at_chance_for_its_whole_run_fails_and_a_learning_twin_does_not(tmp_path):
    # A GPT-2 run logging every 100 steps whose loss never leaves ln 50257 = 10.825.
    verdict = audited(
        trainer_run(tmp_path / "stuck", [10.8312, 10.7825, 10.7671, 10.79, 10.7755], every=100, config=GPT2)
    )
    [finding] = findings(verdict, "LOOP-20")
    assert (finding["severity"], finding["step"]) == ("fail", 1)
    assert finding["evidence"]["classes"] == 50257 and finding["evidence"]["chance_source"] == "manifest"
    assert abs(finding["evidence"]["chance_loss"] - math.log(50257)) < 1e-9
    assert "ln V = ln 50,257 = 10.82" in finding["message"]
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
    assert finding["evidence"]["chance_source"] == "manifest" and finding["evidence"]["steps_above"] == 1
    clean = audited(trainer_run(tmp_path / "clean", falling(41, 1.9, 0.45, noise=0.03), every=50, config=config))
    assert findings(clean, "LOOP-20") == []


def _classifier_loss(collapse_at=None, n=50, seed=0):
    """A two-label classifier logged every 10 steps: at ln 2 for its first windows, learning to ~0.35; with
    `collapse_at` a gradient burst there sends it back to ln 2 for good."""
    rng = np.random.default_rng(seed)
    loss = 0.35 + (0.69 - 0.35) / (1 + np.exp((np.arange(n) - 14) / 2.0))
    norm = np.full(n, 8.0)
    if collapse_at is not None:
        loss[collapse_at:] = 0.69
        norm[collapse_at] = 110.0
    return loss * np.exp(0.04 * rng.standard_normal(n)), norm * np.exp(0.3 * rng.standard_normal(n))


def test_a_classifier_back_at_ln_2_after_a_gradient_burst_fails_and_its_clean_twin_does_not(tmp_path):
    loss, norm = _classifier_loss(collapse_at=30)
    verdict = audit_state(tmp_path / "collapse", history(loss, 2e-5, norm, every=10), CLASSIFIER)
    [collapse] = [f for f in findings(verdict, "LOOP-20") if f["evidence"].get("collapse")]
    assert (collapse["severity"], collapse["step"]) == ("fail", 301)  # the window of step 310
    assert collapse["evidence"]["classes"] == 2 and collapse["evidence"]["kind"] == "classification head"
    assert "transformers' default" in collapse["evidence"]["chance_source"]
    assert "ln K = ln 2 = 0.6931" in collapse["message"] and "gradient-norm burst" in collapse["message"]
    # The same classifier learning to the end: its first windows at ln 2 are where every classifier starts.
    loss, norm = _classifier_loss()
    assert findings(audit_state(tmp_path / "clean", history(loss, 2e-5, norm, every=10), CLASSIFIER), "LOOP-20") == []


def test_a_classifier_is_judged_against_its_labels_not_its_vocabulary(tmp_path):
    loss, norm = _classifier_loss()
    config = CLASSIFIER | {"id2label": {str(i): f"L{i}" for i in range(5)}}
    # A five-label classifier that never leaves ln 5 = 1.61 in 300 steps (against ln 250,002 = 12.4: far below).
    stuck_loss = np.log(5) * np.exp(0.03 * np.random.default_rng(2).standard_normal(30))
    verdict = audit_state(tmp_path / "five", history(stuck_loss, 2e-5, norm[:30], every=10), config)
    [stuck] = findings(verdict, "LOOP-20")
    assert (stuck["severity"], stuck["step"]) == ("fail", 1)
    assert stuck["evidence"]["classes"] == 5 and stuck["evidence"]["chance_source"] == "config.json id2label"
    regression = CLASSIFIER | {"problem_type": "regression", "num_labels": 1}
    verdict = audit_state(tmp_path / "regression", history(loss, 2e-5, norm, every=10), regression)
    assert status(verdict, "LOOP-20")[0] == "not_run" and "regression head" in status(verdict, "LOOP-20")[1]


def test_a_lora_fine_tune_whose_first_windows_sit_at_ln_v_warns_and_its_clean_twin_does_not(tmp_path):
    # Three windows at ln 50257 (11.0, 10.4, 9.6) with a grad-norm of 23, then a drop to 0.7.
    loss = np.r_[10.9959, 10.421, 9.6081, 5.3367, 1.8801, falling(15, 0.89, 0.64, noise=0.03)]
    norm = np.r_[4.87, 7.21, 23.4, 11.9, 1.64, np.full(15, 0.15)]
    verdict = audit_state(tmp_path / "chance", history(loss, 2e-4, norm, every=10), PRETRAINED_GPT2)
    [finding] = findings(verdict, "LOOP-20")
    assert (finding["severity"], finding["step"]) == ("warn", 1)
    assert finding["evidence"]["last_step"] == 30 and finding["evidence"]["pretrained"] == "a model loaded from gpt2"
    clean = np.r_[3.4, 2.9, 2.5, falling(17, 2.2, 0.64, noise=0.03)]
    assert (
        findings(audit_state(tmp_path / "clean", history(clean, 2e-4, norm, every=10), PRETRAINED_GPT2), "LOOP-20")
        == []
    )
    # A model trained from scratch (config.json names no pretrained source) starts at chance: silent.
    assert findings(audit_state(tmp_path / "scratch", history(loss, 2e-4, norm, every=10), GPT2), "LOOP-20") == []


def test_a_loss_that_jumps_above_chance_after_learning_fails_at_the_jump(tmp_path):
    # LR 100x too high on a 2,048-token model trained from scratch: 6.0 -> 4.2 -> 11.3 -> 12.05, then ~3.8.
    rng = np.random.default_rng(1)
    settle = 3.8 + 0.35 * np.exp(-np.arange(25) / 6) + 0.05 * rng.standard_normal(25)
    loss = np.r_[7.62, 7.35, 7.0, 6.6, 6.0, 4.2, 11.3, 12.05, 9.6, 7.4, 6.1, 5.2, 4.7, 4.29, 4.19, settle]
    config = {"model_type": "llama", "vocab_size": 2048}
    verdict = audit_state(tmp_path / "lr", history(loss, 0.3), config)
    [finding] = findings(verdict, "LOOP-20")
    assert (finding["severity"], finding["step"]) == ("fail", 7)
    assert finding["evidence"]["last_step"] == 9 and "destroyed" in finding["message"]
    clean = np.r_[7.62, 7.35, 7.0, 6.6, 6.0, 5.5, falling(34, 5.2, 2.0, noise=0.02)]
    assert findings(audit_state(tmp_path / "clean", history(clean, 3e-3), config), "LOOP-20") == []


def test_a_pretrained_model_starting_above_what_token_frequencies_score_warns(tmp_path):
    # A QLoRA run of a chat model (ln 32000 = 10.37) whose first window logs 8.34, then 1.26, 0.50, 0.43.
    config = {"model_type": "llama", "vocab_size": 32000, "_name_or_path": "TinyLlama/TinyLlama-1.1B-Chat-v1.0"}
    verdict = audit_state(tmp_path / "pad", history([8.3368, 1.2565, 0.4951, 0.427], 1.6e-4, every=10), config)
    [finding] = findings(verdict, "LOOP-20")
    assert (finding["severity"], finding["step"]) == ("warn", 1) and "token frequencies" in finding["message"]
    clean = audit_state(tmp_path / "clean", history([2.31, 1.2565, 0.4951, 0.427], 1.6e-4, every=10), config)
    assert findings(clean, "LOOP-20") == []


def test_without_a_chance_level_or_with_a_loss_that_is_no_single_cross_entropy_it_is_not_judged(tmp_path):
    verdict = audited(trainer_run(tmp_path / "novocab", [10.8, 10.8, 10.8]))
    assert status(verdict, "LOOP-20") == (
        "not_run",
        "the vocabulary size is unknown (no model config.json, tokenizer or checkpoint header)",
    )
    # A multi-head model logs its loss as the sum of 7 per-head losses: above ln V by construction.
    heads = {f"train/ploss_{k}": np.full(5, 3.5) for k in range(7)}
    verdict = audited(trainer_run(tmp_path / "heads", np.full(5, 24.5), keys=heads, config=GPT2))
    assert status(verdict, "LOOP-20")[0] == "not_run" and "train/ploss_0" in status(verdict, "LOOP-20")[1]
    # A DPO loss starts at ln 2 by construction: no chance collapse, whatever the vocabulary.
    dpo = {"rewards/margins": np.zeros(5), "logps/chosen": np.full(5, -200.0)}
    verdict = audited(trainer_run(tmp_path / "dpo", np.full(5, 0.6931), keys=dpo, config={"vocab_size": 2}))
    assert (
        status(verdict, "LOOP-20")[0] == "not_run" and "ln 2 = 0.693 by construction" in status(verdict, "LOOP-20")[1]
    )


def _adapter_run(run_dir, first_loss, adapter=True):
    """A QLoRA output folder as one was found: adapter_config.json, a tokenizer saved as tokenizer.json and
    special_tokens_map.json only (no tokenizer_config.json, no config.json), and the log."""
    from fixtures import build_tokenizer

    state_run(run_dir, history([first_loss, 1.2565, 0.4951, 0.427], 1.6e-4, every=10))
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(str(run_dir))
    (run_dir / "tokenizer_config.json").unlink()
    specials = {"eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token, "bos_token": tokenizer.bos_token}
    (run_dir / "special_tokens_map.json").write_text(json.dumps(specials))
    if adapter:
        (run_dir / "adapter_config.json").write_text(
            json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "org/chat-model"})
        )
    return audited(run_dir)


def test_an_adapter_runs_tokenizer_json_alone_gives_the_vocabulary_and_its_adapter_config_the_pretraining(tmp_path):
    # The fixture tokenizer: V = 2048, ln V = 7.62; a first window at 80% of it, then a fast fall.
    verdict = _adapter_run(tmp_path / "pad", 0.8 * math.log(2048))
    assert status(verdict, "LOOP-02") == ("ran", None)
    [finding] = findings(verdict, "LOOP-20")
    assert (finding["severity"], finding["step"]) == ("warn", 1) and "an adapter on org/chat-model" in finding[
        "message"
    ]
    assert findings(_adapter_run(tmp_path / "clean", 2.31), "LOOP-20") == []
    # Without the adapter's word that the model was pretrained, a first window near chance is no finding.
    assert findings(_adapter_run(tmp_path / "scratch", 0.8 * math.log(2048), adapter=False), "LOOP-20") == []
