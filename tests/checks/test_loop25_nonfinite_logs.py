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


def test_a_nan_eval_loss_at_one_evaluation_warns_there_naming_it_and_a_clean_twin_is_silent(tmp_path):
    from .curve_runs import audit_state, evaluations, history

    steps = [100, 200, 300, 400, 500]
    entries = history(falling(50), 2e-4, every=10)
    nan_eval = evaluations(steps, eval_loss=[0.62, 0.6, float("nan"), 0.57, 0.56], eval_wer=[30, 29, 28, 28, 27])
    [finding] = findings(audit_state(tmp_path / "nan", entries + nan_eval), "LOOP-25")
    assert (finding["severity"], finding["step"]) == ("warn", 291) and finding["evidence"]["keys"] == ["eval_loss"]
    assert "eval_loss" in finding["message"] and "evaluation" in finding["message"]
    clean = evaluations(steps, eval_loss=[0.62, 0.6, 0.58, 0.57, 0.56], eval_wer=[30, 29, 28, 28, 27])
    assert findings(audit_state(tmp_path / "clean", entries + clean), "LOOP-25") == []


def test_nan_preference_statistics_warn_at_each_step_and_one_nan_to_the_end_fails(tmp_path):
    from .curve_runs import audit_state, history

    n = 60
    rng = np.random.default_rng(4)
    keys = {
        "rewards/margins": np.linspace(0, 2, n) + 0.1 * rng.standard_normal(n),
        "logps/chosen": np.full(n, -196.0),
        "logits/chosen": np.full(n, -0.3),
    }
    nan = {k: v.copy() for k, v in keys.items()}
    for row in (38, 42, 56):
        nan["rewards/margins"][row] = np.nan
    nan["logps/chosen"][42] = np.nan
    loss = 0.69 * np.exp(-np.arange(n) / 80) * np.exp(0.05 * rng.standard_normal(n))
    warns = findings(audit_state(tmp_path / "nan", history(loss, 5e-6, keys=nan, every=10)), "LOOP-25")
    assert [(f["severity"], f["step"], f["evidence"]["keys"]) for f in warns] == [
        ("warn", 381, ["rewards/margins"]),
        ("warn", 421, ["logps/chosen", "rewards/margins"]),
        ("warn", 561, ["rewards/margins"]),
    ]
    assert "log-probabilities" in warns[0]["message"]
    assert findings(audit_state(tmp_path / "clean", history(loss, 5e-6, keys=keys, every=10)), "LOOP-25") == []
    # The margin non-finite at every logged step from step 500: one fail for the key, at its first step.
    broken = {k: v.copy() for k, v in keys.items()}
    broken["rewards/margins"][49:] = np.nan
    [fail] = findings(audit_state(tmp_path / "broken", history(loss, 5e-6, keys=broken, every=10)), "LOOP-25")
    assert (fail["severity"], fail["step"], fail["evidence"]["key"]) == ("fail", 491, "rewards/margins")
    assert fail["evidence"]["steps_affected"] == 11


def test_a_non_finite_step_is_a_skipped_update_only_where_something_could_skip_it(tmp_path):
    """Every tensor's norm inf at step 33 of a recording, finite after, the LR held there. With a loss scaler
    in the manifest (or a manifest that predates the field) it is a skipped update (info); in a run whose
    manifest says nothing could skip a step it is no skip: no info, LOOP-05 fails at it instead."""
    from sftaudit.verdict.audit import audit

    from .dynamics_runs import recorded_series_run

    steps = 70
    norms = np.exp(-1 + 0.2 * np.random.default_rng(7).standard_normal((steps, 4)))
    norms[32] = np.inf
    lr = warmup_then_linear(steps, warmup=10, held=(33,))
    names = [f"model.layers.{i}.weight" for i in range(4)]

    def judged(name, manifest_keys=None):
        run_dir = recorded_series_run(tmp_path / name, lr, [1.0] * steps, norms, names, manifest_keys)
        return [
            (f["code"], f["severity"], f["step"])
            for f in audit(run_dir)["findings"]
            if f["code"] in ("LOOP-05", "LOOP-25")
        ]

    scaled = {"loss_scaler": {"present": True, "skips_nonfinite_steps": True, "class": "GradScaler"}}
    assert judged("scaled", scaled) == judged("older") == [("LOOP-25", "info", 33)]
    unscaled = judged("unscaled", {"loss_scaler": {"present": False, "skips_nonfinite_steps": False}})
    assert ("LOOP-05", "fail", 33) in unscaled and not [f for f in unscaled if f[0] == "LOOP-25" and f[1] == "info"]
