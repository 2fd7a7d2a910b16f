"""LOOP-10: a learning-rate jump and the divergence after it; clean runs stay silent."""

from sftaudit.audit import audit

from .dynamics_runs import LR_JUMP_STEP, of, run


def test_learning_rate_jump_warns_at_its_step_and_the_divergence_fails_after_it(runs):
    verdict = audit(run(runs, "lr_jump"))
    jump, diverged = of(verdict, "LOOP-10")
    assert (jump["severity"], jump["step"]) == ("warn", LR_JUMP_STEP)
    assert jump["evidence"]["value"] > 10 and "learning rate" in jump["message"]
    # The step's own update already used the new rate: the loss of the next step is the first one hit.
    assert (diverged["severity"], diverged["step"]) == ("fail", LR_JUMP_STEP + 1)
    assert diverged["evidence"]["z"] > 6 and diverged["evidence"]["p_value"] < 1e-6
    assert verdict["first_anomalous_step"] == LR_JUMP_STEP
    assert [c["step"] for c in verdict["first_anomaly_chain"]][:2] == [LR_JUMP_STEP, LR_JUMP_STEP + 1]


def test_clean_runs_raise_nothing(clean_run, runs):
    for run_dir in (clean_run, run(runs, "clean_probed")):
        verdict = audit(run_dir)
        assert of(verdict, "LOOP-10") == []
