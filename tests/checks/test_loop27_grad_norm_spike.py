"""LOOP-27: a spike of the logged global gradient norm against the run's own noise, from the first logged steps;
a first norm orders of magnitude above the rest; clean twins (and the ordinary high norms of a run's first steps)
stay silent."""

import numpy as np

from .curve_runs import audit_state, history
from .logged_runs import falling, findings, status


def _per_step(n=400, seed=0):
    """A per-step LoRA log: loss falling to ~0.4, gradient norm ~0.3-0.8 with the high first steps of a real run."""
    rng = np.random.default_rng(seed)
    norm = (0.3 + 0.5 * np.exp(-np.arange(n) / 30)) * np.exp(0.2 * rng.standard_normal(n))
    return falling(n, 2.1, 0.4, noise=0.06, seed=seed), norm


def test_an_isolated_gradient_norm_spike_at_step_27_warns_there_and_its_clean_twin_is_silent(tmp_path):
    loss, norm = _per_step()
    spiked = norm.copy()
    spiked[26] = 15 * np.median(norm[20:34])  # step 27: ~15x its neighbours, back down at step 28
    [finding] = findings(audit_state(tmp_path / "spike", history(loss, 2e-4, spiked)), "LOOP-27")
    assert (finding["severity"], finding["step"]) == ("warn", 27)
    assert finding["evidence"]["effect_size"] > 10 and finding["evidence"]["steps_up"] == 1
    assert findings(audit_state(tmp_path / "clean", history(loss, 2e-4, norm)), "LOOP-27") == []


def test_a_spike_of_5x_is_noise_for_this_check_and_a_first_norm_10x_the_rest_is_a_run_starting(tmp_path):
    loss, norm = _per_step(seed=1)
    small = norm.copy()
    small[200] *= 5
    first = norm.copy()
    first[0] = 10 * np.median(norm[1:])
    for name, norms in (("small", small), ("first", first)):
        assert findings(audit_state(tmp_path / name, history(loss, 2e-4, norms)), "LOOP-27") == []


def test_a_first_gradient_norm_in_the_thousands_warns_at_step_1(tmp_path):
    # DPO, logged at steps 1, 10, 20, 30: a norm of 1,628 at step 1, then 0.014 and 1e-8.
    norm = [1628.36, 0.0139, 1.7e-08, 8.1e-08]
    entries = history([0.6931, 0.1628, 0.0, 0.0], 2.5e-5, norm)
    for e, step in zip(entries, (1, 10, 20, 30)):
        e["step"] = step
    [finding] = findings(audit_state(tmp_path / "dpo", entries), "LOOP-27")
    assert (finding["severity"], finding["step"]) == ("warn", 1) and finding["evidence"]["effect_size"] > 1e6
    clean = [1.9, 1.4, 1.1, 0.9]
    entries = history([0.6931, 0.52, 0.41, 0.35], 2.5e-5, clean)
    assert findings(audit_state(tmp_path / "clean", entries), "LOOP-27") == []


def test_a_log_without_gradient_norms_is_not_judged(tmp_path):
    verdict = audit_state(tmp_path / "old", history(falling(30), 2e-4))
    assert status(verdict, "LOOP-27")[0] == "not_run" and "older Trainer" in status(verdict, "LOOP-27")[1]
