"""LOOP-28: with no evaluation (or too few to judge), a later epoch's training loss far below the first pass's (the loss on data the model
had not yet seen) is memorisation; a healthy multi-epoch staircase, a run with evaluations and a preference loss
are not judged by it."""

import numpy as np
import pytest

from sftaudit.verdict.audit import audit

from .curve_runs import audit_state, evaluations, history
from .logged_runs import REALRUNS, audited, findings, status

PER_EPOCH = 40


def _epochs(medians, seed=0, keys=None):
    """Per-step log entries, PER_EPOCH a epoch, each epoch's loss noisy around its median (the first epoch falling
    from 2.2 to its median), with the epoch logged as the Trainer logs it."""
    rng = np.random.default_rng(seed)
    first = np.geomspace(2.2, medians[0], PER_EPOCH // 2)
    levels = np.r_[first, np.full(PER_EPOCH // 2, medians[0]), np.repeat(medians[1:], PER_EPOCH)]
    loss = levels * np.exp(0.08 * rng.standard_normal(levels.size))
    entries = history(loss, 2e-4, keys=keys and {k: v(levels.size) for k, v in keys.items()})
    for i, entry in enumerate(entries):
        entry["epoch"] = round((i + 1) / PER_EPOCH, 4)
    return entries


MEMORISING = [1.45, 1.24, 0.94, 0.63, 0.37, 0.22, 0.12, 0.09, 0.07]  # a LoRA chat fine-tune's epochs, no eval
HEALTHY = [1.08, 0.71, 0.42]  # three epochs of the same data: each revisit easier, 0.39 of the first pass


def test_a_later_epoch_ten_times_below_the_first_pass_warns_at_its_first_step(tmp_path):
    [finding] = findings(audit_state(tmp_path / "memorised", _epochs(MEMORISING)), "LOOP-28")
    assert (finding["severity"], finding["category"]) == ("warn", "anomaly")
    assert finding["evidence"]["epoch"] == 7 and finding["step"] == 6 * PER_EPOCH + 1
    assert "no evaluation" in finding["message"] and "before epoch 7" in finding["message"]


def test_a_healthy_staircase_is_silent(tmp_path):
    verdict = audit_state(tmp_path / "healthy", _epochs(HEALTHY))
    assert status(verdict, "LOOP-28") == ("ran", None) and findings(verdict, "LOOP-28") == []


def test_a_log_sparser_than_an_epoch_is_judged_from_its_earliest_logged_epoch(tmp_path):
    """Logged every 1.5 epochs, from epoch 2 on: no first pass in the log; the earliest later epoch stands in."""
    sparse = [e for e in _epochs(MEMORISING) if e["step"] % (PER_EPOCH * 3 // 2) == 0]
    assert min(e["epoch"] for e in sparse) > 1
    [finding] = findings(audit_state(tmp_path / "memorised", sparse), "LOOP-28")
    assert finding["evidence"]["first_pass_epoch"] == 2 and finding["evidence"]["epoch"] == 8
    assert finding["step"] == 6 * PER_EPOCH + 1 and "earliest logged after the first" in finding["message"]
    healthy = [e for e in _epochs(HEALTHY + [0.35, 0.3]) if e["step"] % (PER_EPOCH * 3 // 2) == 0]
    verdict = audit_state(tmp_path / "healthy", healthy)
    assert status(verdict, "LOOP-28") == ("ran", None) and findings(verdict, "LOOP-28") == []


def test_one_final_evaluation_as_low_as_the_memorised_loss_is_said(tmp_path):
    evaluated = _epochs(MEMORISING) + evaluations([PER_EPOCH * 9], eval_loss=[0.07])
    [finding] = findings(audit_state(tmp_path / "eval", evaluated), "LOOP-28")
    assert finding["step"] == 6 * PER_EPOCH + 1 and "eval set is no held-out measure" in finding["message"]


def test_with_enough_evaluations_or_a_preference_loss_it_is_not_judged(tmp_path):
    steps = [PER_EPOCH * k for k in range(1, 10)]
    evaluated = _epochs(MEMORISING) + evaluations(steps, eval_loss=np.linspace(1.3, 1.9, len(steps)).tolist())
    assert status(audit_state(tmp_path / "eval", evaluated), "LOOP-28")[0] == "not_run"
    margins = {"rewards/margins": lambda n: np.linspace(0.1, 5, n), "logps/chosen": lambda n: np.full(n, -50.0)}
    preference = _epochs(MEMORISING, keys=margins)
    assert status(audit_state(tmp_path / "dpo", preference), "LOOP-28")[0] == "not_run"


@pytest.mark.slow  # trains a Trainer run
def test_a_recording_whose_eval_set_the_shim_generated_on_is_judged_on_that_not_here(tmp_path, tokenizer_cache):
    """The Trainer logs no eval_* here; the shim's eval-set generations are the evaluation (LOOP-08 judges them),
    so LOOP-28 does not claim that none was logged."""
    from sftaudit.fixtures.train import train_hf

    run = train_hf(
        tmp_path / "trainer",
        steps=4,
        save_steps=2,
        batch_size=4,
        max_length=64,
        probe_every=0,
        generate_every=0,
        eval_every=2,
        tokenizer_cache=tokenizer_cache,
    )
    state, reason = status(audit(run), "LOOP-28")
    assert state == "not_run" and "logged evaluations" in reason


@pytest.mark.skipif(not (REALRUNS / "gpt2-ja-tb").is_dir(), reason="../shared/realruns not present")
@pytest.mark.slow  # real runs
def test_real_memorising_runs_warn_at_the_first_logged_step_of_the_epoch(tmp_path):
    """gpt2-ja-tb logged every 500 steps from epoch 16 (no first pass): the stand-in dates it at the window of step
    1000. hf-baize-perstep's epoch 7 starts at step 4459 (epoch 6.0013), the first step the log holds in it."""
    import shutil

    dated = {}
    for name in ("gpt2-ja-tb", "hf-baize-perstep"):
        shutil.copytree(REALRUNS / name, tmp_path / name)
        for p in [tmp_path / name, *(tmp_path / name).rglob("*")]:
            p.chmod(p.stat().st_mode | 0o200)
        [finding] = findings(audited(tmp_path / name), "LOOP-28")
        dated[name] = (finding["step"], finding["evidence"]["epoch"], finding["evidence"]["first_pass_epoch"])
    assert dated == {"gpt2-ja-tb": (501, 33, 17), "hf-baize-perstep": (4459, 7, 1)}
