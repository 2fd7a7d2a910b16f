"""LOOP-10: a learning-rate jump and the divergence after it; clean runs stay silent."""

import numpy as np

from sftaudit.audit import audit
from sftaudit.config import AuditConfig
from sftaudit.ingest import connect

from .dynamics_runs import LR_JUMP_STEP, of, recorded_series_run, run


def test_learning_rate_jump_warns_at_its_step_and_the_divergence_fails_after_it(runs):
    verdict = audit(run(runs, "lr_jump"))
    jump, diverged = of(verdict, "LOOP-10")
    assert (jump["severity"], jump["step"]) == ("warn", LR_JUMP_STEP)
    assert jump["evidence"]["value"] > 10 and "learning rate" in jump["message"]
    # The step's own update already used the new rate: the loss of the next step is the first one hit.
    assert (diverged["severity"], diverged["step"]) == ("fail", LR_JUMP_STEP + 1)
    assert diverged["evidence"]["z"] > 6 and diverged["evidence"]["p_value"] < 1e-6
    assert verdict["first_anomalous_step"] == LR_JUMP_STEP
    chain = verdict["first_anomaly_chain"]
    assert [c["step"] for c in chain if c["code"] == "LOOP-10"][:2] == [LR_JUMP_STEP, LR_JUMP_STEP + 1]
    # LOOP-14 sees the same step leave the configured schedule.
    assert any(c["code"] == "LOOP-14" and c["step"] == LR_JUMP_STEP for c in chain)


def test_clean_runs_raise_nothing(clean_run, runs):
    for run_dir in (clean_run, run(runs, "clean_probed")):
        verdict = audit(run_dir)
        assert of(verdict, "LOOP-10") == []


def test_overfitting_warns_when_validation_loss_turns_up_while_training_loss_falls(runs):
    run_dir = runs("memorize", steps=45, checkpoint_every=0, eval_loss_every=3, faults={"memorize_from": 10},
                   probe_every=0, generate_every=0, eval_every=0)
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
CONVERGED_LOSS = [1.151, 1.141, 1.201, 1.268, 1.21, 1.143, 1.201, 1.169, 1.177, 1.146, 1.243, 1.154, 1.176, 1.037, 1.11,
                  1.122, 1.199, 1.131, 1.105, 1.159, 0.9846, 1.05, 1.076, 1.079, 1.073, 1.062, 1.148, 1.062, 1.039, 0.9751,
                  1.049, 0.9713, 1.005, 1.048, 0.9683, 1.2, 0.9746, 1.042, 1.045, 1.037, 1.053, 0.9964, 1.045, 0.9609,
                  1.057, 0.9884, 0.974, 0.937, 0.8699, 1.123, 0.8903, 0.9217, 0.9262, 0.9268, 0.9019, 0.9128, 0.9043,
                  0.98, 0.819, 0.9197, 0.8985, 1.045, 0.939, 0.9503, 0.9719, 0.9063, 0.9073, 0.9097]


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
