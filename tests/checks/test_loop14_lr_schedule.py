"""LOOP-14: a scheduler stepped twice per optimizer step (Z28) and a resume that restarts the warmup
(Z36) leave the configured schedule at their step; clean runs follow it."""

from sftaudit.verdict.audit import audit

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


def _traced_run(run_dir, lr, norms, trace):
    """A shim run's records with the schedule the shim traced at start (the LR after 0, 1, 2, ... scheduler steps)."""
    import json

    from sftaudit.core.artifacts import rank_dir

    from .dynamics_runs import recorded_series_run

    recorded_series_run(
        run_dir, lr, [1.0] * len(lr), norms, [f"model.layers.{i}.weight" for i in range(norms.shape[1])]
    )
    path = rank_dir(run_dir, 0) / "manifest.jsonl"
    manifest = json.loads(path.read_text())
    manifest["scheduler"] = {"class": "LambdaLR", "lr": trace, "trace_start": 0}
    path.write_text(json.dumps(manifest) + "\n")
    return run_dir


def test_a_step_the_fp16_scaler_skipped_holds_the_schedule_back_one_step_by_design(tmp_path):
    """GradScaler skipped step 33 (every gradient norm inf): the Trainer did not step the scheduler, so from step
    34 the LR runs one scheduler step behind the step count. That follows the schedule; the same lag with no
    skipped step does not."""
    import numpy as np

    steps = 60
    trace = [3e-4 * min(1.0, (k + 1) / 10) * (1 - k / 70) for k in range(steps + 1)]
    behind = np.r_[np.zeros(33), np.ones(steps - 33)].astype(int)  # skipped steps before each step
    lr = [trace[s - 1 - behind[s - 1]] for s in range(1, steps + 1)]
    norms = np.exp(-1 + 0.2 * np.random.default_rng(8).standard_normal((steps, 3)))
    skipped = norms.copy()
    skipped[32] = np.inf
    assert of(audit(_traced_run(tmp_path / "skipped", lr, skipped, trace)), "LOOP-14") == []
    [finding] = of(audit(_traced_run(tmp_path / "lagging", lr, norms, trace)), "LOOP-14")
    assert (finding["severity"], finding["step"]) == ("fail", 34)
