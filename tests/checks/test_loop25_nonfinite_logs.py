"""LOOP-25: non-finite logged loss and gradient norm, from the logs alone; the steps an fp16 loss scaler skipped
are counted (info), a streak of them fails; clean twins stay silent."""

import numpy as np

from .logged_runs import audited, falling, findings, trainer_run

INF = float("inf")


def warmup_then_linear(n, warmup=2, peak=2e-4, held=()):
    """The LR the Trainer logs after each step of its linear schedule; a step in `held` did not step the
    scheduler (the scaler skipped it), so it logs the LR of the step before."""
    lr, k = [], 0
    for s in range(1, n + 1):
        k += s not in held
        lr.append(peak * k / warmup if k < warmup else peak * (n - k) / (n - warmup))
    return lr


def test_one_skipped_fp16_step_is_an_info_and_no_spike_or_learning_rate_jump(tmp_path):
    # grad_norm inf at step 33 with the LR held: GradScaler skipped it; training went on.
    n = 70
    norms = list(np.exp(0.3 * np.random.default_rng(0).standard_normal(n)))
    norms[32] = INF
    verdict = audited(trainer_run(tmp_path / "skip", falling(n), lr=warmup_then_linear(n, held={33}), grad_norm=norms))
    [finding] = findings(verdict, "LOOP-25")
    assert (finding["severity"], finding["step"]) == ("info", 33)
    assert finding["evidence"]["count"] == 1 and finding["evidence"]["lr_held"] == 1
    assert findings(verdict, "LOOP-05") == [] and findings(verdict, "LOOP-10", ("warn", "fail")) == []
    assert verdict["verdict"] == "pass"


def test_skips_in_the_warmup_do_not_end_it_or_read_as_a_learning_rate_jump(tmp_path):
    # fp16 with warmup: steps 1-2 skipped at LR 0 (the scaler calibrating), then the warmup resumes.
    n = 120
    norms = list(np.exp(0.3 * np.random.default_rng(1).standard_normal(n)))
    norms[0] = norms[1] = norms[5] = float("nan")
    verdict = audited(
        trainer_run(tmp_path / "warmup", falling(n), lr=warmup_then_linear(n, held={1, 2, 6}), grad_norm=norms)
    )
    assert [f["evidence"]["count"] for f in findings(verdict, "LOOP-25")] == [3]
    assert not [f for f in findings(verdict, "LOOP-10") if "learning rate" in f["message"]]


def test_a_streak_of_skipped_steps_fails_at_its_first_step(tmp_path):
    n = 100
    norms = list(np.exp(0.3 * np.random.default_rng(2).standard_normal(n)))
    norms[40:48] = [INF] * 8
    verdict = audited(
        trainer_run(tmp_path / "streak", falling(n), lr=warmup_then_linear(n, held=set(range(41, 49))), grad_norm=norms)
    )
    streak = [f for f in findings(verdict, "LOOP-25") if f["severity"] == "fail"]
    assert [(f["step"], f["evidence"]["streak"]) for f in streak] == [(41, 8)]
    assert verdict["first_anomalous_step"] == 41


def test_a_nan_gradient_norm_through_the_end_behind_a_finite_loss_fails_without_checkpoints(tmp_path):
    # The Trainer's logging_nan_inf_filter logs a finite loss; the gradient norm is NaN for the last 31 steps.
    n = 80
    norms = list(np.exp(0.3 * np.random.default_rng(3).standard_normal(n)))
    norms[49:] = [float("nan")] * 31
    loss = falling(n)
    loss[50:] = 0.0  # whole logging windows of NaN steps: the filter adds nothing to 0
    [finding] = [
        f
        for f in findings(audited(trainer_run(tmp_path / "nan", loss, grad_norm=norms)), "LOOP-25")
        if f["severity"] == "fail"
    ]
    assert finding["step"] == 50 and finding["evidence"]["steps_affected"] == 31
    assert finding["evidence"]["hidden_by_logging_filter"] is True


def test_a_logged_nan_loss_fails_and_a_clean_log_is_silent(tmp_path):
    loss = falling(40)
    loss[20:] = float("nan")
    [finding] = findings(audited(trainer_run(tmp_path / "nanloss", loss)), "LOOP-25")
    assert (finding["severity"], finding["step"]) == ("fail", 21) and finding["evidence"]["steps_affected"] == 20
    clean = audited(trainer_run(tmp_path / "clean", falling(40), grad_norm=list(np.linspace(2, 1, 40))))
    assert findings(clean, "LOOP-25") == []
