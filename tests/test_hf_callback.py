"""The Trainer and TRL SFTTrainer paths record through SFTAuditCallback with no other change."""

import json

import pytest
from sftaudit.fixtures.train import train_hf

from sftaudit.core.artifacts import rank_dir
from sftaudit.store.ingest import ingest
from sftaudit.store.rundb import connect
from sftaudit.verdict.audit import audit

from .shared import shared_dir

pytestmark = pytest.mark.slow  # Trainer / TRL runs

HF_NAN_STEP = 7
SCALED_STEP = 11  # every gradient x1000 there, as backward computes it; the Trainer clips at max_grad_norm 1.0
QUIET = dict(steps=14, save_steps=7, batch_size=4, max_length=64, probe_every=0, generate_every=0, eval_every=0)


@pytest.fixture(scope="module")
def trainer_nan_run(tmp_path_factory, tokenizer_cache):
    return (
        shared_dir(
            tmp_path_factory,
            "hf-nan",
            lambda folder: train_hf(
                folder / "hf-nan",
                steps=12,
                save_steps=5,
                faults={"nan_at": HF_NAN_STEP},
                tokenizer_cache=tokenizer_cache,
            ),
        )
        / "hf-nan"
    )


def test_trainer_nan_is_found_at_its_step(trainer_nan_run):
    verdict = audit(trainer_nan_run)
    assert verdict["verdict"] == "fail"
    assert verdict["first_anomalous_step"] == HF_NAN_STEP
    # LOOP-13: the Trainer's logging_nan_inf_filter logged a finite loss at the NaN step (zoo Z18).
    assert {f["code"] for f in verdict["findings"] if f["step"] == HF_NAN_STEP} == {"LOOP-05", "LOOP-13"}
    assert verdict["rollback_checkpoint"] == "checkpoint-5"
    assert [c["name"] for c in verdict["checkpoints"]] == ["checkpoint-5", "checkpoint-10", "checkpoint-12"]


def test_trainer_records_batches_sample_ids_and_pre_clip_norm(trainer_nan_run):
    ingest(trainer_nan_run)  # not left to the test before it: each test of the module stands alone
    con = connect(trainer_nan_run, read_only=True)
    assert [s for (s,) in con.execute("SELECT step FROM steps ORDER BY step").fetchall()] == list(range(1, 13))
    ids = con.execute("SELECT sample_ids FROM batches WHERE step = 1").fetchall()[0][0]
    assert len(ids) == 8 and all(i.startswith("s") for i in ids)  # the collator's ids, stripped before forward
    pre_clip = con.execute("SELECT count(*) FROM metrics WHERE name = 'grad_norm'").fetchall()[0][0]
    assert pre_clip == 12
    manifest = json.loads((rank_dir(trainer_nan_run, 0) / "manifest.jsonl").read_text().splitlines()[0])
    # grad_norms are read at the end of backward, before the Trainer's clip; the post-clip ones beside them
    assert (manifest["grad_norm_source"], manifest["grad_norm_read"]) == ("pre_clip", "backward_end")
    assert manifest["config"]["training_args"]["max_steps"] == 12 and manifest["config"]["max_steps"] == 12
    # The optimizer inside the Trainer's accelerate wrapper, which LOOP-22 judges the learning rate against;
    # fp32 on CPU: no loss scaler, so no non-finite step can have been skipped.
    assert (manifest["optimizer"]["class"], manifest["optimizer"]["wrappers"]) == ("AdamW", ["AcceleratedOptimizer"])
    assert {g["initial_lr"] for g in manifest["optimizer"]["groups"]} == {3e-3}
    assert manifest["loss_scaler"] == {"present": False, "skips_nonfinite_steps": False}
    assert con.execute("SELECT count(*) FROM events WHERE kind = 'close' AND step = 12").fetchone()[0] == 1
    state = json.loads(
        con.execute("SELECT training_state FROM checkpoints WHERE step = 5 AND event='saved'").fetchall()[0][0]
    )
    assert state["optimizer"] and state["scheduler"] and state["rng_states"]


def test_trl_sft_trainer_clean_run(tmp_path, tokenizer_cache):
    """Probed as a user's run is: on the interval, at each save (the Trainer's save_steps) and at the last step."""
    run = train_hf(
        tmp_path / "trl-clean",
        steps=6,
        save_steps=3,
        trl=True,
        tokenizer_cache=tokenizer_cache,
        planned_probes=True,
        probe_every=4,
        generate_every=0,
        eval_every=0,
    )
    verdict = audit(run)
    assert verdict["verdict"] != "fail", verdict["findings"]
    con = connect(run, read_only=True)
    assert con.execute("SELECT count(*), min(loss) > 0 FROM steps").fetchall() == [(6, True)]
    assert [c["name"] for c in verdict["checkpoints"]] == ["checkpoint-3", "checkpoint-6"]
    assert [s for (s,) in con.execute("SELECT DISTINCT step FROM probes ORDER BY step").fetchall()] == [3, 4, 6]
    assert next(c for c in verdict["checks"] if c["code"] == "LOOP-22")["status"] == "ran"


@pytest.fixture(scope="module")
def trainer_grads_x1000(tmp_path_factory, tokenizer_cache):
    return (
        shared_dir(
            tmp_path_factory,
            "hf-x1000",
            lambda folder: train_hf(
                folder / "hf-x1000", faults={"grads_times_at": SCALED_STEP}, tokenizer_cache=tokenizer_cache, **QUIET
            ),
        )
        / "hf-x1000"
    )


def _norms(run):
    ingest(run)
    con = connect(run, read_only=True)
    try:
        return con.execute("""SELECT s.step, s.grad_norm, s.grad_norm_post_clip, m.value, s.grad_norm_source,
                                     (SELECT sqrt(sum(norm * norm)) FROM grad_norms g WHERE g.step = s.step)
                              FROM steps s JOIN metrics m ON m.step = s.step AND m.name = 'grad_norm'
                              ORDER BY s.step""").fetchall()
    finally:
        con.close()


def test_gradients_clipping_hid_are_recorded_pre_clip_and_found_at_their_step(trainer_grads_x1000):
    rows = _norms(trainer_grads_x1000)
    assert [r[0] for r in rows] == list(range(1, 15))
    for _step, pre, post, trainer_total, fallback, per_tensor_total in rows:
        # The per-tensor norms are what the Trainer's own pre-clip total was computed from
        assert pre == pytest.approx(trainer_total, rel=1e-5) and per_tensor_total == pytest.approx(pre, rel=1e-9)
        assert post <= 1.0 + 1e-5 and post == pytest.approx(min(pre, 1.0), rel=1e-5) and fallback is None
    assert rows[SCALED_STEP - 1][1] > 100 * rows[SCALED_STEP - 2][1]  # 1000x before the clip, 1.0 after
    verdict = audit(trainer_grads_x1000)
    assert verdict["first_anomalous_step"] == SCALED_STEP
    # Every tensor scaled alike: one isolated spike of the global norm, told by LOOP-27, with LOOP-05's global rule
    # (which read the per-tensor norms) folded into it.
    [spike] = [f for f in verdict["findings"] if f["severity"] != "info"]
    assert (spike["rule"], spike["step"]) == ("LOOP-27/spike", SCALED_STEP)
    [folded] = spike["evidence"]["also_flagged_by"]
    assert folded["rule"] == "LOOP-05/global-spike" and "no single tensor standing out" in folded["message"]


def test_the_clean_twin_raises_no_gradient_finding(tmp_path, tokenizer_cache):
    run = train_hf(tmp_path / "hf-clean", tokenizer_cache=tokenizer_cache, **QUIET)
    assert [f for f in audit(run)["findings"] if f["code"] == "LOOP-05"] == []
    assert all(r[1] == pytest.approx(r[3], rel=1e-5) for r in _norms(run))
