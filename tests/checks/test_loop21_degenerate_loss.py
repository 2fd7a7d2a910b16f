"""LOOP-21: a loss of exactly 0, or one value repeated, for a stretch; a loss that the log's rounding brings to 0
or to a repeated few-quanta value stays silent."""

import numpy as np

from .logged_runs import audited, falling, findings, status, trainer_run


def test_a_loss_of_exactly_0_from_step_20_fails_at_its_logging_window(tmp_path):
    # QLoRA's shape: 0.0328 at step 10, then 0.0 at every log to step 1000.
    verdict = audited(trainer_run(tmp_path / "zero", [0.0328] + [0.0] * 99, every=10, decimals=4))
    [finding] = findings(verdict, "LOOP-21")
    assert (finding["severity"], finding["step"]) == ("fail", 11)
    assert finding["evidence"]["first_step"] == 20 and finding["evidence"]["last_step"] == 1000
    assert finding["evidence"]["loss_before"] == 0.0328 and finding["evidence"]["log_quantum"] == 1e-4
    assert "exactly 0 from step 20 to step 1000" in finding["message"]


def test_a_loss_converging_to_0_at_4_decimals_is_rounding_not_degeneracy(tmp_path):
    # A memorising Whisper fine-tune: 0.3 down to 0.0001 and below, logged at 4 decimals (0.0002, 0.0001, 0.0).
    loss = np.r_[falling(150, 0.3, 0.0005, noise=0.05, seed=1), np.full(20, 0.00012), np.full(10, 0.00004)]
    verdict = audited(trainer_run(tmp_path / "converged", loss, every=25, decimals=4))
    assert findings(verdict, "LOOP-21") == []


def test_one_value_repeated_fails_and_a_few_quanta_plateau_does_not(tmp_path):
    loss = [1.637, 11.8069, 11.6046, 10.3829] + [10.3735] * 6
    [finding] = findings(audited(trainer_run(tmp_path / "constant", loss, lr=5.0, decimals=4)), "LOOP-21")
    assert (finding["severity"], finding["step"]) == ("fail", 5) and finding["evidence"]["logged_steps"] == 6
    assert "10.3735 at every logged step from step 5 to step 10" in finding["message"]
    # 0.0005 sixteen times at 4 decimals: five rounding steps cannot show a model moving.
    plateau = np.r_[falling(80, 0.4, 0.0006, noise=0.05, seed=2), np.full(16, 0.0005), falling(20, 0.0005, 0.0003)]
    assert findings(audited(trainer_run(tmp_path / "plateau", plateau, every=25, decimals=4)), "LOOP-21") == []


def test_an_unrounded_ordinary_loss_never_repeats_and_grpo_is_not_judged(tmp_path):
    assert findings(audited(trainer_run(tmp_path / "clean", falling(200))), "LOOP-21") == []
    verdict = audited(trainer_run(tmp_path / "grpo", np.zeros(20), keys={"kl": np.zeros(20), "reward": np.ones(20)}))
    assert status(verdict, "LOOP-21")[0] == "not_run"


def test_a_dpo_loss_of_0_in_its_last_two_of_four_windows_fails_naming_the_growing_margin(tmp_path):
    from .curve_runs import audit_state, history

    entries = history(
        [0.6931, 0.1628, 0.0, 0.0],
        2.5e-5,
        [1628.4, 0.0139, 1.7e-08, 8.1e-08],
        keys={"rewards/margins": [0.0, 26.73, 119.6, 141.7], "logps/rejected": [-433.1, -631.7, -1540.5, -1784.1]},
    )
    for e, step in zip(entries, (1, 10, 20, 30)):
        e["step"] = step
    [finding] = findings(audit_state(tmp_path / "dpo", entries), "LOOP-21")
    assert (finding["severity"], finding["step"]) == ("fail", 11)  # the logging window of step 20
    assert finding["evidence"]["through_end"] is True and finding["evidence"]["margin_before"] == 26.73
    assert "reward margin grew to 141.7" in finding["message"]
    for e, loss in zip(entries, (0.6931, 0.3628, 0.2712, 0.2418)):
        e["loss"] = loss
    assert findings(audit_state(tmp_path / "clean", entries), "LOOP-21") == []


def test_a_zero_loss_beside_a_zero_gradient_norm_names_the_missing_gradient(tmp_path):
    from .curve_runs import audit_state, history

    [finding] = findings(
        audit_state(tmp_path / "zero", history(np.zeros(100), 2e-4, np.zeros(100), every=10)), "LOOP-21"
    )
    assert (finding["step"], finding["evidence"]["last_step"]) == (1, 1000)
    assert "through the end of the run" in finding["message"] and "so is the gradient norm" in finding["message"]
    assert "logging_nan_inf_filter" not in finding["message"]
    nan_norm = audit_state(tmp_path / "nan", history([0.03] + [0.0] * 99, 2e-4, [0.5] + [np.nan] * 99, every=10))
    [finding] = findings(nan_norm, "LOOP-21")
    assert (finding["severity"], finding["step"]) == ("fail", 11)
    assert "non-finite gradient norm beside it" in finding["message"]
    clean = audit_state(tmp_path / "clean", history(falling(100), 2e-4, np.full(100, 0.5), every=10))
    assert findings(clean, "LOOP-21") == []


def test_a_short_log_ending_in_two_zero_windows_fails_and_its_twin_does_not(tmp_path):
    # 4 logged windows of 25 steps: 2 zeros through the end are all a short log can show; 2 zeros inside a
    # longer log that trains on after them are not enough.
    [finding] = findings(audited(trainer_run(tmp_path / "short", [1.9, 1.2, 0.0, 0.0], every=25)), "LOOP-21")
    assert (finding["severity"], finding["step"]) == ("fail", 51) and finding["evidence"]["through_end"] is True
    assert "from step 75 to step 100" in finding["message"]
    assert findings(audited(trainer_run(tmp_path / "twin", [1.9, 1.2, 0.93, 0.88], every=25)), "LOOP-21") == []
    inside = np.r_[falling(20), 0.0, 0.0, falling(20, 0.8, 0.7)]
    assert findings(audited(trainer_run(tmp_path / "inside", inside, every=25)), "LOOP-21") == []


def test_a_negative_cross_entropy_warns_at_its_first_step_and_a_positive_twin_is_silent(tmp_path):
    loss = np.r_[falling(50, 0.46, 0.0, noise=0.0), np.full(10, 0.0002)]
    loss = np.round(loss, 4)
    loss[55] = -0.0001
    [finding] = findings(audited(trainer_run(tmp_path / "negative", loss, decimals=4)), "LOOP-21")
    assert (finding["severity"], finding["step"]) == ("warn", 56) and "negative" in finding["message"]
    loss[55] = 0.0001
    assert findings(audited(trainer_run(tmp_path / "positive", loss, decimals=4)), "LOOP-21") == []


def test_a_noisy_low_loss_falling_to_0_for_3_windows_fails_and_its_twin_does_not(tmp_path):
    # Whisper's shape: 4-decimal loss near 0.15 with 40% relative noise per window. A loss that noisy is no
    # closer to a rounded 0 (under 0.00005, a factor of 3,000 below it) than a quiet one.
    rng = np.random.default_rng(11)
    loss = np.round(0.15 * np.exp(0.4 * rng.standard_normal(60)), 4)
    zeroed = loss.copy()
    zeroed[30:33] = 0.0
    [finding] = findings(audited(trainer_run(tmp_path / "zero", zeroed, every=100, decimals=4)), "LOOP-21")
    assert (finding["severity"], finding["step"]) == ("fail", 3001) and finding["evidence"]["last_step"] == 3300
    assert findings(audited(trainer_run(tmp_path / "clean", loss, every=100, decimals=4)), "LOOP-21") == []
