"""The first batch of every segment (a run's start, each resume) is recorded whole in every profile:
a data bug present from step 1 is dated step 1, and `gate` fails the first checkpoint trained with it."""

import pytest
from sftaudit.fixtures.train import train_plain

from sftaudit.cli import main
from sftaudit.store.ingest import ingest
from sftaudit.store.rundb import connect
from sftaudit.verdict.audit import audit

from .shared import shared_dir

QUIET = dict(probe_every=0, generate_every=0, eval_every=0)


@pytest.fixture(scope="module")
def pad_eos_default_profile(tmp_path_factory, tokenizer_cache):
    """pad = eos with the padding masked, from step 1, under the default profile (rows every 50 steps)."""
    return (
        shared_dir(
            tmp_path_factory,
            "pad-eos",
            lambda folder: train_plain(
                folder / "pad-eos",
                steps=6,
                checkpoint_every=2,
                profile="preprod",
                faults={"pad_is_eos": True},
                tokenizer_cache=tokenizer_cache,
                **QUIET,
            ),
        )
        / "pad-eos"
    )


def test_the_first_step_is_recorded_whole_and_the_schedule_after_it(pad_eos_default_profile):
    ingest(pad_eos_default_profile)
    con = connect(pad_eos_default_profile, read_only=True)
    assert con.execute("SELECT step, count(*) FROM samples GROUP BY step").fetchall() == [(1, 8)]  # all 8 rows


def test_a_configuration_bug_from_step_1_fails_every_checkpoint_and_gets_configuration_advice(
    pad_eos_default_profile, capsys
):
    """pad = eos with the padding masked is the setup, seen from step 1: every checkpoint fails, but it dates
    no anomaly, so replay names what to change and lists no batch to skip or checkpoint to roll back to."""
    from sftaudit.commands.replay import replay, to_text

    verdict = audit(pad_eos_default_profile)
    at_1 = [f for f in verdict["findings"] if f["severity"] == "fail" and f["step"] == 1]
    assert {f["code"] for f in at_1} >= {"LOOP-02", "LOOP-04"}
    assert {f["category"] for f in at_1} == {"configuration"} and verdict["first_anomalous_step"] is None
    assert [c["verdict"] for c in verdict["checkpoints"]] == ["fail", "fail", "fail"]
    assert main(["gate", str(pad_eos_default_profile), "--checkpoint", "checkpoint-2"]) == 1
    doc = replay(pad_eos_default_profile)
    assert doc["batches"] == [] and doc["resume"] is None and doc["rollback_checkpoint"] is None
    assert {f["code"] for f in doc["configuration"]} >= {"LOOP-02", "LOOP-04"}
    text = to_text(doc)
    assert "inspect or skip" not in text and "restart from scratch" not in text and "configuration to change" in text


@pytest.mark.slow
def test_each_resume_records_its_first_step_whole(tmp_path, tokenizer_cache):
    run = tmp_path / "resumed"
    train_plain(run, steps=4, checkpoint_every=2, profile="prod", tokenizer_cache=tokenizer_cache, **QUIET)
    train_plain(
        run,
        steps=6,
        checkpoint_every=2,
        profile="prod",
        resume_from=run / "checkpoint-2",
        tokenizer_cache=tokenizer_cache,
        **QUIET,
    )
    ingest(run)
    con = connect(run, read_only=True)
    kept = con.execute("SELECT seg, step, count(*) FROM samples GROUP BY ALL ORDER BY seg, step").fetchall()
    # seg 0 from step 1, seg 1 (the resume) from step 3; the abandoned seg-0 step 3 is superseded
    assert kept == [(0, 1, 8), (1, 3, 8)]


# ------------------------------------------------------------------ a run that stopped early (issue 25, item 3)

KILLED = """
import sys
from sftaudit.fixtures.train import train_plain
train_plain(sys.argv[1], steps=80, checkpoint_every=2, profile="preprod", tokenizer_cache=sys.argv[2],
            probe_every=0, generate_every=0, eval_every=0, faults={"sigkill_after": 3})
"""


def _completion_check():
    """The check that compares the recorded steps with the planned length (another helper's, merged by the
    lead): found by its name among the registered checks, None until it is there."""
    from sftaudit.checks import registered_checks

    return next(
        (c for c in registered_checks() if any(w in c.name.lower() for w in ("complet", "plan", "stopped early"))), None
    )


@pytest.fixture(scope="module")
def killed_at_3_of_80(tmp_path_factory, tokenizer_cache):
    import signal
    import subprocess
    import sys

    def kill(folder):
        proc = subprocess.run(
            [sys.executable, "-c", KILLED, str(folder / "killed"), str(tokenizer_cache)],
            capture_output=True,
            timeout=600,
        )
        assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]

    return shared_dir(tmp_path_factory, "killed", kill) / "killed"


def test_a_killed_run_records_its_plan_and_no_close(killed_at_3_of_80):
    import json

    from sftaudit.core.artifacts import rank_dir

    manifest = json.loads((rank_dir(killed_at_3_of_80, 0) / "manifest.jsonl").read_text().splitlines()[0])
    assert manifest["config"]["max_steps"] == 80
    ingest(killed_at_3_of_80)
    con = connect(killed_at_3_of_80, read_only=True)
    assert con.execute("SELECT max(step) FROM steps").fetchone()[0] == 3
    assert con.execute("SELECT count(*) FROM events WHERE kind = 'close'").fetchone()[0] == 0


def test_a_run_killed_at_step_3_of_80_is_not_a_pass_and_says_3_of_80(killed_at_3_of_80):
    """Needs the completion check (LOOP-19 or later, merged from another branch): skipped, naming it, until then."""
    check = _completion_check()
    if check is None:
        pytest.skip(
            "no completion/plan check registered yet (issue 25 item 3, analyzer side): this test runs once it is merged"
        )
    verdict = audit(killed_at_3_of_80)
    assert verdict["verdict"] not in ("pass",), verdict["findings"]
    stopped = [f for f in verdict["findings"] if f["code"] == check.code]
    assert stopped and "3 of 80" in stopped[0]["message"], stopped


def test_a_finished_run_closes_with_its_last_step_and_the_keyword_plan(tmp_path, tokenizer_cache):
    import json

    import torch
    from sftaudit.fixtures import build_model, build_tokenizer

    from sftaudit.core.artifacts import rank_dir
    from sftaudit.shim import Recorder

    tok = build_tokenizer(tokenizer_cache)
    model = build_model(tok)
    with pytest.raises(RuntimeError), Recorder(tmp_path / "r", model, tok, max_steps=5, config={"lr": 1.0}) as rec:
        ids = torch.tensor([[1, 5, 6, 7]])
        rec.on_batch(1, {"input_ids": ids, "labels": ids})
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        rec.on_backward(1, out.loss)
        rec.on_step_end(1, lr=1.0)
        raise RuntimeError("out of memory")
    folder = rank_dir(tmp_path / "r", 0)
    manifest = json.loads((folder / "manifest.jsonl").read_text().splitlines()[0])
    assert manifest["config"] == {"lr": 1.0, "max_steps": 5}
    close = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()][-1]
    assert (close["kind"], close["step"], close["error"]) == ("close", 1, "RuntimeError: out of memory")
