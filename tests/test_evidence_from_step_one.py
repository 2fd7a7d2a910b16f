"""The first batch of every segment (a run's start, each resume) is recorded whole in every profile:
a data bug present from step 1 is dated step 1, and `gate` fails the first checkpoint trained with it."""

import pytest

from sftaudit.audit import audit
from sftaudit.cli import main
from sftaudit.fixtures.train import train_plain
from sftaudit.ingest import connect, ingest

QUIET = dict(probe_every=0, generate_every=0, eval_every=0)


@pytest.fixture(scope="module")
def pad_eos_default_profile(tmp_path_factory, tokenizer_cache):
    """pad = eos with the padding masked, from step 1, under the default profile (rows every 50 steps)."""
    return train_plain(tmp_path_factory.mktemp("pad-eos") / "pad-eos", steps=6, checkpoint_every=2, profile="preprod",
                       faults={"pad_is_eos": True}, tokenizer_cache=tokenizer_cache, **QUIET)


def test_the_first_step_is_recorded_whole_and_the_schedule_after_it(pad_eos_default_profile):
    ingest(pad_eos_default_profile)
    con = connect(pad_eos_default_profile, read_only=True)
    assert con.execute("SELECT step, count(*) FROM samples GROUP BY step").fetchall() == [(1, 8)]  # all 8 rows


def test_a_data_bug_from_step_1_is_dated_step_1_and_fails_the_first_checkpoint(pad_eos_default_profile):
    verdict = audit(pad_eos_default_profile)
    assert verdict["first_anomalous_step"] == 1
    assert {f["code"] for f in verdict["findings"] if f["severity"] == "fail" and f["step"] == 1} >= {"LOOP-02", "LOOP-04"}
    assert [c["verdict"] for c in verdict["checkpoints"]] == ["fail", "fail", "fail"]
    assert main(["gate", str(pad_eos_default_profile), "--checkpoint", "checkpoint-2"]) == 1


def test_each_resume_records_its_first_step_whole(tmp_path, tokenizer_cache):
    run = tmp_path / "resumed"
    train_plain(run, steps=4, checkpoint_every=2, profile="prod", tokenizer_cache=tokenizer_cache, **QUIET)
    train_plain(run, steps=6, checkpoint_every=2, profile="prod", resume_from=run / "checkpoint-2",
                tokenizer_cache=tokenizer_cache, **QUIET)
    ingest(run)
    con = connect(run, read_only=True)
    kept = con.execute("SELECT seg, step, count(*) FROM samples GROUP BY ALL ORDER BY seg, step").fetchall()
    # seg 0 from step 1, seg 1 (the resume) from step 3; the abandoned seg-0 step 3 is superseded
    assert kept == [(0, 1, 8), (1, 3, 8)]
