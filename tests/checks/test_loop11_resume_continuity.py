"""LOOP-11: a clean resume is silent; a resume that restarts the LR warmup, loses the weights or the
data position is found at its first resumed step; so is a resume from a checkpoint that fails LOOP-09;
plain loop and Trainer."""

import json
import shutil

import pytest

from sftaudit.artifacts import rank_dir
from sftaudit.audit import audit
from sftaudit.ingest import connect


def loop11(verdict):
    return [f for f in verdict["findings"] if f["code"] == "LOOP-11"]


@pytest.fixture(scope="module")
def verdict(resumed_run):
    return audit(resumed_run)


def test_each_faulty_resume_is_found_at_its_first_step(verdict):
    found = {(f["step"], f["severity"], f["message"].split(" ")[1]) for f in loop11(verdict)}
    # Resumes at 11 (clean), 16 (warmup restarted), 21 (weights lost), 26 (data position lost).
    assert found == {(16, "fail", "learning"), (21, "warn", "loss"), (26, "fail", "resuming")}


def test_restarted_warmup(verdict):
    lr = next(f for f in loop11(verdict) if f["step"] == 16)
    assert lr["evidence"]["lr_before"] == pytest.approx(3e-3)
    assert lr["evidence"]["lr_after"] == pytest.approx(3e-3 * 2 / 5)  # LambdaLR warmup, first step again
    assert lr["checkpoint"] == "checkpoint-20"


def test_lost_weights_show_as_a_loss_jump(verdict):
    jump = next(f for f in loop11(verdict) if f["step"] == 21)["evidence"]
    assert jump["loss_after"] - jump["loss_before"] > jump["threshold"] > 0


def test_reread_data_names_the_samples_and_steps(verdict, resumed_run):
    reread = next(f for f in loop11(verdict) if f["step"] == 26)
    con = connect(resumed_run, read_only=True)
    try:
        # The lost data position restarts the epoch: steps 26-30 train the batches of steps 1-5 again.
        first_batches = con.execute("SELECT flatten(list(sample_ids ORDER BY step)) FROM batches "
                                    "WHERE seg = 0 AND step <= 5").fetchall()[0][0]
    finally:
        con.close()
    assert reread["evidence"]["count"] == len(first_batches) == 40
    assert reread["evidence"]["sample_ids"] == first_batches
    assert reread["evidence"]["steps"] == [26, 27, 28, 29, 30]


def test_resume_from_a_checkpoint_that_fails_integrity(resumed_run, tmp_path):
    run = tmp_path / "resumed-copy"
    shutil.copytree(resumed_run, run)
    weights = run / "checkpoint-10" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    found = [f for f in loop11(audit(run)) if f["step"] == 11]
    assert len(found) == 1 and found[0]["severity"] == "fail"
    assert found[0]["evidence"]["source_checkpoint"] == "checkpoint-10"


def test_runs_never_resumed_are_silent(clean_run):
    assert loop11(audit(clean_run)) == []


def test_resume_from_a_checkpoint_never_recorded(resumed_run, tmp_path):
    # As if checkpoint-10 had been written while the shim was off: the resume's source is unknown.
    run = tmp_path / "unrecorded"
    shutil.copytree(resumed_run, run, ignore=shutil.ignore_patterns("audit.duckdb"))
    records = rank_dir(run, 0) / "checkpoints.jsonl"
    lines = records.read_text().splitlines(keepends=True)
    records.write_text("".join(line for line in lines if json.loads(line)["path"] != "checkpoint-10"))
    found = [f for f in loop11(audit(run)) if f["step"] == 11]
    assert len(found) == 1 and found[0]["severity"] == "fail"
    assert found[0]["evidence"] == {"resume_step": 11, "checkpoint_name": "checkpoint-10"}


@pytest.fixture(scope="module")
def trainer_resumed_run(tmp_path_factory, tokenizer_cache):
    """A Trainer run (linear LR decay) resumed cleanly from checkpoint-10, then from a copy of
    checkpoint-5 that lost its scheduler.pt (the Trainer then starts a fresh schedule)."""
    from sftaudit.fixtures.train import train_hf

    run = tmp_path_factory.mktemp("hf-resumed") / "hf-resumed"
    train_hf(run, steps=12, save_steps=5, tokenizer_cache=tokenizer_cache)
    train_hf(run, steps=12, save_steps=5, tokenizer_cache=tokenizer_cache, resume_from=run / "checkpoint-10")
    (run / "checkpoint-5" / "scheduler.pt").unlink()
    train_hf(run, steps=12, save_steps=5, tokenizer_cache=tokenizer_cache, resume_from=run / "checkpoint-5")
    return run


def test_trainer_resumes(trainer_resumed_run):
    found = loop11(audit(trainer_resumed_run))
    # The clean resume at step 11 is silent; the one at 6 jumps the LR back to its start and
    # came from a checkpoint that fails LOOP-09 (no scheduler state).
    assert {f["step"] for f in found} == {6}
    lr = next(f for f in found if "learning rate" in f["message"])
    assert lr["evidence"]["lr_before"] == pytest.approx(2e-3) and lr["evidence"]["lr_after"] == pytest.approx(3e-3)
    source = next(f for f in found if "source_checkpoint" in f["evidence"])
    assert source["evidence"]["source_checkpoint"] == "checkpoint-5" and "scheduler" in source["message"]
