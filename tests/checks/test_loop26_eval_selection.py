"""LOOP-26: eval metrics judged by their direction and by the metric the run selected on, each rule proven on
its fault and silent on the clean twin (Trainer outputs written in the test)."""

import json
from pathlib import Path

import numpy as np
import pytest

from sftaudit.checks.selection_metric import direction, noise_band, worse_to_the_end

from ..selection_runs import audited, eval_run, findings, status
from .logged_runs import falling, trainer_run

FALLING_LOSS = [0.80, 0.70, 0.62, 0.57, 0.53, 0.50, 0.48, 0.46, 0.45, 0.44]
IMPROVING_WER = [30.0, 26.0, 24.0, 23.0, 22.5, 22.2, 22.0, 21.9, 21.8, 21.7]


@pytest.mark.parametrize(
    ("key", "way"),
    [
        ("eval_loss", "lower"),
        ("eval_wer", "lower"),
        ("eval_cer", "lower"),
        ("eval_perplexity", "lower"),
        ("eval_accuracy", "higher"),
        ("eval_mean_token_accuracy", "higher"),
        ("eval_bleu-4", "higher"),
        ("eval_rougeLsum", "higher"),
        ("eval_rouge-l", "higher"),
        ("eval_f1", "higher"),
        ("eval_exact_match", "higher"),
        ("eval_chrf", "higher"),
        ("eval_rewards/margins", None),  # not told by its name: never guessed
        ("eval_entropy", None),
        ("eval_score", None),
    ],
)
def test_direction_is_told_by_the_name_or_not_at_all(key, way):
    assert direction(key) == way


def test_over_fitting_on_the_selection_metric_while_eval_loss_falls_warns_where_it_turned(tmp_path):
    wer = [30.0, 26.0, 24.0, 24.3, 27.0, 29.0, 31.0, 33.0, 34.0, 35.0]
    verdict = audited(eval_run(tmp_path / "fault", {"eval_loss": FALLING_LOSS, "eval_wer": wer}, best="eval_wer"))
    [finding] = findings(verdict)
    assert (finding["severity"], finding["category"]) == ("warn", "anomaly")
    # Best at step 300; 400 is within the noise band; worse from 500 on: dated to the window after the 400 eval.
    assert (finding["step"], finding["evidence"]["turned_step"], finding["evidence"]["best_step"]) == (401, 500, 300)
    assert finding["evidence"]["resolution"] == {"kind": "evaluation window", "first_step": 401, "last_step": 500}
    assert finding["evidence"]["metric"] == "eval_wer" and finding["evidence"]["selected_by"] == "run"
    assert "eval_loss kept falling" in finding["message"]
    assert verdict["first_anomalous_step"] == 401 and verdict["rollback_checkpoint"] == "checkpoint-400"
    clean = audited(
        eval_run(tmp_path / "clean", {"eval_loss": FALLING_LOSS, "eval_wer": IMPROVING_WER}, best="eval_wer")
    )
    assert findings(clean) == [] and status(clean) == ("ran", None)
    assert clean["first_anomalous_step"] is None


def test_eval_loss_rising_while_the_selection_metric_improves_is_not_over_fitting(tmp_path):
    rising = [0.60, 0.55, 0.54, 0.55, 0.57, 0.60, 0.63, 0.66, 0.70, 0.74]
    evals = {"eval_loss": rising, "eval_wer": IMPROVING_WER}
    verdict = audited(eval_run(tmp_path / "by_wer", evals, best="eval_wer"))
    [finding] = findings(verdict)
    assert (finding["severity"], finding["step"]) == ("info", 501)
    assert "not over-fitting by the run's own measure" in finding["message"]
    # LOOP-10 judges eval_loss over-fitting only for a run that selects on eval_loss: this one selects on WER.
    assert findings(verdict, "LOOP-10") == [] and verdict["first_anomalous_step"] is None
    # The same logs, selected on eval_loss: over-fitting by the run's own measure.
    by_loss = audited(eval_run(tmp_path / "by_loss", evals, best="eval_loss"))
    [warned] = findings(by_loss)
    assert (warned["severity"], warned["evidence"]["metric"], warned["evidence"]["best_step"]) == (
        "warn",
        "eval_loss",
        300,
    )
    assert [f["severity"] for f in findings(by_loss, "LOOP-10")] == ["warn"]


def test_eval_loss_stepping_up_while_the_selection_metric_improves_is_a_risk_that_does_not_date_the_run(tmp_path):
    stepped = [0.60, 0.55, 0.52, 0.50, 0.80, 0.79, 0.81, 0.80, 0.79, 0.80]  # the eval changed at step 500
    verdict = audited(eval_run(tmp_path / "fault", {"eval_loss": stepped, "eval_wer": IMPROVING_WER}, best="eval_wer"))
    [finding] = findings(verdict)
    assert (finding["severity"], finding["category"], finding["step"]) == ("warn", "risk", 401)
    assert finding["rule"] == "LOOP-26/eval-loss-jumped" and "from 0.5 to 0.8" in finding["message"]
    assert verdict["first_anomalous_step"] is None and verdict["rollback_checkpoint"] is None
    drifted = [0.60, 0.55, 0.52, 0.50, 0.53, 0.57, 0.61, 0.66, 0.70, 0.74]  # a rise over many evaluations
    [drift] = findings(
        audited(eval_run(tmp_path / "drift", {"eval_loss": drifted, "eval_wer": IMPROVING_WER}, best="eval_wer"))
    )
    assert (drift["severity"], drift["rule"]) == ("info", "LOOP-26/eval-loss-rose")


WHISPER = Path(__file__).resolve().parents[2] / ".." / "shared" / "realruns2" / "whisper-large-flemish-15k"


@pytest.mark.skipif(not WHISPER.is_dir(), reason="../shared/realruns2 not present")
def test_a_real_whisper_runs_eval_loss_doubled_from_its_8th_evaluation_is_a_risk_its_clean_log_is_not(tmp_path):
    """The real run selects on WER (best_metric 9.6 at step 15000) and its WER keeps falling; its eval_loss,
    noisy at 0.21-0.27, doubled from the evaluation at step 8000 on: a step its selection metric does not see."""
    state = json.loads((WHISPER / "trainer_state.json").read_text())
    clean = tmp_path / "clean"
    clean.mkdir()
    (clean / "trainer_state.json").write_text(json.dumps(state))
    assert findings(audited(clean)) == []
    for entry in state["log_history"]:
        if "eval_loss" in entry and entry["step"] >= 8000:
            entry["eval_loss"] *= 2
    stepped = tmp_path / "stepped"
    stepped.mkdir()
    (stepped / "trainer_state.json").write_text(json.dumps(state))
    verdict = audited(stepped)
    [found] = findings(verdict)
    assert (found["rule"], found["category"], found["step"]) == ("LOOP-26/eval-loss-jumped", "risk", 7001)
    assert found["evidence"]["metric"] == "eval_wer" and verdict["first_anomalous_step"] is None


def test_an_eval_that_jumps_and_plateaus_is_found_by_best_against_last(tmp_path):
    # No best_metric recorded: eval_loss, the Trainer's default. One rise, then flat: no 3 rises in a row.
    jumped = [1.00, 0.80, 0.70, 0.65, 0.62, 0.85, 0.84, 0.86, 0.85, 0.84]
    verdict = audited(eval_run(tmp_path / "fault", {"eval_loss": jumped}))
    [finding] = findings(verdict)
    assert (finding["severity"], finding["step"], finding["evidence"]["shape"]) == ("warn", 501, "jump")
    assert finding["evidence"]["selected_by"] == "default"
    assert "jumped to 0.85 at step 600 and stayed there" in finding["message"]
    assert findings(verdict, "LOOP-10") == []  # three rises in a row never happened
    flat = [1.00, 0.80, 0.70, 0.65, 0.62, 0.61, 0.60, 0.60, 0.59, 0.59]
    assert findings(audited(eval_run(tmp_path / "clean", {"eval_loss": flat}))) == []


def test_a_metric_of_unknown_name_is_judged_in_the_direction_best_metric_shows(tmp_path):
    score = [0.40, 0.55, 0.63, 0.66, 0.67, 0.60, 0.52, 0.48, 0.45, 0.43]
    evals = {"eval_loss": FALLING_LOSS, "eval_score": score}
    verdict = audited(eval_run(tmp_path / "fault", evals, best="eval_score", greater_is_better=True))
    [finding] = findings(verdict)
    assert (finding["evidence"]["metric"], finding["evidence"]["direction"], finding["evidence"]["best_step"]) == (
        "eval_score",
        "higher",
        500,
    )
    rising = [0.40, 0.55, 0.63, 0.66, 0.67, 0.68, 0.69, 0.69, 0.70, 0.70]
    evals = {"eval_loss": FALLING_LOSS, "eval_score": rising}
    assert findings(audited(eval_run(tmp_path / "clean", evals, best="eval_score", greater_is_better=True))) == []


def test_a_wer_at_99_percent_fails_even_while_eval_loss_falls_to_nothing(tmp_path):
    evals = {"eval_loss": [0.0054, 0.0011, 0.0006], "eval_wer": [98.9, 99.6, 99.7]}
    verdict = audited(eval_run(tmp_path / "fault", evals, best="eval_wer"))
    [finding] = findings(verdict)
    assert (finding["severity"], finding["category"], finding["step"]) == ("fail", "anomaly", 1)
    assert finding["evidence"]["resolution"] == {"kind": "evaluation window", "first_step": 1, "last_step": 100}
    assert "eval_loss fell meanwhile (0.0054 -> 0.0006)" in finding["message"]
    assert verdict["verdict"] == "fail"
    clean = audited(eval_run(tmp_path / "clean", {"eval_loss": [0.5, 0.4, 0.35], "eval_wer": [35.0, 31.0, 29.0]}))
    assert findings(clean) == []
    # Three evaluations tell no noise: over-fitting is not judged, and the check says so.
    state, reason = status(clean)
    assert state == "not_run" and "too few to tell its noise" in reason


def test_a_wer_logged_as_a_fraction_is_not_judged_for_its_level(tmp_path):
    # 0.99 may be 99% or 0.99%: the scale cannot be told, so the level is not judged either way.
    evals = {"eval_loss": [0.5, 0.4, 0.35], "eval_wer": [0.99, 0.995, 0.998]}
    assert findings(audited(eval_run(tmp_path / "fraction", evals))) == []


CLASSIFIER = {"architectures": ["RobertaForSequenceClassification"], "id2label": {"0": "NEG", "1": "POS"}}


def test_a_classifier_at_chance_accuracy_fails_and_a_learning_one_passes(tmp_path):
    chance = [0.52, 0.50, 0.51, 0.49, 0.50, 0.51]
    loss = [0.69, 0.69, 0.70, 0.69, 0.69, 0.69]
    verdict = audited(eval_run(tmp_path / "fault", {"eval_loss": loss, "eval_accuracy": chance}, config=CLASSIFIER))
    [finding] = [f for f in findings(verdict) if f["severity"] == "fail"]
    assert finding["evidence"]["metric"] == "eval_accuracy" and finding["step"] == 1
    assert "at chance (1/2 = 0.5)" in finding["message"]
    learning = [0.70, 0.78, 0.82, 0.84, 0.85, 0.86]
    falling = [0.60, 0.50, 0.45, 0.42, 0.40, 0.39]
    clean = audited(eval_run(tmp_path / "clean", {"eval_loss": falling, "eval_accuracy": learning}, config=CLASSIFIER))
    assert findings(clean) == []
    # A language model's config carries a default id2label too: no classifier head, no chance level judged.
    lm = {"architectures": ["GPT2LMHeadModel"], "id2label": {"0": "LABEL_0", "1": "LABEL_1"}}
    assert findings(audited(eval_run(tmp_path / "lm", {"eval_loss": loss, "eval_accuracy": chance}, config=lm))) == []


def test_eval_keys_of_unknown_direction_are_named_not_guessed(tmp_path):
    verdict = audited(eval_run(tmp_path / "dpo", {"eval_rewards/margins": [0.1, 0.5, 0.9, 1.2, 1.4, 1.5]}))
    state, reason = status(verdict)
    assert state == "not_run" and "eval_rewards/margins" in reason and "not guessed" in reason


def test_a_run_without_evaluations_is_not_judged(tmp_path):
    verdict = audited(trainer_run(tmp_path / "no_evals", falling(40)))
    assert status(verdict) == ("not_run", "no eval metric was logged")


def test_the_band_needs_six_evaluations_and_the_end_two():
    assert noise_band(np.array([1.0, 0.9, 0.8, 0.7, 0.6])) is None
    assert noise_band(np.array([1.0, 0.9, 0.8, 0.7, 0.6, 0.5])) is not None
    # One worse evaluation at the end is no trend yet.
    assert worse_to_the_end(np.array([3.0, 2.0, 1.0, 1.0, 1.0, 5.0]), "lower", 0.1) is None
    assert worse_to_the_end(np.array([3.0, 2.0, 1.0, 1.0, 5.0, 5.0]), "lower", 0.1) == (2, 4)


# The eval_loss of a Whisper fine-tune (15 evaluations every 1,000 steps): flat and noisy at +-0.02.
NOISY_EVAL = [0.272, 0.26, 0.239, 0.241, 0.239, 0.253, 0.227, 0.243, 0.223, 0.262, 0.219, 0.209, 0.216, 0.249, 0.239]


def test_a_jump_in_a_noisy_eval_that_stays_is_told_by_its_ranks_and_the_noise_itself_is_not(tmp_path):
    jumped = np.array(NOISY_EVAL)
    jumped[4:] *= 1.5  # from the evaluation at step 5000: above every one before it, keeping its noise
    # The jump keeps the noise, so not every later evaluation clears the best by the band.
    band = noise_band(jumped)
    assert worse_to_the_end(jumped, "lower", band) in (None, (2, 13))
    loss = falling(150, start=0.75, end=0.03, noise=0.1)
    run = trainer_run(tmp_path / "jump", loss, every=100, evals=list(zip(range(1000, 15001, 1000), jumped)))
    [found] = findings(audited(run))
    assert (found["rule"], found["severity"], found["step"]) == ("LOOP-26/worse-than-all-before", "warn", 4001)
    assert (
        found["evidence"]["turned_step"] == 5000 and found["evidence"]["best_after"] > found["evidence"]["worst_before"]
    )
    clean = trainer_run(tmp_path / "clean", loss, every=100, evals=list(zip(range(1000, 15001, 1000), NOISY_EVAL)))
    assert findings(audited(clean)) == []


def test_a_jump_with_three_evaluations_before_it_is_told_by_how_far_it_went_and_a_weaker_one_is_not(tmp_path):
    # x1.5 from the 4th of 15 evaluations: every later one is worse than all 3 before it, which noise gives with
    # probability 13 / C(15, 12) = 0.03 (too likely to tell by the ranks alone), but the mean moved 0.09, ten of
    # the eval's own sigmas (0.015 from its second differences) over the 3 and 12 evaluations.
    loss = falling(150, start=0.75, end=0.03, noise=0.1)
    steps = range(1000, 15001, 1000)
    jumped = np.array(NOISY_EVAL)
    jumped[3:] *= 1.5
    [found] = findings(audited(trainer_run(tmp_path / "jump", loss, every=100, evals=list(zip(steps, jumped)))))
    assert (found["rule"], found["severity"], found["step"]) == ("LOOP-26/worse-than-all-before", "warn", 3001)
    # x1.2 there: the later evaluations overlap the first ones (0.251 against 0.272): no jump that stayed.
    weaker = np.array(NOISY_EVAL)
    weaker[3:] *= 1.2
    assert findings(audited(trainer_run(tmp_path / "weaker", loss, every=100, evals=list(zip(steps, weaker))))) == []
