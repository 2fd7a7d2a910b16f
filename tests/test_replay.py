"""`sftaudit replay`: the first anomalous step, the findings around it, the batches to skip, the
rollback checkpoint (with its safety margin) and how to resume; also on a run killed mid-step."""

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from sftaudit.checks import Finding
from sftaudit.cli import main
from sftaudit.commands.replay import replay, resume_command
from sftaudit.core.artifacts import rank_dir
from sftaudit.store.ingest import ingest
from sftaudit.store.rundb import connect, load_manifest
from sftaudit.verdict.attribution import build_verdict
from sftaudit.verdict.audit import audit
from sftaudit.verdict.config import AuditConfig

from .conftest import NAN_STEP


def batch_ids(run, first, last):
    con = connect(run, read_only=True)
    try:
        return [
            (s, ids)
            for s, ids in con.execute(
                "SELECT step, flatten(list(sample_ids ORDER BY micro)) FROM batches WHERE step BETWEEN ? AND ? "
                "GROUP BY step ORDER BY step",
                [first, last],
            ).fetchall()
        ]
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
    python, flag, code = shlex.split(resume["command"])
    assert (python, flag) == ("python", "-c")
    assert code.startswith(
        f'from sftaudit.fixtures.train import train_plain; train_plain("{nan_run}", steps=20, '
        f'resume_from="{nan_run}/checkpoint-10", skip_steps=[11, 12, 13], '
    )
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
    typed = manifest["orig_argv"]  # the command line as typed, interpreter and its flags included
    assert typed[0].endswith("python") and typed[1:3] == ["-u", "-c"]
    assert resume["command"] == shlex.join([*typed, "--resume_from_checkpoint", "run/checkpoint-5"])
    assert resume["trainer"] == "trainer.train(resume_from_checkpoint='run/checkpoint-5')"


def test_rollback_skips_a_checkpoint_that_fails_integrity():
    checkpoints = [{"name": f"checkpoint-{s}", "step": s, "path": f"checkpoint-{s}"} for s in (5, 10, 15)]
    findings = [
        Finding("LOOP-05", "fail", "nan", step=13),
        Finding("LOOP-09", "fail", "nan weights", step=10, checkpoint="checkpoint-10"),
    ]
    verdict = build_verdict("r", findings, checkpoints)
    assert verdict["first_anomalous_step"] == 13  # a checkpoint finding is not a training anomaly
    assert verdict["rollback_checkpoint"] == "checkpoint-5"
    assert [c["verdict"] for c in verdict["checkpoints"]] == ["pass", "fail", "fail"]
    assert build_verdict("r", findings[:1], checkpoints)["rollback_checkpoint"] == "checkpoint-10"
    assert build_verdict("r", findings[:1], checkpoints, rollback_margin=9)["rollback_checkpoint"] is None


# ---------------------------------------------------------------- resume, end to end

# A run that fails at step 7 (NaN loss), multi-epoch: 10 rows in batches of 4, checkpoints every 3 steps.
SMALL = dict(dataset_rows=10, batch_size=4, max_length=64, probe_every=0, generate_every=0, eval_every=0)


def timeline(run):
    con = connect(run, read_only=True)
    try:
        live = con.execute("SELECT seg, min(step), max(step) FROM steps GROUP BY seg ORDER BY seg").fetchall()
        abandoned = con.execute("SELECT seg, min(step), max(step) FROM superseded_steps GROUP BY seg").fetchall()
    finally:
        con.close()
    return live, abandoned


@pytest.mark.slow
def test_a_plain_run_resumed_with_the_printed_command_audits_pass(tmp_path, tokenizer_cache):
    from sftaudit.fixtures.train import train_plain

    run = train_plain(
        tmp_path / "plain",
        steps=8,
        checkpoint_every=3,
        order="sampler",
        faults={"nan_at": 7},
        tokenizer_cache=tokenizer_cache,
        **SMALL,
    )
    doc = replay(run)
    assert doc["first_anomalous_step"] == 7 and doc["rollback_checkpoint"]["name"] == "checkpoint-6"
    assert doc["resume"]["skip_steps"] == [7]
    # Run exactly what replay printed (its `python` is this interpreter): resume, skipping step 7's batch.
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(shlex.split(doc["resume"]["command"]), check=True, env=env, capture_output=True)
    after = audit(run)
    assert after["verdict"] == "pass", after["findings"]
    skipped = [f for f in after["findings"] if f["code"] == "LOOP-11"]
    assert [(f["severity"], f["step"], f["evidence"]["skipped_steps"]) for f in skipped] == [("info", 7, [7])]
    assert timeline(run) == ([(0, 1, 6), (1, 7, 8)], [(0, 7, 8)])


@pytest.mark.slow
@pytest.mark.parametrize("trl", [False, True], ids=["trainer", "trl"])
def test_a_trainer_run_resumed_from_the_named_checkpoint_audits_pass(trl, tmp_path, tokenizer_cache):
    from sftaudit.fixtures.train import train_hf

    options = dict(steps=8, save_steps=3, trl=trl, tokenizer_cache=tokenizer_cache, **SMALL)
    run = train_hf(tmp_path / "hf", faults={"nan_at": 7}, **options)
    doc = replay(run)
    assert doc["first_anomalous_step"] == 7 and doc["rollback_checkpoint"]["name"] == "checkpoint-6"
    resume = doc["resume"]
    assert resume["trainer"] == f"trainer.train(resume_from_checkpoint={resume['resume_from_checkpoint']!r})"
    # What the printed call does: the Trainer restores weights, optimizer, scheduler, RNG and data position
    # (its seeded sampler skips the epoch's trained batches); the Trainer has no way to skip others.
    train_hf(run, resume_from=resume["resume_from_checkpoint"], **options)
    after = audit(run)
    assert after["verdict"] == "pass", after["findings"]
    assert timeline(run) == ([(0, 1, 6), (1, 7, 8)], [(0, 7, 8)])


# ---------------------------------------------------------------- only anomalies are replayed


def test_configuration_findings_are_changes_not_batches_to_skip():
    """A last-turn-only setup found from step 1 (a configuration) and a NaN at step 13 (an anomaly): the
    rollback and the chain are the anomaly's; the configuration is listed as what to change."""
    from sftaudit.commands.replay import chain, configuration, to_text

    checkpoints = [{"name": f"checkpoint-{s}", "step": s, "path": f"checkpoint-{s}"} for s in (5, 10, 15)]
    setup = Finding("LOOP-04", "warn", "only the last turn is trained", step=1, category="configuration")
    findings = [setup, Finding("LOOP-05", "fail", "nan", step=13)]
    verdict = build_verdict("r", findings, checkpoints)
    assert verdict["first_anomalous_step"] == 13 and verdict["rollback_checkpoint"] == "checkpoint-10"
    assert [f["code"] for f in chain(verdict, 0, 23)] == ["LOOP-05"]
    assert configuration(verdict) == [
        {"code": "LOOP-04", "severity": "warn", "step": 1, "message": "only the last turn is trained"}
    ]
    # Without the anomaly nothing is rolled back or skipped; the change is still named.
    alone = build_verdict("r", [setup], checkpoints)
    assert alone["first_anomalous_step"] is None and alone["rollback_checkpoint"] is None
    doc = {"run": "r", "verdict": alone["verdict"], "first_anomalous_step": None, "configuration": configuration(alone)}
    assert to_text(doc).splitlines() == [
        "r: WARN; no anomalous step, nothing to replay",
        "configuration to change (no bad step: rolling back or skipping batches does not fix it):",
        "  LOOP-04 warn: only the last turn is trained",
    ]


@pytest.mark.slow
def test_replay_of_a_run_saving_weights_only(tmp_path, tokenizer_cache):
    from sftaudit.fixtures import layouts
    from sftaudit.fixtures.train import train_plain

    run = train_plain(
        tmp_path / "weights-only",
        steps=8,
        checkpoint_every=4,
        profile="prod",
        faults={"nan_at": 6},
        saver=layouts.step_folder_weights(),
        tokenizer_cache=tokenizer_cache,
    )
    doc = replay(run)
    assert doc["first_anomalous_step"] == 6 and doc["rollback_checkpoint"]["name"] == "step-4"
    assert doc["chain"] and all(f["category"] == "anomaly" for f in doc["chain"])
    [saves] = doc["configuration"]
    assert saves["code"] == "LOOP-09" and "weights-only saves (step-4, step-8)" in saves["message"]
