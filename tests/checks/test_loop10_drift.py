"""LOOP-10: a learning-rate jump and the divergence after it; clean runs stay silent."""

from sftaudit.audit import audit
from sftaudit.ingest import connect

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
