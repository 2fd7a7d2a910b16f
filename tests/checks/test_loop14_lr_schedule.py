"""LOOP-14: a scheduler stepped twice per optimizer step (Z28) and a resume that restarts the warmup
(Z36) leave the configured schedule at their step; clean runs follow it."""

import json

import numpy as np

from sftaudit.verdict.audit import audit

from ..conftest import RESUMES
from .dynamics_runs import of, run
from .logged_runs import audited, falling, findings, linear_schedule, logged, save_state, trainer_run


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


# ---------------------------------------------------------------------------- runs imported from their logs


def test_a_warm_up_as_long_as_the_run_is_a_configuration_finding(tmp_path):
    """warmup_steps = max_steps = 100: the LR climbs to its peak at step 99 and is 0 at step 100. Its clean twin
    (a warm-up of 10 steps) and a run still warming when it stopped at step 100 of 300 (LOOP-24's) are silent."""
    steps = np.arange(1, 101)
    whole = np.r_[1e-5 * steps[:99], 0.0]
    [finding] = findings(audited(trainer_run(tmp_path / "whole", falling(100), lr=whole, max_steps=100)), "LOOP-14")
    assert (finding["severity"], finding["category"], finding["step"]) == ("warn", "configuration", None)
    assert finding["evidence"]["peak_step"] == 99 and finding["evidence"]["planned"] == 100
    assert "warm-up lasted the whole run" in finding["message"] and "resumed" not in finding["message"]
    short = linear_schedule(steps, 1e-3, 10, 100)
    assert findings(audited(trainer_run(tmp_path / "short", falling(100), lr=short, max_steps=100)), "LOOP-14") == []
    stopped = trainer_run(tmp_path / "stopped", falling(100), lr=1e-5 * steps, max_steps=300)
    assert findings(audited(stopped), "LOOP-14") == []


def test_a_warm_up_run_again_within_one_log_is_found_where_the_schedule_restarted(tmp_path):
    """A resume from checkpoint-59 with a fresh scheduler, its log going on from the checkpoint's: at step 60 the LR
    falls to 0 and climbs the first warm-up's ramp again. Twins: the schedule going on, and a cosine schedule
    with hard restarts (it descends to 0 and jumps back to its peak: no cliff, no second ramp)."""
    steps = np.arange(1, 121)
    lr = linear_schedule(steps, 2e-4, 10, 120)
    restarted = np.where(steps < 60, lr, linear_schedule(steps - 60, 2e-4, 10, 120))
    [finding] = findings(audited(trainer_run(tmp_path / "restarted", falling(120), lr=restarted)), "LOOP-14")
    assert (finding["severity"], finding["category"], finding["step"]) == ("warn", "anomaly", 60)
    assert finding["evidence"]["diagnosis"] == "restarted" and "scheduler.pt" in finding["message"]
    assert findings(audited(trainer_run(tmp_path / "clean", falling(120), lr=lr)), "LOOP-14") == []
    cycle = (steps - 10) % 40
    hard = np.where(steps < 10, 2e-4 * steps / 10, 2e-4 * 0.5 * (1 + np.cos(np.pi * cycle / 40)))
    assert findings(audited(trainer_run(tmp_path / "hard", falling(120), lr=hard)), "LOOP-14") == []


def test_a_warm_up_run_again_at_another_pace_is_found_where_the_schedule_restarted(tmp_path):
    """A resume with a fresh scheduler that warms up over a tenth of the run (the first warm-up took 4 logs of
    the 200): the LR falls to 0 at step 100 and climbs over 20 logs. Twin: the schedule going on."""
    steps = np.arange(1, 201)
    lr = linear_schedule(steps, 2e-4, 4, 200)
    restarted = np.where(steps < 100, lr, linear_schedule(steps - 100, 2e-4, 20, 200))
    [finding] = findings(audited(trainer_run(tmp_path / "restarted", falling(200), lr=restarted)), "LOOP-14")
    assert (finding["rule"], finding["severity"], finding["step"]) == ("LOOP-14/schedule-restarted", "warn", 100)
    assert finding["evidence"]["slope_again"] < finding["evidence"]["warmup_slope"] / 4
    assert findings(audited(trainer_run(tmp_path / "clean", falling(200), lr=lr)), "LOOP-14") == []


def _lf_log(run_dir, starts):
    """LLaMA-Factory's trainer_log.jsonl: per start, (first step, learning rate per step), logged every 10 steps."""
    run_dir.mkdir(parents=True)
    lines = []
    for elapsed, (first, lr) in enumerate(starts):
        for s in range(first, 201, 10):
            lines.append({"current_steps": s, "total_steps": 200, "loss": 1.0 + 1 / s, "lr": float(lr(s))})
            lines[-1]["elapsed_time"] = f"0:{(s + 400 * elapsed) // 60:02d}:{(s + 400 * elapsed) % 60:02d}"
    (run_dir / "trainer_log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return run_dir


def test_a_resume_that_started_the_schedule_over_is_found_at_the_resume_step(tmp_path):
    """LLaMA-Factory keeps each start's lines: the run resumed from checkpoint-50 with a fresh scheduler (its LR
    warms up again from step 60, the first log after the resume: the window of steps 51-60). Its twin resumed
    with the scheduler's state."""
    schedule = lambda s: linear_schedule([s], 1e-4, 20, 200)[0]  # noqa: E731
    fresh = _lf_log(tmp_path / "fresh", [(10, schedule), (60, lambda s: schedule(s - 50))])
    [finding] = findings(audited(fresh), "LOOP-14")
    assert (finding["severity"], finding["category"], finding["step"]) == ("warn", "anomaly", 51)
    assert finding["evidence"]["resolution"] == {
        "kind": "logging window",
        "first_step": 51,
        "last_step": 60,
        "logging_steps": 10,
    }
    assert finding["evidence"]["diagnosis"] == "restarted" and "started over" in finding["message"]
    restored = _lf_log(tmp_path / "restored", [(10, schedule), (60, schedule)])
    assert findings(audited(restored), "LOOP-14") == []


def test_a_resume_that_changed_max_steps_is_a_configuration_finding_at_the_resume_step(tmp_path):
    """Trained 60 steps (max_steps 60), then resumed with max_steps 180: the first step after the resume trains at
    the old schedule's last LR (0), the next at the new schedule's. Its twin planned 180 steps from the start."""
    steps = np.arange(1, 181)
    old = linear_schedule(steps[:60] - 1, 2e-4, 7, 60)  # the LR a step trained with: the schedule's before it
    new = np.r_[0.0, linear_schedule(steps[61:] - 1, 2e-4, 7, 180)]
    loss = falling(180)
    first = logged(steps[:60], loss[:60], old)
    run = save_state(tmp_path / "extended", "checkpoint-60", first, max_steps=60)
    save_state(run, "checkpoint-180", first + logged(steps[60:], loss[60:], new), max_steps=180)
    [finding] = findings(audited(run), "LOOP-14")
    assert (finding["severity"], finding["category"], finding["step"]) == ("warn", "configuration", 61)
    evidence = finding["evidence"]
    assert (evidence["max_steps_before"], evidence["max_steps_after"]) == (60, 180)
    assert "max_steps 60 -> 180" in finding["message"] and "rose again" in finding["message"]
    planned = logged(steps, loss, linear_schedule(steps - 1, 2e-4, 7, 180))
    twin = save_state(tmp_path / "planned", "checkpoint-60", planned[:60], max_steps=180)
    save_state(twin, "checkpoint-180", planned, max_steps=180)
    assert findings(audited(twin), "LOOP-14") == []
