"""LOOP-19: a loss that rose and stayed up, against the run's own start or its running level; clean twins
stay silent."""

import numpy as np
import pytest

from sftaudit.verdict.audit import audit

from ..shared import cached_audit
from .dynamics_runs import LR_JUMP_STEP, of, run
from .logged_runs import REALRUNS, audited, falling, findings, status, trainer_run


def test_a_qlora_run_at_lr_5_diverges_at_step_2_and_its_clean_twin_does_not(tmp_path):
    # The shape of a QLoRA log at learning_rate 5: 1.637, then 11.8 at step 2, settling at a constant 10.37.
    loss = [1.637, 11.8069, 11.6046, 10.3829, 10.3735, 10.3735, 10.3735, 10.3735, 10.3735, 10.3735]
    [finding] = findings(audited(trainer_run(tmp_path / "lr5", loss, lr=5.0)), "LOOP-19")
    assert (finding["severity"], finding["step"]) == ("fail", 2)
    assert finding["evidence"]["start_loss"] == 1.637 and finding["evidence"]["peak_lr"] == 5.0
    assert "11.81 against 1.637 at the start" in finding["message"]
    clean = audited(trainer_run(tmp_path / "clean", [1.637, 1.52, 1.41, 1.38, 1.30, 1.33, 1.25, 1.22, 1.24, 1.19]))
    assert findings(clean, "LOOP-19") == []


def test_a_loss_climbing_over_the_run_fails_from_its_first_elevated_window(tmp_path):
    loss = [0.9974, 4.3459, 8.8061, 13.5352, 16.1, 18.4, 20.8277, 22.9, 25.5949, 29.559]
    verdict = audited(trainer_run(tmp_path / "climb", loss, lr=5e-3, every=10))
    [finding] = findings(verdict, "LOOP-19")
    assert finding["severity"] == "fail" and finding["step"] in (11, 21)  # the logging window of step 20 or 30
    assert verdict["first_anomalous_step"] == finding["step"]
    clean = audited(trainer_run(tmp_path / "clean", falling(10, 0.9974, 0.4, noise=0.03), lr=5e-3, every=10))
    assert findings(clean, "LOOP-19") == []


def test_an_ordinary_noisy_run_that_ends_near_its_start_is_no_divergence(tmp_path):
    # A preference loss starts at ln 2 and a weak run wanders around it: noise, not a rise.
    rng = np.random.default_rng(3)
    loss = 0.6931 * np.exp(0.05 * rng.standard_normal(60))
    loss[0] = 0.6931
    verdict = audited(trainer_run(tmp_path / "flat", loss, keys={"rewards/margins": rng.normal(0, 0.1, 60)}))
    assert findings(verdict, "LOOP-19") == []


def test_too_few_logged_points_are_not_judged(tmp_path):
    verdict = audited(trainer_run(tmp_path / "two", [2.0, 9.0], every=100))
    assert status(verdict, "LOOP-19")[0] == "not_run" and "too few" in status(verdict, "LOOP-19")[1]


def test_a_grpo_log_is_not_judged(tmp_path):
    loss = falling(30, 0.0, 0.0, noise=0.0) + np.linspace(0, 0.2, 30)
    verdict = audited(trainer_run(tmp_path / "grpo", loss, keys={"kl": np.linspace(0, 1, 30), "reward": np.ones(30)}))
    assert status(verdict, "LOOP-19")[0] == "not_run" and "policy-gradient" in status(verdict, "LOOP-19")[1]


def test_the_divergence_after_a_learning_rate_jump_fails_at_the_step_after_it(runs):
    """The shim run with its LR x100 at step 15: LOOP-10 warns of the jump, LOOP-19 fails the rise after it."""
    verdict = audit(run(runs, "lr_jump"))
    [diverged] = of(verdict, "LOOP-19")
    # The step's own update already used the new rate: the loss of the next step is the first one hit.
    assert (diverged["severity"], diverged["step"]) == ("fail", LR_JUMP_STEP + 1)
    assert diverged["evidence"]["z"] > 6 and diverged["evidence"]["p_value"] < 1e-6
    chain = verdict["first_anomaly_chain"]
    assert [c["step"] for c in chain if c["code"] in ("LOOP-10", "LOOP-19")][:2] == [LR_JUMP_STEP, LR_JUMP_STEP + 1]


def test_clean_shim_runs_do_not_diverge(clean_run):
    assert of(cached_audit(clean_run), "LOOP-19") == []


@pytest.mark.skipif(not (REALRUNS / "qlora-lr5-diverge").is_dir(), reason="../shared/realruns not present")
@pytest.mark.slow  # a real run
def test_real_diverging_qlora_runs_fail_and_a_real_clean_run_passes(tmp_path):
    import shutil

    verdicts = {}
    for name in ("qlora-lr5-diverge", "qlora-lr5e-3-diverge", "alpaca-3ep"):
        shutil.copytree(REALRUNS / name, tmp_path / name)
        verdicts[name] = audited(tmp_path / name)
    assert [f["step"] for f in findings(verdicts["qlora-lr5-diverge"], "LOOP-19")] == [2]
    assert [f["severity"] for f in findings(verdicts["qlora-lr5e-3-diverge"], "LOOP-19")] == ["fail"]
    assert findings(verdicts["alpaca-3ep"], "LOOP-19") == []


def test_a_loss_creeping_up_for_epochs_after_its_minimum_warns_and_its_clean_twin_does_not(tmp_path):
    # A seq2seq run logged every 10 steps for 3,330 steps: the loss reaches 0.0023 by step 900, then creeps up x10
    # to the end while the learning rate decays to 0.
    from .curve_runs import audit_state, history

    n = 333
    rng = np.random.default_rng(7)
    lr = np.r_[np.linspace(1e-6, 5e-5, 50), np.linspace(5e-5, 0, n - 50)]
    base = 0.0023 + 0.026 * np.exp(-np.arange(n) / 15)
    creep = np.where(np.arange(n) > 90, np.exp(np.log(10) * (np.arange(n) - 90) / (n - 90)), 1.0)
    noise = np.exp(0.12 * rng.standard_normal(n))
    verdict = audit_state(tmp_path / "creep", history(np.round(base * creep * noise, 4), lr, every=10))
    [finding] = findings(verdict, "LOOP-19")
    assert finding["severity"] == "warn" and 900 < finding["step"] < 3000  # the creep starts at step 910
    assert finding["evidence"]["to_end"] is True and "learning rate decayed" in finding["message"]
    assert 600 <= finding["evidence"]["minimum_step"] <= 1500
    clean = audit_state(tmp_path / "clean", history(np.round(base * noise, 4), lr, every=10))
    assert findings(clean, "LOOP-19") == []


def test_a_loss_rising_with_the_learning_rate_warm_up_warns_naming_the_learning_rate(tmp_path):
    # Whisper at peak LR 1e-4 (warm-up over 500 of 1,500 steps): 0.12 at step 125 up to 0.31 at the peak LR,
    # then down to 0.18.
    from .curve_runs import audit_state, history

    rng = np.random.default_rng(8)
    t = np.arange(60)
    lr = np.minimum((t + 1) / 20, 1.0) * 1e-4
    fall = 0.12 + 0.7 * np.exp(-t / 1.5)
    bump = 0.19 * np.clip((t - 5) / 15, 0, 1) * np.clip((45 - t) / 5, 0, 1) * (t < 45) + 0.06 * (t >= 45)
    noise = np.exp(0.04 * rng.standard_normal(60))
    [finding] = findings(audit_state(tmp_path / "rise", history((fall + bump) * noise, lr, every=25)), "LOOP-19")
    assert finding["severity"] == "warn" and "learning rate rose" in finding["message"]
    assert 125 < finding["step"] <= 500 and finding["evidence"]["to_end"] is False
    clean = audit_state(tmp_path / "clean", history(fall * noise, lr, every=25))
    assert findings(clean, "LOOP-19") == []


def test_a_x3_jump_that_takes_five_logged_steps_to_come_down_fails_at_the_jump(tmp_path):
    loss = falling(80, 2.0, 0.8, noise=0.03, seed=9)
    jumped = loss.copy()
    jumped[40:46] *= [3.0, 2.8, 2.4, 2.0, 1.6, 1.3]
    [finding] = findings(audited(trainer_run(tmp_path / "jump", jumped)), "LOOP-19")
    assert (finding["severity"], finding["step"]) == ("fail", 41) and finding["evidence"]["through_end"] is False
    # Back within two logged steps: a spike (LOOP-10's warn), no divergence.
    spiked = loss.copy()
    spiked[40:42] *= [3.0, 1.5]
    verdict = audited(trainer_run(tmp_path / "spike", spiked))
    assert findings(verdict, "LOOP-19") == []
    assert [(f["severity"], f["step"]) for f in findings(verdict, "LOOP-10", ("warn",))] == [("warn", 41)]


def test_a_dip_of_one_or_two_logged_steps_is_never_a_spike_or_a_divergence(tmp_path):
    loss = falling(80, 2.0, 0.8, noise=0.03, seed=9)
    dipped = loss.copy()
    dipped[40:42] /= 3
    dipped[60] /= 10
    verdict = audited(trainer_run(tmp_path / "dip", dipped))
    assert findings(verdict, "LOOP-19") == [] and findings(verdict, "LOOP-10", ("warn", "fail")) == []


def test_the_loss_coming_back_after_a_dip_of_three_logged_steps_is_no_divergence(tmp_path):
    # The running level sinks into the dip; the loss returning to where it was is no rise. A jump of x1.6 after
    # the same dip (above the level before it, below the start) still diverged there.
    dipped = falling(80, 2.0, 0.8, noise=0.03, seed=9)
    dipped[40:43] /= 3
    assert findings(audited(trainer_run(tmp_path / "dip", dipped)), "LOOP-19") == []
    jumped = dipped.copy()
    jumped[43:] *= 1.6
    [finding] = findings(audited(trainer_run(tmp_path / "jump", jumped)), "LOOP-19")
    assert (finding["rule"], finding["severity"], finding["step"]) == ("LOOP-19/diverged", "fail", 44)


def test_a_creep_that_ends_above_the_first_logged_loss_fails_and_one_that_ends_below_it_warns(tmp_path):
    # Falls 2.0 -> 0.5 over 60 logged steps, then climbs for 60 more: to 3.0 (above the start: the run is
    # worse than the model it started from) or to 1.0 (a climb from its best, still below the start).
    base = falling(120, 2.0, 0.5, noise=0.03, seed=4)
    base[60:] = 0.5 * np.exp(0.03 * np.random.default_rng(5).standard_normal(60))
    ramp = np.clip((np.arange(120) - 60) / 59, 0, 1)
    worse = audited(trainer_run(tmp_path / "worse", base * np.exp(np.log(6.0) * ramp), every=10))
    # The fail where it passed the start; the trend dated where the climb got under way, before it.
    trend, finding = findings(worse, "LOOP-19")
    assert finding["severity"] == "fail" and 610 <= finding["step"] <= 1200
    assert finding["evidence"]["start_loss"] == pytest.approx(base[0])
    assert (trend["rule"], trend["severity"]) == ("LOOP-19/trend", "warn") and 610 <= trend["step"] < finding["step"]
    creep = audited(trainer_run(tmp_path / "creep", base * np.exp(np.log(2.0) * ramp), every=10))
    [finding] = findings(creep, "LOOP-19")
    assert finding["severity"] == "warn" and 610 <= finding["step"] <= 1200
    assert findings(audited(trainer_run(tmp_path / "clean", base, every=10)), "LOOP-19") == []


def test_a_creep_in_a_noisy_low_loss_warns_by_its_trend_and_its_clean_twin_does_not(tmp_path):
    # A Whisper-like log of 150 values every 100 steps, each within x1.65 of its trend (0.5 in log): the loss falls
    # 0.73 -> 0.03 and from step 6,100 creeps up x2.5 to the end while the learning rate decays. One level's noise
    # there is so wide that the climb's 8 sigmas ask for x3.6; the ranks of the 90 values after the minimum carry
    # the trend.
    n = 150
    t = np.arange(n)
    base = (0.03 + 0.7 * np.exp(-t / 8)) * np.exp(0.5 * np.random.default_rng(1).standard_normal(n))
    lr = np.linspace(1e-5, 1e-7, n)
    crept = base * np.exp(np.log(2.5) * np.clip((t - 60) / (n - 61), 0, 1))
    [finding] = findings(audited(trainer_run(tmp_path / "creep", crept, lr=lr, every=100)), "LOOP-19")
    assert (finding["rule"], finding["severity"]) == ("LOOP-19/trend", "warn")
    assert 6100 <= finding["step"] < 15000 and finding["evidence"]["z"] >= 4
    assert "learning rate decayed" in finding["message"]
    assert findings(audited(trainer_run(tmp_path / "clean", base, lr=lr, every=100)), "LOOP-19") == []
