"""LOOP-06: the probe distributions of a model collapsing onto a template jump; a clean run's do not."""

import numpy as np

from sftaudit.checks.loop06_logits_stability import kl_top_k, own_history
from sftaudit.verdict.audit import audit

from .dynamics_runs import of, run


def test_kl_on_truncated_top_k_is_zero_for_equal_and_positive_for_shifted_distributions():
    assert kl_top_k([1, 2, 3], [0.5, 0.3, 0.1], [1, 2, 3], [0.5, 0.3, 0.1]) == 0.0
    assert kl_top_k([1, 2, 3], [0.5, 0.3, 0.1], [7, 8, 9], [0.9, 0.05, 0.01]) > 1.0


def test_template_collapse_moves_the_probe_distributions_before_the_generations_show_it(runs):
    verdict = audit(run(runs, "template"))
    findings = of(verdict, "LOOP-06")
    assert findings and {f["severity"] for f in findings} == {"warn"}
    first = min(findings, key=lambda f: f["step"])
    assert first["evidence"]["value"] > first["evidence"]["threshold"]
    diversity = of(verdict, "LOOP-07")
    assert diversity and first["step"] <= diversity[0]["step"]
    assert verdict["first_anomalous_step"] == min(f["step"] for f in verdict["findings"] if f["severity"] != "info")


def test_clean_probes_raise_nothing(runs, clean_run):
    for run_dir in (run(runs, "clean_probed"), clean_run):
        assert of(audit(run_dir), "LOOP-06") == []


def test_kl_is_judged_against_the_runs_own_probe_history():
    # Ordinary learning at a high LR: KL between probes of 0.1-0.3 nats throughout (the absolute
    # 0.1-nat rule fired on this); then one probe that moves 20x more than the probes before it.
    rng = np.random.default_rng(0)
    learning = rng.uniform(0.1, 0.3, 20)
    z, ratio = own_history(learning, 4)
    assert not ((z >= 6) & (ratio >= 10)).any()
    jumped = np.append(learning, 4.0)
    z, ratio = own_history(jumped, 4)
    assert z[-1] >= 6 and ratio[-1] >= 10


def test_probes_that_are_too_few_or_not_finite_are_never_a_pass(nan_probed_run, nan_run):
    """LOOP-06 on the probes the run left: 3 finite of 4 is partial evidence (the NaN probe named), 1 finite of
    2 is too little to judge; LOOP-07 on one generation step and LOOP-08 on two evaluations say so too."""
    verdict = audit(nan_probed_run)
    checks = {c["code"]: c for c in verdict["checks"]}
    assert checks["LOOP-06"]["status"] == "partial"
    assert checks["LOOP-06"]["reason"].startswith("1 of 4 probe steps (from step 8) were not judged")
    assert (
        checks["LOOP-07"]["status"] == "not_run" and "a streak of low diversity needs 3" in checks["LOOP-07"]["reason"]
    )
    assert checks["LOOP-08"]["status"] == "partial" and checks["LOOP-08"]["reason"].startswith("2 evaluation(s)")
    few = {c["code"]: c for c in audit(nan_run)["checks"]}["LOOP-06"]
    assert few["status"] == "not_run" and few["reason"].startswith("2 probe step(s) recorded, 1 of them with finite")
