"""LOOP-05: planted faults fire at their step with the right tensors; the clean run stays silent."""

import numpy as np

from sftaudit.outputs import Rendering
from sftaudit.outputs.terminal import render
from sftaudit.store.rundb import connect
from sftaudit.verdict.audit import audit
from sftaudit.verdict.config import AuditConfig

from ..conftest import NAN_STEP
from ..shared import cached_audit
from .curve_runs import audit_state, history, state_run
from .dynamics_runs import (
    COLLAPSE_STEP,
    DEFAULT_SCALED_TENSOR,
    FROZEN_TENSOR,
    SCALE_STEP,
    SPIKE_EVERY,
    SPIKE_START,
    of,
    recorded_series_run,
    run,
)
from .logged_runs import falling


def loop05(verdict):
    return [f for f in verdict["findings"] if f["code"] == "LOOP-05"]


def test_nan_loss_and_gradients_fail_at_the_planted_step(nan_run):
    verdict = cached_audit(nan_run)
    assert verdict["verdict"] == "fail"
    assert verdict["first_anomalous_step"] == NAN_STEP
    findings = loop05(verdict)
    assert {f["severity"] for f in findings} == {"fail"}
    assert {f["step"] for f in findings} == {NAN_STEP}
    grads = next(f for f in findings if "non-finite" in f["message"] and "gradients" in f["message"])
    tensors = {t["tensor"]: t for t in grads["evidence"]["tensors"]}
    # A NaN loss poisons every tensor: all are counted, the first 20 (model order) listed.
    n_params = (
        connect(nan_run, read_only=True).execute("SELECT count(*) FROM params WHERE idx IS NOT NULL").fetchall()[0][0]
    )
    assert grads["evidence"]["tensor_count"] == n_params
    assert list(tensors)[0] == "model.embed_tokens.weight" and len(tensors) == min(n_params, 20)
    assert all(t["nonfinite_elements"] > 0 for t in tensors.values())
    loss = next(f for f in findings if "loss" in f["message"])
    assert loss["evidence"]["last_finite_loss"] > 0
    # LOOP-25 leaves a shim run's non-finite loss and gradients to LOOP-05: reported once.
    assert not [f for f in verdict["findings"] if f["code"] == "LOOP-25" and f["severity"] != "info"]
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
    verdict = cached_audit(clean_run)
    assert loop05(verdict) == []
    assert verdict["first_anomalous_step"] is None
    assert verdict["first_anomaly_chain"] == []


# The sweep's Z25 run (60 steps, cosine, warmup 10, lr 3e-3): the norms of the layer scaled x100 from step 37,
# as recorded. Its previous 8-step block (steps 25-32) was volatile (0.07..0.68): against that block alone the
# x66 jump reached z 4.6 < 6; the sigma from the median of 4 blocks finds it.
Z25_LAYER = [
    0.07833,
    0.09006,
    0.09309,
    0.06732,
    0.06663,
    0.06552,
    0.06195,
    0.05498,
    0.04756,
    0.05782,
    0.05571,
    0.05109,
    0.05468,
    0.06532,
    0.05474,
    0.09591,
    0.08484,
    0.06375,
    0.06983,
    0.05588,
    0.1158,
    0.2506,
    0.07845,
    0.06516,
    0.07107,
    0.0949,
    0.1971,
    0.1342,
    0.3272,
    0.6781,
    0.5892,
    0.1298,
    0.07236,
    0.1218,
    0.1134,
    0.1341,
    10.95,
    13.35,
    15.59,
    29.04,
]
# The sweep's clean-15 (Adafactor, lr 3e-3, warmup 10): global norms of steps 1-24. Block 1-12 is mostly warmup
# (the untrained model's calm norms), so step 18 (8.45) looked 11x its baseline: a false alarm.
ADAFACTOR_GLOBAL = [
    0.7164,
    0.7936,
    0.783,
    0.7971,
    0.8493,
    0.732,
    0.6704,
    0.8393,
    0.8183,
    0.8448,
    0.6166,
    0.6056,
    0.6615,
    2.792,
    0.6715,
    2.386,
    0.7228,
    8.452,
    0.5628,
    0.6879,
    1.023,
    0.7457,
    7.122,
    0.8385,
]


def warmup_then_cosine(steps, warmup=10, peak=3e-3, total=60):
    return [
        peak * (s / warmup if s <= warmup else 0.5 * (1 + np.cos(np.pi * (s - warmup) / (total - warmup))))
        for s in range(1, steps + 1)
    ]


def test_a_volatile_previous_block_does_not_hide_the_broken_layer(tmp_path):
    steps = len(Z25_LAYER)
    rng = np.random.default_rng(0)
    others = np.exp(rng.normal(-2, 1, 20)) * np.exp(0.15 * rng.standard_normal((steps, 20)))
    norms = np.column_stack([others, Z25_LAYER])
    names = [f"model.layers.{i}.weight" for i in range(20)] + [DEFAULT_SCALED_TENSOR]
    run_dir = recorded_series_run(tmp_path / "z25", warmup_then_cosine(steps), [1.0] * steps, norms, names)
    [finding] = of(audit(run_dir), "LOOP-05")
    assert (finding["severity"], finding["step"]) == ("fail", 37)
    assert finding["evidence"]["tensors"][0]["tensor"] == DEFAULT_SCALED_TENSOR


def test_a_warmup_block_is_no_baseline_for_a_spiky_optimizer(tmp_path):
    steps = len(ADAFACTOR_GLOBAL)
    norms = np.asarray(ADAFACTOR_GLOBAL)[:, None] * np.full((1, 4), 0.5)  # every tensor moves with the global norm
    run_dir = recorded_series_run(
        tmp_path / "adafactor",
        warmup_then_cosine(steps, total=200),
        [1.0] * steps,
        norms,
        [f"model.layers.{i}.weight" for i in range(4)],
    )
    assert (
        of(audit(run_dir, AuditConfig(check_options={"LOOP-05": {"window": 12}})), "LOOP-05") == []
    )  # the 200-step run's


def test_a_step_the_fp16_scaler_skipped_is_no_spike_and_no_non_finite_fail(tmp_path):
    """Every tensor's norm inf at step 33, the LR held there, finite again after: the update was skipped (LOOP-25's
    info). A non-finite gradient that stays (it reached the weights) still fails here, with its tensors."""
    steps = 70
    rng = np.random.default_rng(7)
    norms = np.exp(-1 + 0.2 * rng.standard_normal((steps, 4)))
    lr = warmup_then_cosine(steps, total=70)
    skipped = norms.copy()
    skipped[32] = np.inf
    lr_held = lr[:33] + lr[32:-1]
    names = [f"model.layers.{i}.weight" for i in range(4)]
    verdict = audit(recorded_series_run(tmp_path / "skip", lr_held, [1.0] * steps, skipped, names))
    assert loop05(verdict) == []
    assert [(f["code"], f["severity"], f["step"]) for f in verdict["findings"] if f["code"] == "LOOP-25"] == [
        ("LOOP-25", "info", 33)
    ]
    applied = norms.copy()
    applied[40:] = np.nan
    [finding] = loop05(audit(recorded_series_run(tmp_path / "applied", lr, [1.0] * steps, applied, names)))
    assert (finding["severity"], finding["step"]) == ("fail", 41) and finding["evidence"]["tensor_count"] == 4
    # The same series in a run whose manifest says nothing could skip a step (no GradScaler): not a skip.
    no_scaler = {"loss_scaler": {"present": False, "skips_nonfinite_steps": False}}
    unscaled = recorded_series_run(tmp_path / "unscaled", lr_held, [1.0] * steps, skipped, names, no_scaler)
    [finding] = loop05(audit(unscaled))
    assert (finding["severity"], finding["step"]) == ("fail", 33) and "non-finite" in finding["message"]
    scaled = {"loss_scaler": {"present": True, "skips_nonfinite_steps": True, "class": "GradScaler"}}
    assert loop05(audit(recorded_series_run(tmp_path / "scaled", lr_held, [1.0] * steps, skipped, names, scaled))) == []


def test_gradients_collapsing_in_one_layer_fail_at_the_step_and_the_clean_run_stays_silent(runs, clean_run):
    """One layer's attention gradients fall to 1e-6..1e-12 of their history while the rest of the model trains:
    a fail at the first collapsed step naming that layer's tensors; nothing of the kind on the clean run."""
    verdict = audit(run(runs, "collapse"))
    [collapse] = [f for f in loop05(verdict) if f["evidence"].get("kind") == "collapse"]
    assert (collapse["severity"], collapse["step"]) == ("fail", COLLAPSE_STEP)
    tensors = {t["tensor"] for t in collapse["evidence"]["tensors"]}
    assert {f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkvo"} <= tensors
    assert all(t.startswith("model.layers.1.") for t in tensors)
    assert min(t["fall"] for t in collapse["evidence"]["tensors"]) >= 1e4
    assert collapse["evidence"]["collapsed_share"] < 0.5, collapse["message"]
    assert [f for f in loop05(cached_audit(clean_run)) if f["evidence"].get("kind") == "collapse"] == []


def test_an_excursion_of_the_largest_tensor_without_a_finding_shows_why_on_the_chart(clean_run):
    """The clean run's burst at step 11 (most tensors 10-50x their running median, a hard batch): the largest
    tensor crosses 10x with no finding, and the chart's second line shows the typical tensor rising with it
    (a model-wide burst, not one layer standing out), so no crossing is left unexplained."""
    verdict = audit(clean_run)
    con = connect(clean_run, read_only=True)
    try:
        series = {
            name.split(" ")[0]: dict(zip(steps, values))
            for name, steps, values in con.execute(
                "SELECT name, list(step ORDER BY step), list(value ORDER BY step) FROM series "
                "WHERE code = 'LOOP-05' GROUP BY name"
            ).fetchall()
        }
    finally:
        con.close()
    largest, typical = series["largest"], series["typical"]
    flagged = {f["step"] for f in loop05(verdict)}
    crossed = [s for s, v in largest.items() if v >= 10 and s not in flagged]
    assert crossed, "the clean run has no burst to explain"
    assert all(typical[s] >= 3 for s in crossed), {s: (largest[s], typical[s]) for s in crossed}


def test_a_logged_global_norm_burst_warns_without_claiming_what_the_log_cannot_show(tmp_path):
    """A Trainer log holds one global norm a step: a burst that stays up (LOOP-27 leaves it, it is no isolated
    spike) is LOOP-05's global rule, whose message says no per-tensor norms were there to single out a layer."""
    n = 300
    rng = np.random.default_rng(3)
    loss = falling(n, 2.1, 0.4, noise=0.06, seed=3)
    norm = 0.4 * np.exp(0.2 * rng.standard_normal(n))
    burst = norm.copy()
    burst[199:210] *= 30  # steps 200-210
    [finding] = loop05(audit_state(tmp_path / "burst", history(loss, 2e-4, burst)))
    assert (finding["severity"], finding["step"]) == ("warn", 200)
    assert "no per-tensor norms" in finding["message"] and "no single tensor" not in finding["message"]
    assert loop05(audit_state(tmp_path / "clean", history(loss, 2e-4, norm))) == []


def test_an_isolated_global_norm_spike_is_told_once_by_loop27_naming_this_rule(tmp_path):
    """One batch's spike in a Trainer log: LOOP-05's global rule and LOOP-27 both flag its step, and the verdict
    tells the event once, by LOOP-27 (which gives the loss beside it), naming LOOP-05's rule and message. With
    LOOP-27's rule disabled, LOOP-05's finding is told."""
    n = 300
    rng = np.random.default_rng(3)
    loss = falling(n, 2.1, 0.4, noise=0.06, seed=3)
    norm = 0.4 * np.exp(0.2 * rng.standard_normal(n))
    norm[199] *= 30  # step 200, back down at step 201
    entries = history(loss, 2e-4, norm)
    verdict = audit_state(tmp_path / "spike", entries)
    assert [(f["rule"], f["step"]) for f in verdict["findings"] if f["severity"] != "info"] == [("LOOP-27/spike", 200)]
    [told] = [f for f in verdict["findings"] if f["rule"] == "LOOP-27/spike"]
    [folded] = told["evidence"]["also_flagged_by"]
    assert folded["rule"] == "LOOP-05/global-spike" and "at step 200 (1 step(s) flagged)" in folded["message"]
    assert "spiked at step 200" in told["message"] and "(also flagged by LOOP-05/global-spike)" in render(
        Rendering(verdict, tmp_path)
    )
    alone = audit(state_run(tmp_path / "alone", entries), AuditConfig(disabled=["LOOP-27/spike"]))
    [finding] = [f for f in alone["findings"] if f["severity"] != "info"]
    assert (finding["rule"], finding["step"]) == ("LOOP-05/global-spike", 200)
    assert "also_flagged_by" not in finding["evidence"]
