"""LOOP-14: a scheduler stepped twice per optimizer step (Z28) and a resume that restarts the warmup
(Z36) leave the configured schedule at their step; clean runs follow it."""

from sftaudit.audit import audit

from ..conftest import RESUMES
from .dynamics_runs import of, run


def test_scheduler_stepped_twice_fails_at_step_1_as_2x_ahead_with_the_early_floor(runs):
    verdict = audit(run(runs, "scheduler_twice"))
    [finding] = of(verdict, "LOOP-14")
    assert (finding["severity"], finding["step"]) == ("fail", 1)
    evidence = finding["evidence"]
    assert (evidence["diagnosis"], evidence["speed"]) == ("ahead", 2)
    # Cosine over 12 steps reaches 0 at step 12; twice as fast it does at step 6.
    assert evidence["floor"] == {"floor": 0.0, "reached_at": 6, "scheduled_at": 12}
    assert evidence["zero_lr_steps"] == [6]
    assert evidence["scheduler"]["lr_lambda"]["function"] == "_get_cosine_schedule_with_warmup_lr_lambda"


def test_resume_with_a_fresh_scheduler_restarts_the_warmup_at_the_resumed_step(resumed_run):
    [finding] = of(audit(resumed_run), "LOOP-14")
    restarted = next(step for step, fault in RESUMES if fault == "resume_restarts_warmup")
    assert (finding["step"], finding["evidence"]["diagnosis"]) == (restarted + 1, "restarted")


def test_clean_runs_follow_their_schedule(clean_run, nan_run):
    for run_dir in (clean_run, nan_run):
        assert of(audit(run_dir), "LOOP-14") == []
