"""LOOP-23: a training loss many times the eval loss beside it; ordinary gaps (over-fitting, regularisation)
stay silent."""

from .logged_runs import audited, falling, findings, status, trainer_run


def test_a_training_loss_17x_the_eval_loss_warns_once_for_the_run(tmp_path):
    # A LoRA run logging every 100 steps with gradient accumulation 16: the logged training loss is 16-18x eval.
    loss = [284.87, 161.25, 9.9001, 5.3872, 5.1796, 5.0244]
    evals = [(100, 15.44), (200, 2.384), (300, 0.3468), (400, 0.3185), (500, 0.3077), (600, 0.3038)]
    verdict = audited(trainer_run(tmp_path / "scaled", loss, every=100, evals=evals, lr=2e-5))
    [finding] = findings(verdict, "LOOP-23")
    assert (finding["severity"], finding["category"], finding["step"]) == ("warn", "risk", None)
    assert 16 < finding["evidence"]["value"] < 18
    assert finding["evidence"]["eval_steps"] == [100, 200, 300, 400, 500, 600]
    assert verdict["verdict"] == "warn"


def test_ordinary_train_eval_gaps_stay_silent(tmp_path):
    loss = falling(60, 2.0, 0.6)
    overfit = [(s, 1.1 + 0.002 * s / 10) for s in range(100, 601, 100)]  # eval above train and rising
    assert findings(audited(trainer_run(tmp_path / "overfit", loss, every=10, evals=overfit)), "LOOP-23") == []
    regularised = [(s, loss[s // 10 - 1] / 1.4) for s in range(100, 601, 100)]  # dropout: train 1.4x eval
    assert findings(audited(trainer_run(tmp_path / "dropout", loss, every=10, evals=regularised)), "LOOP-23") == []


def test_one_evaluation_is_not_judged(tmp_path):
    verdict = audited(trainer_run(tmp_path / "one", falling(20), evals=[(20, 0.1)]))
    assert status(verdict, "LOOP-23")[0] == "not_run"
    assert findings(verdict, "LOOP-23") == []
