"""LOOP-05: planted faults fire at their step with the right tensors; the clean run stays silent."""

from sftaudit.audit import audit
from sftaudit.ingest import connect

from ..conftest import NAN_STEP


def loop05(verdict):
    return [f for f in verdict["findings"] if f["code"] == "LOOP-05"]


def test_nan_loss_and_gradients_fail_at_the_planted_step(nan_run):
    verdict = audit(nan_run)
    assert verdict["verdict"] == "fail"
    assert verdict["first_anomalous_step"] == NAN_STEP
    findings = loop05(verdict)
    assert {f["severity"] for f in findings} == {"fail"}
    assert {f["step"] for f in findings} == {NAN_STEP}
    grads = next(f for f in findings if "gradients" in f["message"])
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


def test_clean_run_raises_nothing(clean_run):
    verdict = audit(clean_run)
    assert loop05(verdict) == []
    assert verdict["first_anomalous_step"] is None
