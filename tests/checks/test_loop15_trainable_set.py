"""LOOP-15: layers without gradients under reentrant checkpointing (Z26), a module declared trainable
but frozen (Z27) and stale gradients (Z29) are found at their step; clean runs stay quiet."""

from sftaudit.audit import audit

from .dynamics_runs import STALE_STEP, of, run


def test_reentrant_checkpointing_and_a_frozen_declared_module_fail(runs):
    findings = of(audit(run(runs, "trainable_set")), "LOOP-15")
    declared = next(f for f in findings if "declared" in f["message"])
    assert (declared["severity"], declared["step"]) == ("fail", 1)
    assert declared["evidence"]["tensors"] == ["lm_head.weight"]
    starved = next(f for f in findings if "no gradient" in f["message"])
    assert (starved["severity"], starved["step"]) == ("fail", 3)  # min_steps = 3 steps in a row
    tensors = {t["tensor"] for t in starved["evidence"]["tensors"]}
    assert "model.layers.0.self_attn.q_proj.weight" in tensors and "model.layers.1.mlp.down_proj.weight" in tensors
    assert not any(t.startswith(("model.norm", "model.embed_tokens", "lm_head")) for t in tensors)
    assert not [f for f in findings if "bit-identical" in f["message"]]


def test_stale_gradients_fail_at_their_first_step_naming_the_layer(runs):
    [finding] = of(audit(run(runs, "stale_grads")), "LOOP-15")
    assert (finding["severity"], finding["step"]) == ("fail", STALE_STEP)
    tensors = [t["tensor"] for t in finding["evidence"]["tensors"]]
    assert tensors and all(t.startswith("model.layers.1.") for t in tensors)
    assert finding["evidence"]["steps_affected"] == 8 - STALE_STEP + 1


def test_clean_and_failed_runs_raise_nothing(clean_run, nan_run):
    for run_dir in (clean_run, nan_run):
        assert of(audit(run_dir), "LOOP-15") == []
