"""The Trainer and TRL SFTTrainer paths record through SFTAuditCallback with no other change."""

import json

import pytest

from sftaudit.artifacts import rank_dir
from sftaudit.audit import audit
from sftaudit.fixtures.train import train_hf
from sftaudit.ingest import connect

HF_NAN_STEP = 7


@pytest.fixture(scope="module")
def trainer_nan_run(tmp_path_factory, tokenizer_cache):
    return train_hf(tmp_path_factory.mktemp("hf") / "hf-nan", steps=12, save_steps=5,
                    faults={"nan_at": HF_NAN_STEP}, tokenizer_cache=tokenizer_cache)


def test_trainer_nan_is_found_at_its_step(trainer_nan_run):
    verdict = audit(trainer_nan_run)
    assert verdict["verdict"] == "fail"
    assert verdict["first_anomalous_step"] == HF_NAN_STEP
    # LOOP-13: the Trainer's logging_nan_inf_filter logged a finite loss at the NaN step (zoo Z18).
    assert {f["code"] for f in verdict["findings"] if f["step"] == HF_NAN_STEP} == {"LOOP-05", "LOOP-13"}
    assert verdict["rollback_checkpoint"] == "checkpoint-5"
    assert [c["name"] for c in verdict["checkpoints"]] == ["checkpoint-5", "checkpoint-10", "checkpoint-12"]


def test_trainer_records_batches_sample_ids_and_pre_clip_norm(trainer_nan_run):
    con = connect(trainer_nan_run, read_only=True)
    assert [s for (s,) in con.execute("SELECT step FROM steps ORDER BY step").fetchall()] == list(range(1, 13))
    ids = con.execute("SELECT sample_ids FROM batches WHERE step = 1").fetchall()[0][0]
    assert len(ids) == 8 and all(i.startswith("s") for i in ids)  # the collator's ids, stripped before forward
    pre_clip = con.execute("SELECT count(*) FROM metrics WHERE name = 'grad_norm'").fetchall()[0][0]
    assert pre_clip == 12
    manifest = json.loads((rank_dir(trainer_nan_run, 0) / "manifest.jsonl").read_text().splitlines()[0])
    assert manifest["grad_norm_source"] == "post_clip"
    assert manifest["config"]["training_args"]["max_steps"] == 12
    state = json.loads(con.execute("SELECT training_state FROM checkpoints WHERE step = 5 AND event='saved'").fetchall()[0][0])
    assert state["optimizer"] and state["scheduler"] and state["rng_states"]


def test_trl_sft_trainer_clean_run(tmp_path, tokenizer_cache):
    run = train_hf(tmp_path / "trl-clean", steps=6, save_steps=3, trl=True, tokenizer_cache=tokenizer_cache)
    verdict = audit(run)
    assert verdict["verdict"] != "fail", verdict["findings"]
    con = connect(run, read_only=True)
    assert con.execute("SELECT count(*), min(loss) > 0 FROM steps").fetchall() == [(6, True)]
    assert [c["name"] for c in verdict["checkpoints"]] == ["checkpoint-3", "checkpoint-6"]
