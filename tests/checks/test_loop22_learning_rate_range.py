"""LOOP-22: a learning rate far outside what any fine-tune uses with its optimizer, or 0 throughout; ordinary
rates, P-tuning's high one included, stay silent."""

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
