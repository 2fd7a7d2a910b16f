"""`sftaudit replay`: the first anomalous step, the findings around it, the batches to skip, the
rollback checkpoint (with its safety margin) and how to resume; also on a run killed mid-step."""

import json
import shlex
import shutil

from sftaudit.artifacts import rank_dir
from sftaudit.checks import Finding
from sftaudit.cli import main
from sftaudit.config import AuditConfig
from sftaudit.ingest import connect, ingest, load_manifest
from sftaudit.replay import replay, resume_command
from sftaudit.verdict import build_verdict

from .conftest import NAN_STEP


def batch_ids(run, first, last):
    con = connect(run, read_only=True)
    try:
        return [(s, ids) for s, ids in con.execute(
            "SELECT step, flatten(list(sample_ids ORDER BY micro)) FROM batches WHERE step BETWEEN ? AND ? "
            "GROUP BY step ORDER BY step", [first, last]).fetchall()]
    finally:
        con.close()


def test_replay_of_a_diverged_run(nan_run, capsys):
    assert main(["replay", str(nan_run), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["first_anomalous_step"] == NAN_STEP
    assert doc["rollback_checkpoint"] == {"name": "checkpoint-10", "step": 10, "path": "checkpoint-10"}
    assert {(f["code"], f["step"]) for f in doc["chain"]} >= {("LOOP-05", NAN_STEP)}
    assert all(10 < f["step"] <= NAN_STEP + 10 for f in doc["chain"])
    assert [(b["step"], b["sample_ids"]) for b in doc["batches"]] == batch_ids(nan_run, 11, NAN_STEP)
    resume = doc["resume"]
    assert resume["resume_from_checkpoint"] == str(nan_run / "checkpoint-10")
    assert resume["skip_steps"] == [11, 12, 13]
    # The plain loop's own resume template (recorder config), filled in.
    assert resume["command"] == shlex.join(["python", "-c", "from sftaudit.fixtures.train import train_plain; "
                                            f'train_plain("{nan_run}", steps=20, resume_from="{nan_run}/checkpoint-10")'])
    assert resume["trainer"] is None


def test_a_safety_margin_moves_the_rollback_earlier(nan_run):
    doc = replay(nan_run, AuditConfig(rollback_margin=4))  # checkpoint-10 is only 3 steps before step 13
    assert doc["rollback_checkpoint"] is None and doc["resume"] is None
    assert [b["step"] for b in doc["batches"]] == list(range(1, NAN_STEP + 1))


def test_replay_text_and_a_clean_run(nan_run, clean_run, capsys):
    assert main(["replay", str(nan_run)]) == 1
    out = capsys.readouterr().out
    assert f"first anomalous step {NAN_STEP}" in out and "roll back to checkpoint-10" in out
    assert main(["replay", str(clean_run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["first_anomalous_step"] is None


def test_replay_of_a_run_killed_mid_step(nan_run, tmp_path):
    # What SIGKILL leaves: the records of the step in flight torn mid-line.
    run = tmp_path / "killed"
    shutil.copytree(nan_run, run, ignore=shutil.ignore_patterns("audit.duckdb"))
    for kind, keep in (("steps", 15), ("batches", 16)):
        path = rank_dir(run, 0) / f"{kind}.jsonl"
        lines = path.read_bytes().splitlines(keepends=True)
        path.write_bytes(b"".join(lines[:keep]) + lines[keep][: len(lines[keep]) // 2])
    doc = replay(run)
    assert doc["first_anomalous_step"] == NAN_STEP
    assert doc["rollback_checkpoint"]["name"] == "checkpoint-10"


def test_a_trainer_run_resumes_through_resume_from_checkpoint(hf_checkpoint_fault_run):
    ingest(hf_checkpoint_fault_run)
    con = connect(hf_checkpoint_fault_run, read_only=True)
    try:
        manifest = load_manifest(con)
    finally:
        con.close()
    resume = resume_command(manifest, "run/checkpoint-5")
    assert resume["command"] == shlex.join([*manifest["argv"], "--resume_from_checkpoint", "run/checkpoint-5"])
    assert resume["trainer"] == "trainer.train(resume_from_checkpoint='run/checkpoint-5')"


def test_rollback_skips_a_checkpoint_that_fails_integrity():
    checkpoints = [{"name": f"checkpoint-{s}", "step": s, "path": f"checkpoint-{s}"} for s in (5, 10, 15)]
    findings = [Finding("LOOP-05", "fail", "nan", step=13),
                Finding("LOOP-09", "fail", "nan weights", step=10, checkpoint="checkpoint-10")]
    verdict = build_verdict("r", findings, checkpoints)
    assert verdict["first_anomalous_step"] == 13  # a checkpoint finding is not a training anomaly
    assert verdict["rollback_checkpoint"] == "checkpoint-5"
    assert [c["verdict"] for c in verdict["checkpoints"]] == ["pass", "fail", "fail"]
    assert build_verdict("r", findings[:1], checkpoints)["rollback_checkpoint"] == "checkpoint-10"
    assert build_verdict("r", findings[:1], checkpoints, rollback_margin=9)["rollback_checkpoint"] is None
