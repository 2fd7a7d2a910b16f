"""Auditing runs that were never instrumented (issue 12): real Trainer / TRL runs without the callback,
imported from what they left on disk, audited at the resolution their logs allow."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import shutil

import pyarrow.parquet as pq
import pytest

from sftaudit.cli import main
from sftaudit.imports import import_run

from .checks.posthoc_runs import audited, posthoc_run


@pytest.fixture(scope="module")
def window_run(tmp_path_factory, tokenizer_cache):
    return posthoc_run(tmp_path_factory, tokenizer_cache, "window")


@pytest.fixture(scope="module")
def clean_trl_run(tmp_path_factory, tokenizer_cache):
    return posthoc_run(tmp_path_factory, tokenizer_cache, "clean_trl")


@pytest.mark.slow
def test_a_nan_inside_a_logging_window_names_the_window_and_the_checkpoint_before_it(tmp_path_factory, tokenizer_cache):
    """logging_steps=5, NaN at step 13: the Trainer logged a finite loss and a NaN grad_norm at step 15.
    The logged NaN is the dynamics checks' to find from the log (with or without checkpoints); LOOP-18
    leaves it to them and keeps its optimizer-state evidence (the NaN state is placed by the log)."""
    code, printed, verdict = audited(tmp_path_factory, tokenizer_cache, "window")
    assert code == 1
    assert verdict["resolution"]["logging_steps"] == 5
    assert not [
        f
        for f in verdict["findings"]
        if f["code"] == "LOOP-18" and f["step"] is not None and "non-finite" in f["message"]
    ], verdict["findings"]
    # Provenance: each check says what it ran on; what needs the shim did not run.
    checks = {c["code"]: c for c in verdict["checks"]}
    assert checks["LOOP-10"]["sources"] == ["imported logs: trainer_state.json"]
    assert checks["LOOP-18"]["sources"] == ["checkpoints (weights, optimizer state)"]
    assert checks["LOOP-13"]["status"] == "not_run"
    # LOOP-05 judges the logged global gradient norm, without the per-tensor norms only the shim records.
    assert checks["LOOP-05"]["status"] == "partial"
    assert checks["LOOP-05"]["reason"] == "not recorded: per-tensor gradient norms"
    assert checks["LOOP-02"]["status"] == "ran"  # the tokenizer saved with the checkpoints
    assert verdict["check_errors"] == []


@pytest.mark.slow
def test_with_logging_steps_1_the_step_is_exact(tmp_path_factory, tokenizer_cache):
    code, _, verdict = audited(tmp_path_factory, tokenizer_cache, "exact")
    assert code == 1
    assert verdict["resolution"]["kind"] == "exact step"
    # The first anomaly is LOOP-18's gradient-moment jump: known to the checkpoint window only.
    assert verdict["resolution"]["first_anomalous_window"] == {
        "kind": "checkpoint window",
        "first_step": 7,
        "last_step": 12,
    }
    spike = [f for f in verdict["findings"] if f["code"] == "LOOP-10" and f["severity"] != "info"]
    assert spike and spike[0]["step"] == 11, spike  # the planted loss spike, at its step
    assert verdict["check_errors"] == []


@pytest.mark.slow
def test_a_clean_run_without_the_shim_passes_on_what_it_saw_and_says_what_it_did_not(
    tmp_path_factory, tokenizer_cache, clean_trl_run
):
    code, printed, verdict = audited(tmp_path_factory, tokenizer_cache, "clean_trl")
    assert code == 0
    assert verdict["verdict"] == "pass" and verdict["findings"] == [], verdict["findings"]
    not_run = {c["code"] for c in verdict["checks"] if c["status"] == "not_run"}
    assert {"LOOP-03", "LOOP-04", "LOOP-06", "LOOP-07", "LOOP-08", "LOOP-13"} <= not_run
    assert "not run: LOOP-03" in printed
    # TRL's own logged metrics were imported with the Trainer's.
    names = set(pq.read_table(clean_trl_run / "sftaudit" / "rank-0" / "metrics.parquet").column("name").to_pylist())
    assert {"mean_token_accuracy", "entropy"} <= names


def test_gate_and_replay_import_first(window_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(window_run, run, ignore=shutil.ignore_patterns("sftaudit"))
    assert main(["gate", str(run), "--checkpoint", "checkpoint-10"]) == 1  # the never-updated tensor is run-wide
    assert "LOOP-18 fail run" in capsys.readouterr().out
    assert main(["replay", str(run), "--json"]) == 1
    replay = json.loads(capsys.readouterr().out)
    assert replay["run"] == "run" and replay["verdict"] == "fail"


def test_import_reports_what_it_read_and_refuses_what_is_not_a_trainer_output(window_run, tmp_path, capsys):
    assert main(["import", str(window_run)]) == 0
    assert "imported 3 logged steps (logging_steps=5)" in capsys.readouterr().out
    assert main(["import", str(tmp_path)]) == 2
    assert "not a Trainer output" in capsys.readouterr().err


def _shuffle_times(run, seed: int) -> None:
    """Every file and folder of the run at a random time (a clone or copy says nothing of which was written last)."""
    rng = random.Random(seed)
    for p in [run, *run.rglob("*")]:
        t = rng.uniform(1e9, 2e9)
        os.utime(p, (t, t))


@pytest.mark.parametrize("seed", [0, 1])
def test_a_resume_keeps_the_abandoned_branch_aside(window_run, tmp_path, seed):
    """The run went on to checkpoint-15, then resumed from checkpoint-5: the resumed branch logged 9.5 at step 10
    and saved checkpoint-10 over the first branch's, then stopped. Whatever the files' times, the content says
    which branch is later: checkpoint-10 holds a save at a step the first branch saved too. Its log is the
    timeline; the first branch's steps 10 and 15 are the abandoned branch, kept aside."""
    run = tmp_path / "run"
    shutil.copytree(window_run, run, ignore=shutil.ignore_patterns("sftaudit"))
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-15", "checkpoint-5"]
    resumed = run / "checkpoint-10" / "trainer_state.json"
    state = json.loads(resumed.read_text(encoding="utf-8"))
    state["log_history"][1]["loss"] = 9.5  # what the resumed branch logged at step 10
    resumed.write_text(json.dumps(state), encoding="utf-8")
    _shuffle_times(run, seed)
    done = import_run(run)
    assert done["resumed_at"] == 10 and done["abandoned_steps"] == [10, 15] and done["other_runs"] == 0
    from sftaudit.store.ingest import ingest
    from sftaudit.store.rundb import connect

    ingest(run)
    con = connect(run, read_only=True)
    try:
        assert con.execute("SELECT step FROM superseded_steps ORDER BY step").fetchall() == [(10,), (15,)]
        assert con.execute("SELECT loss FROM steps WHERE step = 10").fetchall() == [(9.5,)]
        assert con.execute("SELECT max(step) FROM steps").fetchone() == (10,)
    finally:
        con.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_one_branch_whatever_the_file_times_is_no_resume(window_run, tmp_path, seed):
    """The clean twin: the same checkpoints, one branch, at shuffled times: no resume, nothing set aside."""
    run = tmp_path / "run"
    shutil.copytree(window_run, run, ignore=shutil.ignore_patterns("sftaudit"))
    _shuffle_times(run, seed)
    done = import_run(run)
    assert (done["resumed_at"], done["abandoned_steps"], done["other_runs"], done["steps"]) == (None, [], 0, 3)


def _leaked(row: dict) -> dict:
    """An eval item drawn from a training row: its first question, its first answer as the reference."""
    return {"id": f"leak-{row['id']}", "messages": row["messages"][:1], "reference": row["messages"][1]["content"]}


@pytest.fixture(scope="module")
def probed_run(clean_trl_run, tmp_path_factory):
    """The clean TRL run probed after the fact, on two prompts and an eval set of two held-out items and two
    drawn from the training data; `sftaudit probe` run twice (resumable). Returns (run, eval items, outputs)."""
    from sftaudit.fixtures import load_dataset, load_eval_set

    tmp = tmp_path_factory.mktemp("probed")
    run = tmp / "run"
    shutil.copytree(clean_trl_run, run, ignore=shutil.ignore_patterns("sftaudit"))
    prompts, evals = tmp / "prompts.txt", tmp / "eval.jsonl"
    prompts.write_text("What is the capital of France?\n请介绍一下长城。\n", encoding="utf-8")
    items = load_eval_set()[:2] + [_leaked(r) for r in load_dataset()[3:5]]
    evals.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
    probe = [
        "probe",
        str(run),
        "--prompts",
        str(prompts),
        "--eval",
        str(evals),
        "--max-new-tokens",
        "4",
        "--samples",
        "2",
        "--quiet",
    ]
    printed = []
    for _ in range(2):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(probe) == 0
        printed.append(out.getvalue())
    return run, items, printed


def test_probe_runs_each_checkpoint_once_and_the_behaviour_checks_run_on_it(probed_run, tmp_path):
    """`sftaudit probe`: the shim's probe code on each surviving checkpoint, resumable; LOOP-06/07/08
    then run at checkpoint granularity, on post-hoc probes."""
    run, _, printed = probed_run
    assert "2 checkpoint(s) probed" in printed[0]
    assert "0 checkpoint(s) probed" in printed[1]  # resumable
    probes = [json.loads(line) for line in (run / "sftaudit" / "rank-0" / "probes.jsonl").read_text().splitlines()]
    assert sorted({p["step"] for p in probes}) == [4, 8] and len(probes) == 4
    # Without the training data the leak cannot be seen: the eval set alone does not show it.
    assert main(["audit", str(run), "--out", str(tmp_path / "out"), "--no-report"]) == 0
    checks = {c["code"]: c for c in json.loads((tmp_path / "out" / "verdict.json").read_text())["checks"]}
    # Two probed checkpoints are too few for a drift between probes or a streak of generations: said, not passed.
    for code in ("LOOP-06", "LOOP-07"):
        assert checks[code]["status"] == "not_run" and checks[code]["reason"].startswith("2 "), checks[code]
    # LOOP-08: two evaluations are too few for the metrics' drift, and without --data there are no training
    # samples to find the eval set in: nothing judged, and it says both.
    assert checks["LOOP-08"]["status"] == "not_run"
    assert (
        checks["LOOP-08"]["reason"].startswith("2 evaluation(s) recorded")
        and "training samples" in checks["LOOP-08"]["reason"]
    )
    assert checks["LOOP-04"]["status"] == "not_run"


def test_an_eval_set_drawn_from_the_training_data_is_found_with_data(probed_run, tmp_path, capsys):
    """`--data`: the training rows rendered with the run's saved tokenizer (the preflight path); LOOP-08 finds
    the probed eval items among them, naming both ids, at dataset level (the run's row order is not on disk)."""
    from sftaudit.fixtures import load_dataset

    run, items, _ = probed_run
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in load_dataset()), encoding="utf-8")
    assert main(["audit", str(run), "--data", str(data), "--out", str(tmp_path / "out"), "--no-report"]) == 1
    verdict = json.loads((tmp_path / "out" / "verdict.json").read_text())
    leak = [f for f in verdict["findings"] if f["code"] == "LOOP-08"]
    assert len(leak) == 1 and leak[0]["severity"] == "fail", verdict["findings"]
    assert {x["eval_id"] for x in leak[0]["evidence"]["leaked"]} == {"leak-s0003", "leak-s0004"}
    assert {"s0003", "s0004"} <= set(leak[0]["evidence"]["sample_ids"])
    assert leak[0]["step"] is None and leak[0]["evidence"]["resolution"]["kind"] == "dataset"
    assert "2 of 4 eval items (50%) also appear in the training data" in leak[0]["message"]
    checks = {c["code"]: c for c in verdict["checks"]}
    for code in ("LOOP-03", "LOOP-04", "LOOP-12"):
        assert checks[code]["status"] == "ran" and checks[code]["sources"] == ["dataset (preflight path)"], checks[code]
    for code in ("LOOP-13", "LOOP-16"):  # they judge what only the run's own batches carry
        assert checks[code]["status"] == "not_run" and "--data" in checks[code]["reason"], checks[code]
    assert verdict["check_errors"] == []
    # Only the leak: the clean data renders, pads and masks cleanly.
    assert {f["code"] for f in verdict["findings"] if f["severity"] != "info"} == {"LOOP-08"}, verdict["findings"]
    # The dataset stays with the import: a later audit without --data still sees it.
    capsys.readouterr()
    assert main(["audit", str(run), "--out", str(tmp_path / "again"), "--no-report"]) == 1
    assert "LOOP-08 fail run" in capsys.readouterr().out


def _imported_with_steps_41_to_47_abandoned(run):
    """Import and ingest a run logged at every step that crashed at step 47 and resumed from step 40: 67
    logged steps, the abandoned 41-47 kept aside. Returns a read-only connection to its DuckDB."""
    from sftaudit.store.ingest import ingest
    from sftaudit.store.rundb import connect

    done = import_run(run)
    assert done["steps"] == 67 and done["logging_steps"] == 1 and done["resumed_at"] == 41
    assert done["abandoned_steps"] == list(range(41, 48))
    ingest(run)
    con = connect(run, read_only=True)
    assert con.execute("SELECT count(*), min(step), max(step) FROM superseded_steps").fetchone() == (7, 41, 47)
    return con


def test_llamafactory_trainer_log_alone_is_imported_with_its_abandoned_branch(tmp_path, capsys):
    """A LLaMA-Factory output with only trainer_log.jsonl (a committed file in LogCallback's format): the
    restart is where current_steps goes back, the lines it abandoned are kept aside, the spike found."""
    from pathlib import Path

    run = tmp_path / "run"
    shutil.copytree(Path(__file__).parent / "data" / "llamafactory-resumed", run)
    con = _imported_with_steps_41_to_47_abandoned(run)
    try:
        assert con.execute("SELECT count(*) FROM steps").fetchone() == (60,)
        assert con.execute("SELECT value FROM metrics WHERE name = 'eval_loss' ORDER BY step").fetchall() == [
            (1.5123,),
            (1.3987,),
        ]
    finally:
        con.close()
    assert main(["audit", str(run), "--out", str(tmp_path / "out"), "--no-report"]) == 0  # the spike warns
    verdict = json.loads((tmp_path / "out" / "verdict.json").read_text())
    spike = [f for f in verdict["findings"] if f["code"] == "LOOP-10" and f["severity"] != "info"]
    assert spike and spike[0]["step"] == 52 and spike[0]["evidence"]["resolution"]["kind"] == "exact step", spike
    # The folder holds the log alone: the checkpoint the run resumed from is not there to check, which is
    # no evidence the resume was inexact (a risk, stated).
    resume = next(f for f in verdict["findings"] if f["code"] == "LOOP-11")
    assert (resume["step"], resume["severity"], resume["category"]) == (41, "info", "risk")
    assert "no checkpoint it could have resumed from is on disk" in resume["message"]
    checks = {c["code"]: c for c in verdict["checks"]}
    assert checks["LOOP-10"]["sources"] == ["imported logs: trainer_log.jsonl (LLaMA-Factory)"]
    assert checks["LOOP-05"]["status"] == "not_run" and "no grad_norm" in checks["LOOP-05"]["reason"]
    assert verdict["check_errors"] == []


def test_llamafactory_trainer_log_adds_what_the_trainer_states_lost(window_run, tmp_path):
    """Next to trainer_state.json, the log adds the lines of a branch a resume abandoned (the resumed state
    reloaded its history from the checkpoint) and the lines logged after the last saved state."""
    run = tmp_path / "run"
    shutil.copytree(window_run, run, ignore=shutil.ignore_patterns("sftaudit"))
    lines = [
        {"current_steps": 5, "total_steps": 20, "loss": 7.1, "lr": 3e-3, "epoch": 0.1},
        {"current_steps": 10, "total_steps": 20, "loss": 9.5, "lr": 2e-3, "epoch": 0.2},  # abandoned by the restart
        {"current_steps": 10, "total_steps": 20, "loss": 6.9, "lr": 2e-3, "epoch": 0.2},
        {"current_steps": 15, "total_steps": 20, "loss": 6.8, "lr": 1e-3, "epoch": 0.3},
        {"current_steps": 20, "total_steps": 20, "loss": 6.7, "lr": 5e-4, "epoch": 0.4},
    ]  # after the last save
    (run / "trainer_log.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    done = import_run(run)
    assert done["resumed_at"] == 10 and done["abandoned_steps"] == [10]
    assert done["steps"] == 5  # 5, 10, 15 from the states, 20 from the log, and the abandoned 10
    steps = pq.read_table(run / "sftaudit" / "rank-0" / "steps.parquet").to_pylist()
    assert [(s["seg"], s["step"], s["loss"]) for s in steps if s["step"] in (10, 20)][0] == (0, 10, 9.5)
    assert steps[-1]["step"] == 20 and steps[-1]["grad_norm"] is None


def _loss(step: int, branch: int) -> float:
    """A smoothly falling loss with a little deterministic noise (a branch's own)."""
    return 2.2 * math.exp(-step / 40) + 0.9 + 0.015 * math.sin(step * 2.7 + branch)


def test_tensorboard_event_files_alone_are_imported_with_the_abandoned_branch(tmp_path):
    """The Trainer's own TensorBoardCallback writes two starts of a run (crashed at step 47, resumed from
    checkpoint-40); the import reads them with tensorboard's loader and keeps the abandoned steps 41-47."""
    pytest.importorskip("tensorboard")
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from transformers.integrations import TensorBoardCallback

    run = tmp_path / "run"
    args = TrainingArguments(output_dir=str(run), report_to=["tensorboard"], use_cpu=True)
    for branch, steps in enumerate((range(1, 48), range(41, 61))):
        callback, state = TensorBoardCallback(), TrainerState()
        callback.on_train_begin(args, state, TrainerControl())
        for step in steps:
            state.global_step = step
            loss = _loss(step, branch) * (3.0 if branch and step == 52 else 1.0)  # the resumed branch spikes at 52
            callback.on_log(
                args,
                state,
                TrainerControl(),
                logs={
                    "loss": loss,
                    "grad_norm": 1.0 + 0.01 * (step % 3),
                    "learning_rate": 5e-5 * (1 - (step - 1) / 60),
                    "epoch": step / 120,
                },
            )
        callback.on_train_end(args, state, TrainerControl())
    con = _imported_with_steps_41_to_47_abandoned(run)
    try:
        loss_41 = con.execute("SELECT loss FROM steps WHERE step = 41").fetchone()[0]
        assert loss_41 == pytest.approx(_loss(41, 1), rel=1e-6)  # float32, as the callback stored it
    finally:
        con.close()
    assert main(["audit", str(run), "--out", str(tmp_path / "out"), "--no-report"]) == 0  # the spike warns
    verdict = json.loads((tmp_path / "out" / "verdict.json").read_text())
    spike = [f for f in verdict["findings"] if f["code"] == "LOOP-10" and f["severity"] != "info"]
    assert spike and spike[0]["step"] == 52, verdict["findings"]
    checks = {c["code"]: c for c in verdict["checks"]}
    assert checks["LOOP-05"]["sources"] == ["imported logs: TensorBoard event files"]
    assert verdict["check_errors"] == []


def test_data_that_cannot_be_rendered_or_a_shim_run_is_one_line_and_exit_2(clean_run, tmp_path, capsys):
    """`--data` needs the tokenizer the run saved (a LLaMA-Factory log alone has none) and a run trained
    without the shim (the shim recorded the real batches); a missing file is named. Nothing is written."""
    from pathlib import Path

    from sftaudit.fixtures import load_dataset

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in load_dataset()[:8]), encoding="utf-8")
    run = tmp_path / "run"
    shutil.copytree(Path(__file__).parent / "data" / "llamafactory-resumed", run)
    shim_files = sorted(p.relative_to(clean_run) for p in clean_run.rglob("*"))
    for args, reason in (
        (["audit", str(run), "--data", str(data)], "--data needs the tokenizer the run saved"),
        (["import", str(run), "--data", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
        (["audit", str(clean_run), "--data", str(data)], "--data is for runs trained without the shim"),
    ):
        capsys.readouterr()
        assert main([*args, "--out", str(tmp_path / "out")] if args[0] == "audit" else args) == 2
        err = capsys.readouterr().err
        assert reason in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(p.relative_to(clean_run) for p in clean_run.rglob("*")) == shim_files
    assert import_run(run)["steps"] == 67  # the failed --data left the run importable as it was
