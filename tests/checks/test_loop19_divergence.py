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
