"""LOOP-22: a learning rate far outside what any fine-tune uses with its optimizer, or 0 throughout; ordinary
rates, P-tuning's high one included, stay silent."""

import pytest

from .logged_runs import audited, falling, findings, status, trainer_run


def test_lr_5_for_adamw_fails_as_a_configuration_and_ordinary_rates_pass(tmp_path):
    verdict = audited(trainer_run(tmp_path / "lr5", falling(10), lr=5.0))
    [finding] = findings(verdict, "LOOP-22")
    assert (finding["severity"], finding["category"], finding["step"]) == ("fail", "configuration", None)
    assert finding["evidence"]["optimizer"] == "adamw_torch" and finding["evidence"]["optimizer_assumed"] is True
    assert "the Trainer's default" in finding["message"]
    for lr in (2e-5, 2e-4, 2e-2):  # full fine-tune, LoRA, P-tuning v2's prefix encoder
        assert findings(audited(trainer_run(tmp_path / f"lr{lr}", falling(10), lr=lr)), "LOOP-22") == []


def test_a_rate_above_the_range_warns_and_a_rate_of_0_throughout_fails(tmp_path):
    [warn] = findings(audited(trainer_run(tmp_path / "high", falling(10), lr=0.5)), "LOOP-22")
    assert warn["severity"] == "warn" and warn["evidence"]["threshold"] == 0.1
    [zero] = findings(audited(trainer_run(tmp_path / "zero", falling(10), lr=0.0)), "LOOP-22")
    assert zero["severity"] == "fail" and "nothing is trained" in zero["message"]


def test_a_log_without_a_learning_rate_is_not_judged(tmp_path):
    run_dir = trainer_run(tmp_path / "nolr", falling(10))
    state = (run_dir / "trainer_state.json").read_text().replace('"learning_rate": 0.0002, ', "")
    (run_dir / "trainer_state.json").write_text(state)
    assert status(audited(run_dir), "LOOP-22") == ("not_run", "no learning rate logged")


def test_the_optimizer_is_read_through_its_wrappers():
    """The Trainer records accelerate's AcceleratedOptimizer (transformers 4.45 and 5 alike): the family is
    the wrapped optimizer's (recorded inside it) or the run's configured `optim`, never "unknown"."""
    from sftaudit.checks.loop22_learning_rate_range import optimizer_family, optimizer_name

    trainer = {"config": {"training_args": {"optim": "adamw_torch_fused"}}}
    assert optimizer_name({"optimizer": {"class": "AcceleratedOptimizer"}, **trainer}) == ("adamw_torch_fused", False)
    recorded_inside = {"class": "AcceleratedOptimizer", "optimizer": {"class": "SGD"}}
    assert optimizer_name({"optimizer": recorded_inside, **trainer}) == ("SGD", False)
    assert optimizer_name({"optimizer": {"class": "DeepSpeedZeroOptimizer_Stage3", "inner_class": "FusedAdam"}}) == (
        "FusedAdam",
        False,
    )
    assert optimizer_name({"optimizer": {"class": "AdamW"}}) == ("AdamW", False)  # a plain loop's, unwrapped
    # The shim reading through the wrappers: the stepping class, the wrappers beside it.
    through = {"class": "AdamW", "module": "torch.optim.adamw", "wrappers": ["AcceleratedOptimizer"], "groups": []}
    assert optimizer_name({"optimizer": through, **trainer}) == ("AdamW", False)
    # Only the wrapper, no config (a hand-written accelerate loop): the Trainer's default, said to be assumed,
    # as the same run's logs alone are judged.
    assert optimizer_name({"optimizer": {"class": "AcceleratedOptimizer"}}) == ("adamw_torch", True)
    assert optimizer_name({"optimizer": {"class": "MyOwnOptimizer"}}) == ("MyOwnOptimizer", False)
    assert optimizer_family("AcceleratedOptimizer") is None and optimizer_family("adamw_torch_fused") == "adam"


@pytest.mark.slow
def test_a_recorded_trainer_run_at_lr_0_3_is_judged_and_named(tmp_path, tokenizer_cache):
    """A Trainer run recorded by the callback (its manifest names AcceleratedOptimizer): LOOP-22 runs and names
    the learning rate, as it does on the same run's logs alone."""
    from sftaudit.fixtures.train import train_hf

    from sftaudit.verdict.audit import audit

    run = train_hf(
        tmp_path / "hf-lr",
        steps=4,
        save_steps=4,
        lr=0.3,
        batch_size=4,
        max_length=64,
        tokenizer_cache=tokenizer_cache,
        probe_every=0,
        generate_every=0,
        eval_every=0,
    )
    verdict = audit(run)
    assert status(verdict, "LOOP-22") == ("ran", None)
    [finding] = findings(verdict, "LOOP-22")
    assert (finding["severity"], finding["category"]) == ("warn", "configuration")
    assert finding["evidence"]["optimizer"].startswith("adamw") and not finding["evidence"]["optimizer_assumed"]
    assert "peak learning rate 0.3" in finding["message"]
