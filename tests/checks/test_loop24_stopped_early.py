"""LOOP-24: a run that ended before its planned length is never a plain pass (a risk: it dates nothing); a run
that finished, or that the shim saw close on purpose, is not warned."""

import json

from sftaudit.core.artifacts import rank_dir
from sftaudit.verdict.audit import audit

from .dynamics_runs import recorded_series_run
from .logged_runs import audited, falling, findings, logged, save_state, status, trainer_run


def test_a_log_that_ends_at_step_202_of_5100_warns_without_dating_the_run(tmp_path):
    verdict = audited(trainer_run(tmp_path / "dpo", falling(202, 0.69, 0.5), max_steps=5100))
    [finding] = findings(verdict, "LOOP-24")
    assert (finding["severity"], finding["category"], finding["step"]) == ("warn", "risk", 202)
    assert "stopped at step 202 of 5,100 planned (4%)" in finding["message"]
    assert verdict["verdict"] == "warn" and verdict["first_anomalous_step"] is None


def test_a_run_that_reached_its_plan_within_one_logging_interval_is_silent(tmp_path):
    # The Trainer logs every 5 steps; the plan is 8,712 steps, the last log 8,710.
    run_dir = trainer_run(tmp_path / "done", falling(1742), every=5, max_steps=8712)
    assert findings(audited(run_dir), "LOOP-24") == []


def _shim_run(run_dir, steps, max_steps, closed):
    recorded_series_run(run_dir, [1e-3] * steps, list(falling(steps)), [[1.0]] * steps, ["lm_head.weight"])
    folder = rank_dir(run_dir, 0)
    manifest = json.loads((folder / "manifest.jsonl").read_text())
    manifest["config"] = {"max_steps": max_steps}
    (folder / "manifest.jsonl").write_text(json.dumps(manifest) + "\n")
    if closed:
        with open(folder / "events.jsonl", "a") as f:
            f.write(json.dumps({"seg": 0, "kind": "close", "time": 1.0}) + "\n")
    return run_dir


def test_a_shim_run_killed_at_step_3_of_80_warns_and_one_closed_early_on_purpose_is_info(tmp_path):
    [killed] = findings(audit(_shim_run(tmp_path / "killed", 3, 80, closed=False)), "LOOP-24")
    assert killed["severity"] == "warn" and "stopped at step 3 of 80 planned" in killed["message"]
    assert "did not close" in killed["message"]
    [early] = findings(audit(_shim_run(tmp_path / "early", 30, 80, closed=True)), "LOOP-24")
    assert early["severity"] == "info" and early["evidence"]["closed"] is True
    assert findings(audit(_shim_run(tmp_path / "whole", 80, 80, closed=True)), "LOOP-24") == []


def test_without_a_planned_length_it_is_not_judged(tmp_path):
    verdict = audit(recorded_series_run(tmp_path / "noplan", [1e-3] * 5, [1.0] * 5, [[1.0]] * 5, ["w"]))
    assert status(verdict, "LOOP-24")[0] == "not_run"


def test_a_log_that_ends_with_a_checkpoint_says_so_rather_than_a_crash(tmp_path):
    """Only checkpoint-200's state holds the log (200 of 350 planned): whether the run went on is not on disk. The
    twin holds the same state at the top of the folder (written when training returned): the run itself stopped."""
    history = logged(range(1, 201), falling(200), [1e-4] * 200)
    only = save_state(tmp_path / "checkpoint-only", "checkpoint-200", history, max_steps=350)
    [finding] = findings(audited(only), "LOOP-24")
    assert (finding["severity"], finding["category"], finding["step"]) == ("warn", "risk", 200)
    assert finding["message"].startswith("the log ends at step 200 of 350 planned (57%), with checkpoint-200")
    assert "crashed" not in finding["message"] and finding["evidence"]["log_ends_with"] == "checkpoint-200"
    top = save_state(tmp_path / "top", ".", history, max_steps=350)
    [finding] = findings(audited(top), "LOOP-24")
    assert finding["message"].startswith("the run stopped at step 200 of 350 planned (57%)")


def _stopping(should_stop: bool) -> dict:
    return {
        "TrainerControl": {"args": {"should_training_stop": should_stop, "should_save": True}, "attributes": {}},
        "EarlyStoppingCallback": {
            "args": {"early_stopping_patience": 3, "early_stopping_threshold": 0.0},
            "attributes": {"early_stopping_patience_counter": 3 if should_stop else 1},
        },
    }


def test_a_run_the_trainer_was_told_to_stop_by_early_stopping_is_info_not_a_warning(tmp_path):
    history = logged(range(1, 121), falling(120), [1e-4] * 120)
    stopped = save_state(
        tmp_path / "early", "checkpoint-120", history, max_steps=500, stateful_callbacks=_stopping(True)
    )
    [finding] = findings(audited(stopped), "LOOP-24")
    assert (finding["severity"], finding["step"]) == ("info", 120)
    assert "early stopping: 3 evaluation(s) in a row without improvement, patience 3" in finding["message"]
    going = save_state(
        tmp_path / "going", "checkpoint-120", history, max_steps=500, stateful_callbacks=_stopping(False)
    )
    [finding] = findings(audited(going), "LOOP-24")
    assert finding["severity"] == "warn"
