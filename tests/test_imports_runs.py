"""Output folders that hold more than one run, told apart by what the files hold and never by their times (issue
32): checkpoints of runs with other plans side by side, a log that carries another run before its own, a
log kept per (re)start that a new run appended to; the latest run is judged, the others named once, and a
resume of one run is still read as a resume."""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

import pytest

from sftaudit.imports import import_run
from sftaudit.store.ingest import ingest
from sftaudit.store.rundb import connect
from sftaudit.verdict.audit import audit


def _entry(step: int, run: int, max_steps: int) -> dict:
    """A training log of run `run` (its own loss curve and epoch length; its LR decaying to 0 at `max_steps`)."""
    loss = round(2.0 * math.exp(-step / (20 + 7 * run)) + 0.5 + 0.1 * run + 0.01 * math.sin(step), 4)
    return {
        "epoch": step / (100 * (1 + run)),
        "grad_norm": 1.0 + 0.1 * run,
        "learning_rate": 1e-4 * (1 - step / max_steps),
        "loss": loss,
        "step": step,
    }


def _state(run: int, upto: int, max_steps: int, save_steps: int, every: int = 1, batch: int = 2, **extra) -> dict:
    history = [_entry(s, run, max_steps) for s in range(every, upto + 1, every)]
    return {
        "global_step": upto,
        "max_steps": max_steps,
        "logging_steps": every,
        "save_steps": save_steps,
        "eval_steps": 500,
        "train_batch_size": batch,
        "num_train_epochs": 1,
        "epoch": history[-1]["epoch"] if history else 0.0,
        "log_history": history,
        **extra,
    }


def _save(run_dir: Path, folder: str, state: dict) -> None:
    path = run_dir / folder / "trainer_state.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state), encoding="utf-8")


def _shuffle_times(run_dir: Path, seed: int) -> None:
    """Every file and folder at a random time: a clone or a copy says nothing of which was written last."""
    rng = random.Random(seed)
    for p in [run_dir, *run_dir.rglob("*")]:
        t = rng.uniform(1e9, 2e9)
        os.utime(p, (t, t))


def _manifests(run_dir: Path) -> list[dict]:
    text = (run_dir / "sftaudit" / "rank-0" / "manifest.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines()]


def _notes(run_dir: Path, key: str) -> list[dict]:
    return [n for n in _manifests(run_dir)[-1]["notes"] if n["key"] == key]


def _three_runs(run_dir: Path) -> None:
    """Three trainings into one output_dir, oldest first; each later one saved over some of the earlier's folders.
    Run 1: 40 steps, saved every 10. Run 2 (batch 4): 25 steps, every 5: its checkpoint-10/20 replaced run 1's.
    Run 3 (batch 8): trained to 10 steps (max_steps 10), then resumed with max_steps 20: its checkpoint-10 and
    checkpoint-20 replaced run 2's. Left: run 2's 5, 15, 25; run 1's 30, 40; run 3's 10, 20."""
    for step in (30, 40):
        _save(run_dir, f"checkpoint-{step}", _state(1, step, 40, 10))
    for step in (5, 15, 25):
        _save(run_dir, f"checkpoint-{step}", _state(2, step, 25, 5, batch=4))
    first_leg = _state(3, 10, 10, 10, batch=8)
    _save(run_dir, "checkpoint-10", first_leg)
    resumed = _state(3, 20, 20, 10, batch=8)
    resumed["log_history"] = first_leg["log_history"] + [_entry(s, 3, 20) for s in range(11, 21)]
    _save(run_dir, "checkpoint-20", resumed)


@pytest.mark.parametrize("seed", range(4))
def test_three_runs_at_shuffled_times_the_latest_by_content_is_judged_and_its_resume_stays_one(tmp_path, seed):
    run = tmp_path / "run"
    _three_runs(run)
    _shuffle_times(run, seed)
    done = import_run(run)
    assert done["other_runs"] == 2 and done["resumes"] == [11] and done["abandoned_steps"] == []
    [note] = _notes(run, "other_runs")
    assert note["text"].startswith("2 other runs' checkpoints share this folder: checkpoint-30, checkpoint-40 (step 40")
    assert [r["checkpoints"] for r in note["runs"]] == [
        ["checkpoint-30", "checkpoint-40"],
        ["checkpoint-5", "checkpoint-15", "checkpoint-25"],
    ]
    manifests = _manifests(run)
    assert [m["config"]["max_steps"] for m in manifests] == [10, 20]
    assert manifests[1]["config"]["resume_from"] == "checkpoint-10"
    ingest(run)
    con = connect(run, read_only=True)
    try:
        assert con.execute("SELECT seg, min(step), max(step) FROM steps GROUP BY seg ORDER BY seg").fetchall() == [
            (0, 1, 10),
            (1, 11, 20),
        ]
        assert con.execute("SELECT list(path ORDER BY step) FROM checkpoints").fetchone() == (
            ["checkpoint-10", "checkpoint-20"],
        )
    finally:
        con.close()
    verdict = audit(run)
    assert verdict["check_errors"] == []
    assert not [f for f in verdict["findings"] if f["code"] == "LOOP-11" and f["severity"] != "info"]
    assert verdict["resolution"]["notes"].count(note["text"]) == 1


def test_another_runs_checkpoint_among_the_judged_runs_own_is_a_risk_and_one_beside_them_is_not(tmp_path):
    """Run 2's checkpoint-15 lies between run 3's checkpoint-10 and -20: the folder's names mix two trainings (a
    warn, a risk: it dates nothing). Run 1's 30 and 40, after run 3's last, are only named."""
    run = tmp_path / "run"
    _three_runs(run)
    verdict = audit(run)
    [mixed] = [f for f in verdict["findings"] if f["rule"] == "LOOP-09/mixed-runs"]
    assert (mixed["severity"], mixed["category"], mixed["step"]) == ("warn", "risk", None)
    assert mixed["evidence"]["other_checkpoints"] == ["checkpoint-15"]
    assert verdict["first_anomalous_step"] is None
    beside = tmp_path / "beside"
    _save(beside, "checkpoint-100", _state(1, 100, 100, 500, batch=8))
    for step in (500, 755):
        _save(beside, f"checkpoint-{step}", _state(2, step, 755, 500, batch=1))
    assert [f for f in audit(beside)["findings"] if f["rule"] == "LOOP-09/mixed-runs"] == []


@pytest.mark.parametrize("seed", range(2))
def test_one_run_at_shuffled_times_names_no_other_run(tmp_path, seed):
    """The clean twin: one run's checkpoints, shuffled times: no other run, no resume."""
    run = tmp_path / "run"
    for step in (10, 20, 30, 40):
        _save(run, f"checkpoint-{step}", _state(1, step, 40, 10))
    _shuffle_times(run, seed)
    done = import_run(run)
    assert (done["other_runs"], done["resumes"], done["steps"], done["checkpoints"]) == (0, [], 40, 4)
    assert _notes(run, "other_runs") == []


@pytest.mark.parametrize("newer", ["short", "long"])
def test_without_folder_evidence_the_run_that_got_furthest_is_judged_whatever_the_times(tmp_path, newer):
    """Two runs that never saved at a step the other saved at (run A: 100 steps, saved at its end only; run B:
    755 steps, saved every 500): no content says which came last; the one that reached the higher step is
    judged, and that choice does not follow the file times."""
    run = tmp_path / "run"
    _save(run, "checkpoint-100", _state(1, 100, 100, 500, batch=8))
    _save(run, "checkpoint-500", _state(2, 500, 755, 500, batch=1))
    _save(run, "checkpoint-755", _state(2, 755, 755, 500, batch=1))
    times = {"short": (2e9, 1e9), "long": (1e9, 2e9)}[newer]
    for folder, t in (("checkpoint-100", times[0]), ("checkpoint-500", times[1]), ("checkpoint-755", times[1])):
        for p in (run / folder, run / folder / "trainer_state.json"):
            os.utime(p, (t, t))
    done = import_run(run)
    assert (done["steps"], done["other_runs"], done["resumes"]) == (755, 1, [])
    assert _manifests(run)[-1]["config"]["max_steps"] == 755


def test_a_log_whose_epoch_goes_back_holds_another_run_before_the_judged_one(tmp_path):
    """A log history carried into a run on other data: steps go on (2000 after 1500), the epoch starts again.
    Only the log from the reset is judged; the earlier part is named once. The clean twin (the epoch goes on)
    is one run."""
    run, twin = tmp_path / "glued", tmp_path / "clean"
    first = [{"epoch": s / 2400, "learning_rate": 5e-5, "loss": 2.1, "step": s} for s in (500, 1000, 1500)]
    second = [{"epoch": s / 48000, "learning_rate": 5e-5, "loss": 2.4, "step": s} for s in range(2000, 6001, 500)]
    state = {"global_step": 6000, "max_steps": 2_400_000, "logging_steps": 500, "log_history": first + second}
    _save(run, ".", state)
    done = import_run(run)
    assert done["steps"] == 9 and done["resumes"] == [] and done["other_runs"] == 1
    [note] = _notes(run, "earlier_run_in_log")
    assert (note["first_step"], note["last_step"], note["starts_at"]) == (500, 1500, 2000)
    assert "its epoch goes back at step 2,000" in note["text"]
    clean = [{"epoch": s / 2400, "learning_rate": 5e-5, "loss": 2.1, "step": s} for s in range(500, 6001, 500)]
    _save(twin, ".", {**state, "log_history": clean})
    done = import_run(twin)
    assert (done["steps"], done["other_runs"], done["resumes"]) == (12, 0, [])
    assert _notes(twin, "earlier_run_in_log") == []


def test_an_epoch_that_counts_again_from_a_resume_is_one_run_resumed(tmp_path):
    """A run on a streamed dataset resumed at step 66,050: the Trainer cannot restore the position in the epoch, so
    the epoch counts again from 0 there (epoch = (step - 66,000) / steps per epoch, not step / steps per epoch).
    One run, read whole, with a resume at that step; not another run."""
    run = tmp_path / "streamed"
    first = [{"epoch": s / 62000, "learning_rate": 3e-6, "loss": 0.9, "step": s} for s in range(50, 66001, 50)]
    then = [
        {"epoch": (s - 66000) / 8500, "learning_rate": 3e-6, "loss": 0.89, "step": s} for s in range(66050, 100001, 50)
    ]
    _save(run, ".", {"global_step": 100000, "max_steps": 100000, "logging_steps": 50, "log_history": first + then})
    done = import_run(run)
    assert (done["steps"], done["other_runs"], done["resumes"]) == (2000, 0, [66050])


def _lf_line(step: int, loss: float, total: int, elapsed: int) -> dict:
    return {
        "current_steps": step,
        "total_steps": total,
        "loss": loss,
        "lr": 1e-5 * (1 - step / total),
        "epoch": step / total,
        "percentage": round(100 * step / total, 2),
        "elapsed_time": f"0:{elapsed // 60:02d}:{elapsed % 60:02d}",
        "remaining_time": "0:00:10",
    }


@pytest.mark.parametrize("restart", [10, 60])
def test_a_new_run_appended_to_a_trainer_log_is_another_run_and_a_restart_past_it_a_resume(tmp_path, restart):
    """LLaMA-Factory appends trainer_log.jsonl across starts. A start whose first log is the first logging step
    (10) began a new run: the lines before it are another run's, named, no resume. A start at step 60 resumed
    (from checkpoint-50): a resume, its abandoned lines kept aside."""
    run = tmp_path / "run"
    run.mkdir()
    lines = [_lf_line(s, 2.0 - s / 200, 100, s) for s in range(10, 101, 10)]
    lines += [_lf_line(s, 1.8 - s / 300, 100, s) for s in range(restart, 101, 10)]
    (run / "trainer_log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    done = import_run(run)
    if restart == 10:
        assert (done["resumes"], done["other_runs"], done["steps"]) == ([], 1, 10)
        [note] = _notes(run, "earlier_run_in_log")
        assert (note["first_step"], note["last_step"], note["starts_at"]) == (10, 100, 10)
    else:
        assert (done["resumes"], done["other_runs"]) == ([60], 0)
        assert done["abandoned_steps"] == [60, 70, 80, 90, 100]


def test_every_logged_number_reaches_the_database_as_the_number_it_is(tmp_path):
    """NaN and Infinity (as the Trainer writes them), numbers written as text, keys with slashes, a nested group,
    eval metrics of any name: each a metric at its step (a training log's loss and gradient norm a column of its steps
    record), a NaN as a NaN; a steps record keeps its step even when
    its learning rate was written as text. Values that are no number (a list, a bool, a word) are left out."""
    run = tmp_path / "run"
    history = [
        {
            "step": 1,
            "epoch": 0.1,
            "loss": 0.7,
            "learning_rate": 1e-4,
            "grad_norm": float("nan"),
            "rewards/margins": 0.2,
        },
        {
            "step": 2,
            "epoch": 0.2,
            "loss": float("nan"),
            "learning_rate": "1e-4",
            "grad_norm": "inf",
            "logps/chosen": "nan",
        },
        {"step": 2, "epoch": 0.2, "eval_loss": float("nan"), "eval_wer": 0.41, "eval_rougeLsum": 0.3, "eval_f1": 0.8},
        {"step": 3, "epoch": 0.3, "loss": 0.6, "learning_rate": 1e-4, "rewards": {"chosen": -1.5}, "flags": [1, 2]},
        {"step": 3, "epoch": 0.3, "is_best": True, "note": "warm", "kl": "-Infinity"},
    ]
    _save(run, ".", {"global_step": 3, "max_steps": 3, "logging_steps": 1, "log_history": history})
    import_run(run)
    ingest(run)
    con = connect(run, read_only=True)
    try:
        metrics = {(s, n): v for s, n, v in con.execute("SELECT step, name, value FROM metrics").fetchall()}
        steps = con.execute("SELECT step, loss, lr, grad_norm FROM steps ORDER BY step").fetchall()
    finally:
        con.close()
    assert metrics[(1, "rewards/margins")] == 0.2 and math.isnan(metrics[(2, "logps/chosen")])
    assert metrics[(3, "kl")] == -math.inf and metrics[(2, "learning_rate")] == 1e-4
    # a training log's loss and gradient norm are its steps record's, not metrics too
    assert not {(s, n) for s in (1, 2, 3) for n in ("loss", "grad_norm")} & metrics.keys()
    assert math.isnan(steps[0][3]) and math.isnan(steps[1][1])
    assert math.isnan(metrics[(2, "eval_loss")])
    assert {n for s, n in metrics if s == 2 and n.startswith("eval_")} == {
        "eval_loss",
        "eval_wer",
        "eval_rougeLsum",
        "eval_f1",
    }
    assert metrics[(3, "rewards/chosen")] == -1.5
    assert not {(3, "flags"), (3, "is_best"), (3, "note")} & metrics.keys()
    assert [s[0] for s in steps] == [1, 2, 3] and steps[1][2] == 1e-4 and steps[1][3] == math.inf
    assert math.isnan(steps[1][1]) and math.isnan(steps[0][3])


def test_a_log_of_the_loss_alone_is_logged_metrics_though_its_loss_is_stored_as_steps(tmp_path):
    """A training log's loss is stored as its steps record's, not as a metric too: the checks that read logged
    metrics still run on such a log and say what it lacks (no eval metric, no epoch), not that nothing was logged."""
    run = tmp_path / "run"
    history = [{"loss": 2.0 - s / 1000, "step": s} for s in range(1, 301)]
    _save(run, ".", {"global_step": 300, "max_steps": 300, "logging_steps": 1, "log_history": history})
    checks = {c["code"]: c for c in audit(run)["checks"]}
    assert checks["LOOP-25"]["status"] == "ran"
    assert checks["LOOP-26"]["reason"] == "no eval metric was logged"
    assert checks["LOOP-28"]["reason"].startswith("no epoch logged")
