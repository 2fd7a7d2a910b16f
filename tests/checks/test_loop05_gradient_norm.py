"""LOOP-05: planted faults fire at their step with the right tensors; the clean run stays silent."""

from sftaudit.audit import audit
from sftaudit.ingest import connect

from ..conftest import NAN_STEP
from .dynamics_runs import DEFAULT_SCALED_TENSOR, FROZEN_TENSOR, SCALE_STEP, SPIKE_EVERY, SPIKE_START, of, run


def loop05(verdict):
    return [f for f in verdict["findings"] if f["code"] == "LOOP-05"]


def test_nan_loss_and_gradients_fail_at_the_planted_step(nan_run):
    verdict = audit(nan_run)
    assert verdict["verdict"] == "fail"
    assert verdict["first_anomalous_step"] == NAN_STEP
    findings = loop05(verdict)
    assert {f["severity"] for f in findings} == {"fail"}
    assert {f["step"] for f in findings} == {NAN_STEP}
    grads = next(f for f in findings if "non-finite" in f["message"] and "gradients" in f["message"])
    tensors = {t["tensor"]: t for t in grads["evidence"]["tensors"]}
    # A NaN loss poisons every tensor: all are counted, the first 20 (model order) listed.
    n_params = connect(nan_run, read_only=True).execute("SELECT count(*) FROM params WHERE idx IS NOT NULL").fetchall()[0][0]
    assert grads["evidence"]["tensor_count"] == n_params
    assert list(tensors)[0] == "model.embed_tokens.weight" and len(tensors) == min(n_params, 20)
    assert all(t["nonfinite_elements"] > 0 for t in tensors.values())
    loss = next(f for f in findings if "loss" in f["message"])
    assert loss["evidence"]["last_finite_loss"] > 0
    # The checkpoint window the anomaly falls in, and the last one before it to roll back to.
    assert grads["checkpoint"] == "checkpoint-20"
    assert verdict["rollback_checkpoint"] == "checkpoint-10"
    by_name = {c["name"]: c["verdict"] for c in verdict["checkpoints"]}
    assert by_name == {"checkpoint-10": "pass", "checkpoint-20": "fail"}


def test_one_layer_scaled_x100_fails_at_its_first_step_with_the_histogram(runs):
    verdict = audit(run(runs, "grad_scale"))
    [finding] = of(verdict, "LOOP-05")
    assert (finding["severity"], finding["step"]) == ("fail", SCALE_STEP)
    [tensor] = finding["evidence"]["tensors"]
    assert tensor["tensor"] == DEFAULT_SCALED_TENSOR
    assert tensor["effect_size"] > 30 and tensor["p_value"] < 1e-6 and tensor["z_across"] >= 3
    histogram = finding["evidence"]["histogram"]
    assert (histogram["tensor"], histogram["step"]) == (DEFAULT_SCALED_TENSOR, SCALE_STEP)
    assert len(histogram["counts"]) == len(histogram["edges"]) - 1 and sum(histogram["counts"]) > 0
    assert verdict["first_anomalous_step"] == SCALE_STEP
    chain = verdict["first_anomaly_chain"]
    assert chain[0]["step"] == SCALE_STEP and any(c["code"] == "LOOP-05" for c in chain)


def test_periodic_spikes_are_one_finding_with_the_period(runs):
    verdict = audit(run(runs, "periodic"))
    [finding] = of(verdict, "LOOP-05")
    assert (finding["severity"], finding["step"]) == ("warn", SPIKE_START)
    assert finding["evidence"]["period"] == SPIKE_EVERY
    assert finding["evidence"]["tensors"][0]["tensor"] == "lm_head.weight"
    assert finding["evidence"]["spike_steps"][:2] == [SPIKE_START, SPIKE_START + SPIKE_EVERY]
    assert verdict["first_anomalous_step"] == SPIKE_START


def test_parameter_left_out_of_the_optimizer_fails_from_step_1(runs):
    verdict = audit(run(runs, "frozen"))
    [finding] = of(verdict, "LOOP-05")
    assert (finding["severity"], finding["step"]) == ("fail", 1)
    assert [t["tensor"] for t in finding["evidence"]["tensors"]] == [FROZEN_TENSOR]
    assert finding["evidence"]["compared"]["to"] == "checkpoint-10"
    assert verdict["first_anomalous_step"] == 1


def test_clean_run_raises_nothing(clean_run):
    verdict = audit(clean_run)
    assert loop05(verdict) == []
    assert verdict["first_anomalous_step"] is None
    assert verdict["first_anomaly_chain"] == []
