"""LOOP-10: a learning-rate jump; loss spikes judged against the run's own noise (batch size, rounding, loss
family); clean runs stay silent."""

import numpy as np

from sftaudit.store.rundb import connect
from sftaudit.verdict.audit import audit
from sftaudit.verdict.config import AuditConfig

from .dynamics_runs import LR_JUMP_STEP, of, recorded_series_run, run
from .logged_runs import audited, falling, findings, linear_schedule, trainer_run


def test_learning_rate_jump_warns_at_its_step_and_the_divergence_after_it_is_loop19s(runs):
    verdict = audit(run(runs, "lr_jump"))
    [jump] = of(verdict, "LOOP-10")
    assert (jump["severity"], jump["step"]) == ("warn", LR_JUMP_STEP)
    assert jump["evidence"]["value"] > 10 and "learning rate" in jump["message"]
    assert verdict["first_anomalous_step"] == LR_JUMP_STEP
    # LOOP-14 sees the same step leave the configured schedule; LOOP-19 fails the rise after it.
    chain = verdict["first_anomaly_chain"]
    assert any(c["code"] == "LOOP-14" and c["step"] == LR_JUMP_STEP for c in chain)
    assert any(c["code"] == "LOOP-19" and c["step"] == LR_JUMP_STEP + 1 for c in chain)


def test_clean_runs_raise_nothing(clean_run, runs):
    for run_dir in (clean_run, run(runs, "clean_probed")):
        verdict = audit(run_dir)
        assert of(verdict, "LOOP-10") == []


def test_overfitting_warns_when_validation_loss_turns_up_while_training_loss_falls(runs):
    run_dir = runs(
        "memorize",
        steps=45,
        checkpoint_every=0,
        eval_loss_every=3,
        faults={"memorize_from": 10},
        probe_every=0,
        generate_every=0,
        eval_every=0,
    )
    verdict = audit(run_dir)
    assert verdict["check_errors"] == []
    gaps = [f for f in of(verdict, "LOOP-10") if "validation loss" in f["message"]]
    assert len(gaps) == 1 and gaps[0]["severity"] == "warn"
    # Independently of the check: the first of three consecutive rises of the logged eval_loss.
    con = connect(run_dir, read_only=True)
    evals = con.execute("SELECT step, value FROM metrics WHERE name = 'eval_loss' ORDER BY step").fetchall()
    rising = [b[0] for a, b in zip(evals, evals[1:]) if b[1] > a[1]]
    first = next(s for s in rising if all(s + 3 * k in rising for k in range(3)))
    assert gaps[0]["step"] == first and first > 10  # the memorising starts at 10, held-out loss turns later
    assert gaps[0]["evidence"]["eval_loss"] == sorted(gaps[0]["evidence"]["eval_loss"])


# The sweep's clean-06 (plain loop, Adafactor, lr 1e-3, GA 4 of 2 rows, 200 steps): the loss of steps 133-200,
# as recorded. Steps 181-192 happened to be calm (sigma 0.018 where the run's batch-to-batch noise is ~0.05), so
# the ordinary 1.045 of step 194 read z 7 against that block alone: a false alarm.
CONVERGED_LOSS = [
    1.151,
    1.141,
    1.201,
    1.268,
    1.21,
    1.143,
    1.201,
    1.169,
    1.177,
    1.146,
    1.243,
    1.154,
    1.176,
    1.037,
    1.11,
    1.122,
    1.199,
    1.131,
    1.105,
    1.159,
    0.9846,
    1.05,
    1.076,
    1.079,
    1.073,
    1.062,
    1.148,
    1.062,
    1.039,
    0.9751,
    1.049,
    0.9713,
    1.005,
    1.048,
    0.9683,
    1.2,
    0.9746,
    1.042,
    1.045,
    1.037,
    1.053,
    0.9964,
    1.045,
    0.9609,
    1.057,
    0.9884,
    0.974,
    0.937,
    0.8699,
    1.123,
    0.8903,
    0.9217,
    0.9262,
    0.9268,
    0.9019,
    0.9128,
    0.9043,
    0.98,
    0.819,
    0.9197,
    0.8985,
    1.045,
    0.939,
    0.9503,
    0.9719,
    0.9063,
    0.9073,
    0.9097,
]


def test_one_calm_block_of_a_converged_run_does_not_make_batch_noise_a_spike(tmp_path):
    steps = len(CONVERGED_LOSS)
    norms = np.ones((steps, 1))
    run_dir = recorded_series_run(tmp_path / "converged", [1e-3] * steps, CONVERGED_LOSS, norms, ["lm_head.weight"])
    # The 200-step run's window (12); the series starts at step 133, a block boundary of that run.
    verdict = audit(run_dir, AuditConfig(check_options={"LOOP-10": {"window": 12}}))
    assert of(verdict, "LOOP-10") == []
    # A real spike (x1.5 of the running loss, a garbage batch) at the same step is still found.
    spiked = list(CONVERGED_LOSS)
    spiked[61] = 1.5 * 0.92
    run_dir = recorded_series_run(tmp_path / "spiked", [1e-3] * steps, spiked, norms, ["lm_head.weight"])
    [finding] = of(audit(run_dir, AuditConfig(check_options={"LOOP-10": {"window": 12}})), "LOOP-10")
    assert (finding["severity"], finding["step"]) == ("warn", 62)


def test_a_linear_decay_reaching_zero_at_the_last_step_is_no_jump(tmp_path):
    """The Trainer's linear schedule ends at lr 0: on a short run the last step's ratio is 0 while the
    LR before it is still above 1% of the peak. A restart of the warmup in the middle still warns."""
    steps = 60
    lr = [3e-4 * (1 - s / steps) for s in range(1, steps + 1)]  # lr after each step's scheduler step
    loss = list(np.linspace(7.0, 5.0, steps))
    norms = np.ones((steps, 1))
    run_dir = recorded_series_run(tmp_path / "decay", lr, loss, norms, ["lm_head.weight"])
    assert lr[-1] == 0 and not [f for f in of(audit(run_dir), "LOOP-10") if "learning rate" in f["message"]]
    restarted = lr[:40] + [3e-4 * k / 10 for k in range(20)]  # the warmup restarting at step 41: 0 first
    run_dir = recorded_series_run(tmp_path / "restarted", restarted, loss, norms, ["lm_head.weight"])
    [jump] = [f for f in of(audit(run_dir), "LOOP-10") if "learning rate" in f["message"]]
    assert (jump["severity"], jump["step"]) == ("warn", 41)


def test_an_imported_runs_learning_rate_restart_is_loop14s_alone_and_a_recorded_one_stays_loop10s(tmp_path):
    """A logged schedule restarting its warm-up at step 60 (a resume with a fresh scheduler): LOOP-14 judges it
    against the plan and names the cause; LOOP-10 does not report it a second time. The same LR recorded by the
    shim still warns at LOOP-10 (no plan from logs there)."""
    steps = np.arange(1, 121)
    lr = linear_schedule(steps, 2e-4, 10, 120)
    restarted = np.where(steps < 60, lr, linear_schedule(steps - 60, 2e-4, 10, 120))
    verdict = audited(trainer_run(tmp_path / "imported", falling(120), lr=restarted))
    assert [f["step"] for f in findings(verdict, "LOOP-14")] == [60]
    assert [f for f in findings(verdict, "LOOP-10") if "learning rate" in f["message"]] == []
    recorded = recorded_series_run(
        tmp_path / "recorded", restarted, falling(120), np.ones((120, 1)), ["lm_head.weight"]
    )
    [jump] = [f for f in of(audit(recorded), "LOOP-10") if "learning rate" in f["message"]]
    assert (jump["severity"], jump["step"]) == ("warn", 60)


def _spiky(loss, at, factor):
    out = np.array(loss, dtype=float)
    out[at] *= factor
    return out


def test_a_per_step_log_of_2_rows_is_noisy_not_spiky_and_a_garbage_batch_still_spikes(tmp_path):
    # Per-step loss of 2 rows, per-row losses spread e^+-0.8: one hard row doubles the step's mean (the old
    # 1%-of-median floor read 9 of these as spikes).
    rng = np.random.default_rng(4)
    n = 3000
    level = 0.1 + 2.0 * np.exp(-np.arange(n) / 600)
    loss = (level[:, None] * rng.lognormal(-0.32, 0.8, (n, 2))).mean(axis=1)
    assert (
        findings(
            audited(trainer_run(tmp_path / "batch2", loss, decimals=4, train_batch_size=2)), "LOOP-10", ("warn", "fail")
        )
        == []
    )
    # A batch of garbage text (loss near ln V, 100x the converged level): found at its step.
    [spike] = findings(
        audited(trainer_run(tmp_path / "garbage", _spiky(loss, 2400, 100.0), decimals=4, train_batch_size=2)),
        "LOOP-10",
        ("warn",),
    )
    assert spike["step"] == 2401 and spike["evidence"]["rows_per_log"] == 2


def test_a_log_rounded_to_4_decimals_near_0_has_no_one_quantum_spikes(tmp_path):
    # A memorising Whisper run: 0.0001 and 0.0002 alternate; one rounding step is not a doubling of the loss.
    rng = np.random.default_rng(5)
    loss = np.r_[np.linspace(0.3, 0.001, 100), rng.choice([0.0001, 0.0001, 0.0001, 0.0002], 100)]
    verdict = audited(trainer_run(tmp_path / "rounded", loss, every=25, decimals=4))
    spikes = findings(verdict, "LOOP-10", ("warn", "fail"))
    assert [f for f in spikes if "spiked" in f["message"]] == []


def test_a_dpo_per_step_loss_is_heavy_tailed_not_spiky(tmp_path):
    # DPO on 3 pairs per step: the mean of softplus(-margin), margins growing as the policy learns.
    rng = np.random.default_rng(6)
    n = 400
    margins = np.linspace(0, 6, n)[:, None] + 2.5 * rng.standard_normal((n, 3))
    loss = np.log1p(np.exp(-margins)).mean(axis=1)
    keys = {"rewards/margins": margins.mean(axis=1), "logps/chosen": np.full(n, -250.0)}
    verdict = audited(trainer_run(tmp_path / "dpo", loss, lr=5e-6, keys=keys, decimals=4, train_batch_size=3))
    assert findings(verdict, "LOOP-10", ("warn", "fail")) == []
    assert findings(verdict, "LOOP-19") == []


def test_benjamini_hochberg_on_the_tested_p_values_equals_scipy_on_all_of_them():
    """LOOP-10 corrects only the p-values it tested; the untested ones are 1, so the q-values of the tested
    ones equal scipy's over the full array."""
    from scipy import stats

    from sftaudit.checks.loop10_drift import _benjamini_hochberg

    rng = np.random.default_rng(3)
    for _ in range(20):
        p = np.ones(300)
        tested = rng.choice(300, rng.integers(1, 60), replace=False)
        p[tested] = rng.random(tested.size) ** 4
        np.testing.assert_allclose(
            _benjamini_hochberg(p[tested], p.size), stats.false_discovery_control(p, method="bh")[tested]
        )


# A newcomer's recorded run at learning rate 0.3 (100x too high), 40 steps of the 2,048-token fixture model from
# scratch: 6.0 -> 4.2 -> 11.3 -> 12.05 at steps 5-8, then back down past 4.29 and 4.19 (steps 14-15) to ~3.8.
SETTLE = [4.07, 4.02, 3.98, 3.99, 3.93, 3.95, 3.9, 3.91, 3.87, 3.9, 3.86, 3.84, 3.86, 3.83, 3.85, 3.82, 3.84, 3.81]
LR_03 = [7.62, 7.35, 7.0, 6.6, 6.0, 4.2, 11.3, 12.05, 9.6, 7.4, 6.1, 5.2, 4.7, 4.29, 4.19, 4.16, 4.12] + SETTLE
LR_03 = LR_03 + [3.8 + 0.02 * (k % 3) for k in range(40 - len(LR_03))]


def test_a_x3_jump_early_in_a_40_step_recording_is_found_and_the_dip_after_it_never_is(tmp_path):
    norms = np.ones((40, 1))
    lr = [0.3 * min(1.0, (s + 1) / 5) for s in range(40)]
    run_dir = recorded_series_run(tmp_path / "lr03", lr, LR_03, norms, ["lm_head.weight"], {"vocab_size": 2048})
    verdict = audit(run_dir)
    spikes = of(verdict, "LOOP-10")
    assert [(f["severity"], f["step"]) for f in spikes] == [("warn", 7)]  # the jump; never step 15's 4.19 < 4.29
    assert spikes[0]["evidence"]["effect_size"] > 1.5 and spikes[0]["evidence"]["z"] > 10
    # An update that sent the loss above chance (ln 2048 = 7.62) and kept it there wrecked the run: a fail.
    [wrecked] = of(verdict, "LOOP-20")
    assert (wrecked["severity"], wrecked["step"]) == ("fail", 7)
    assert verdict["first_anomalous_step"] == 7  # (no batches recorded: the verdict itself is unjudged)
    clean = [7.62, 7.35, 7.0, 6.6, 6.0, 5.6] + list(np.linspace(5.3, 2.0, 34) + 0.03 * np.sin(np.arange(34)))
    run_dir = recorded_series_run(tmp_path / "clean", lr, clean, norms, ["lm_head.weight"], {"vocab_size": 2048})
    verdict = audit(run_dir)
    assert of(verdict, "LOOP-10") == [] and of(verdict, "LOOP-19") == [] and of(verdict, "LOOP-20") == []


def test_a_spike_in_the_first_steps_of_a_long_log_is_judged_like_any_other(tmp_path):
    rng = np.random.default_rng(11)
    n = 2000
    loss = (0.4 + 1.7 * np.exp(-np.arange(n) / 10)) * np.exp(0.05 * rng.standard_normal(n))
    spiked = loss.copy()
    spiked[14] *= 2.0  # step 15: no block of history behind it yet
    [spike] = findings(audited(trainer_run(tmp_path / "early", spiked)), "LOOP-10", ("warn", "fail"))
    assert (spike["severity"], spike["step"]) == ("warn", 15)
    assert findings(audited(trainer_run(tmp_path / "clean", loss)), "LOOP-10", ("warn", "fail")) == []


# A seq2seq log of 10 windows of 500 steps, falling fast (the cpt-seq2seq run's shape): the median of the values
# before a window lags a level that halves in a few windows, so a x3 window is judged against its neighbours.
SEQ2SEQ = [1.1409, 0.6419, 0.5212, 0.4477, 0.3979, 0.3643, 0.3238, 0.2993, 0.2735, 0.2645]


def test_a_lone_window_over_both_neighbours_of_a_fast_falling_short_log_is_a_peak(tmp_path):
    [peak] = findings(
        audited(trainer_run(tmp_path / "peak", _spiky(SEQ2SEQ, 3, 3.0), every=500)), "LOOP-10", ("warn", "fail")
    )
    assert (peak["rule"], peak["severity"], peak["step"]) == ("LOOP-10/loss-peak", "warn", 1501)  # its window
    assert peak["evidence"]["over_neighbours"] > 2 and peak["evidence"]["z"] >= peak["evidence"]["threshold"]
    assert findings(audited(trainer_run(tmp_path / "clean", SEQ2SEQ, every=500)), "LOOP-10", ("warn", "fail")) == []


def test_a_window_far_above_the_rest_of_a_6_window_log_is_a_peak_and_noise_of_a_short_log_is_not(tmp_path):
    # GPT-2 from TensorBoard, 6 logs every 500 steps: no noise estimate, so the rest of the log is the bound.
    short = [0.4742, 0.0261, 0.0141, 0.0109, 0.0089, 0.0081]
    [peak] = findings(
        audited(trainer_run(tmp_path / "peak", _spiky(short, 2, 3.0), every=500)), "LOOP-10", ("warn", "fail")
    )
    assert (peak["rule"], peak["severity"], peak["step"]) == ("LOOP-10/short-log-peak", "warn", 1001)
    assert peak["evidence"]["effect_size"] >= 1.5
    assert findings(audited(trainer_run(tmp_path / "clean", short, every=500)), "LOOP-10", ("warn", "fail")) == []
    # Five per-step values of a few rows each: 2.4 is 1.26x the highest of the others, ordinary noise.
    noisy = [2.1, 1.8, 2.4, 1.9, 1.7]
    assert findings(audited(trainer_run(tmp_path / "noisy", noisy)), "LOOP-10", ("warn", "fail")) == []


# LLaMA-Factory's 9 per-step windows of a short clean start (the lf-tiny-9steps run): smooth, falling.
TINY_START = [3.3418, 3.1575, 2.9602, 2.7927, 2.7235, 2.637, 2.4834, 2.3997, 2.3993]


def test_the_return_to_trend_after_a_dip_in_the_first_windows_is_no_spike(tmp_path):
    """A running level of fewer than 3 values is their mean: a dip among them would make the next window, back on
    trend, read as a spike. A dip is never a finding; a real spike at that window still is."""
    dipped = list(TINY_START)
    dipped[1] *= 0.5
    assert findings(audited(trainer_run(tmp_path / "dip", dipped)), "LOOP-10", ("warn", "fail")) == []
    [spike] = findings(audited(trainer_run(tmp_path / "spike", _spiky(TINY_START, 2, 3.0))), "LOOP-10", ("warn",))
    assert spike["step"] == 3


# 60 windows of a Whisper fine-tune's low loss (whisper-large-flemish-15k, steps 4100-6000): a mean of rare errors,
# its log swinging 5x between windows that hold an error and windows that hold none.
LOW_NOISY = [
    0.0596, 0.0889, 0.0699, 0.1914, 0.1299, 0.1244, 0.079, 0.0565, 0.0424, 0.0578, 0.0527, 0.0582, 0.024, 0.0562,
    0.0607, 0.0512, 0.0434, 0.0901, 0.0687, 0.0198, 0.0909, 0.0906, 0.0599, 0.0607, 0.0932, 0.0902, 0.0183, 0.0264,
    0.0254, 0.0924, 0.092, 0.0653, 0.0986, 0.1079, 0.0404, 0.0623, 0.0219, 0.0433, 0.0555, 0.0242, 0.0146, 0.0162,
    0.0422, 0.0466, 0.0264, 0.0444, 0.0785, 0.0803, 0.0507, 0.0468, 0.0714, 0.0877, 0.0888, 0.1097, 0.0995, 0.0074,
    0.0372, 0.028, 0.0528, 0.007,
]  # fmt: skip


def test_a_spike_in_a_noisy_low_loss_is_a_peak_on_its_square_root_where_its_log_swings_too_wide(tmp_path):
    [peak] = findings(
        audited(trainer_run(tmp_path / "peak", _spiky(LOW_NOISY, 33, 5.0), every=100)), "LOOP-10", ("warn", "fail")
    )
    assert (peak["rule"], peak["step"], peak["evidence"]["lens"]) == ("LOOP-10/loss-peak", 3301, "square root")
    assert "on the square root of the loss" in peak["message"]
    assert findings(audited(trainer_run(tmp_path / "clean", LOW_NOISY, every=100)), "LOOP-10", ("warn", "fail")) == []
