"""The checkpoint to keep (ship): the best on the run's selection metric within the eval's noise band, among
intact checkpoints saved before the first anomaly and evaluated at their step; in verdict.json (valid against
its schema), the report's first screen, `replay` and `gate --checkpoint best`. Trainer outputs with real
checkpoint folders, written in the test."""

import json
import shutil

import pytest

from sftaudit.cli import main
from sftaudit.commands.common import write_report

from .checks.logged_runs import falling, trainer_run
from .selection_runs import audited, eval_run
from .test_docs_and_schema import assert_valid

# Whisper-like: WER keeps improving (and flattens) while eval_loss turns up from step 300 (over-confidence).
WER = [40.0, 33.1, 29.2, 27.0, 26.1, 25.3, 25.0, 24.8, 24.9, 24.7]
LOSS = [0.60, 0.55, 0.54, 0.55, 0.57, 0.60, 0.63, 0.66, 0.70, 0.74]


@pytest.fixture(scope="module")
def wer_run(tmp_path_factory):
    run = eval_run(tmp_path_factory.mktemp("keep") / "wer", {"eval_loss": LOSS, "eval_wer": WER}, best="eval_wer")
    return run, audited(run)


def test_a_run_selected_on_wer_keeps_by_wer_not_by_the_loss(wer_run, tmp_path):
    _, verdict = wer_run
    keep = verdict["keep"]
    assert (keep["metric"], keep["direction"], keep["selected_by"]) == ("eval_wer", "lower", "run")
    assert keep["best"] == {"step": 1000, "value": 24.7} and keep["best_not_saved"] is None
    assert keep["after_best"] == {"steps": 0, "share": 0.0}
    # The band (second differences of the WER) is wider than the last steps' gains: the earliest checkpoint from
    # which every evaluation stays within it of the best is as good, with less training.
    assert 0.6 < keep["band"] < 2.0
    assert (verdict["keep_checkpoint"], keep["step"], keep["value"]) == ("checkpoint-600", 600, 25.3)
    assert "as good as checkpoint-1000 (24.7) within the eval's noise band" in keep["why"]
    assert verdict["first_anomalous_step"] is None and verdict["rollback_checkpoint"] is None
    assert_valid(verdict)
    # The same logs selected on eval_loss keep the checkpoint eval_loss favours, before it turned up.
    by_loss = audited(eval_run(tmp_path / "loss", {"eval_loss": LOSS, "eval_wer": WER}, best="eval_loss"))
    assert (by_loss["keep"]["metric"], by_loss["keep"]["best"]["step"]) == ("eval_loss", 300)
    assert by_loss["keep_checkpoint"] == "checkpoint-200"  # 0.55 is within the band of 0.54, with less training
    assert by_loss["keep"]["after_best"] == {"steps": 700, "share": 0.7}


def test_the_kept_checkpoint_is_never_after_the_first_anomaly_nor_broken(tmp_path):
    wer = [30.0, 28.0, 26.0, 24.0, 24.3, 28.0, 30.0, 31.5, 32.5, 33.0]
    run = eval_run(tmp_path / "overfit", {"eval_wer": wer}, best="eval_wer")
    verdict = audited(run)
    assert verdict["first_anomalous_step"] == 501  # LOOP-26: worse than the best from the eval at 600 on
    assert verdict["keep_checkpoint"] == "checkpoint-400" and verdict["rollback_checkpoint"] == "checkpoint-500"
    assert verdict["keep"]["after_best"] == {"steps": 600, "share": 0.6}
    # The best checkpoint's weights are truncated: LOOP-09 fails it, and the best intact one is kept instead.
    weights = run / "checkpoint-400" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])
    broken = audited(run)
    assert any(f["code"] == "LOOP-09" and f["checkpoint"] == "checkpoint-400" for f in broken["findings"])
    assert broken["keep_checkpoint"] == "checkpoint-500" and broken["keep"]["value"] == 24.3


def test_a_best_evaluation_that_was_never_saved_is_named(tmp_path):
    wer = [40.0, 34.0, 30.0, 27.0, 24.0, 28.0, 29.0, 29.5, 30.0, 30.5]
    run = eval_run(tmp_path / "unsaved", {"eval_wer": wer}, best="eval_wer", saved=[150, 300, 450, 600, 750])
    verdict = audited(run)
    keep = verdict["keep"]
    assert keep["best"] == {"step": 500, "value": 24.0} and keep["best_not_saved"] == 500
    # Only checkpoints evaluated at their own step can be compared: 300 and 600 (600 is after the anomaly).
    assert verdict["first_anomalous_step"] == 501
    assert verdict["keep_checkpoint"] == "checkpoint-300" and keep["value"] == 30.0
    assert "the run's best evaluation (24 at step 500) was never saved" in keep["why"]
    assert_valid(verdict)
    never = eval_run(tmp_path / "never", {"eval_wer": wer}, best="eval_wer", saved=[150, 450, 750])
    none = audited(never)
    assert none["keep_checkpoint"] is None
    assert "no checkpoint was evaluated at its own step (saved at 150, 450, 750" in none["keep"]["why"]


def test_a_run_without_evaluations_keeps_nothing_and_says_why(tmp_path):
    verdict = audited(trainer_run(tmp_path / "plain", falling(40)))
    assert verdict["keep_checkpoint"] is None
    assert verdict["keep"]["why"] == "no evaluation was logged: nothing tells which checkpoint is best"
    assert verdict["keep"]["metric"] is None and verdict["keep"]["best"] is None
    assert_valid(verdict)
    # Eval keys of unknown direction only: nothing to choose on, and why.
    dpo = audited(eval_run(tmp_path / "dpo", {"eval_rewards/margins": [0.1, 0.5, 0.9, 1.2, 1.4, 1.5]}))
    assert dpo["keep_checkpoint"] is None and dpo["keep"]["why"].startswith("no metric to choose on")


def test_gate_best_judges_the_kept_checkpoint_or_exits_2_with_why(wer_run, tmp_path, capsys):
    run, _ = wer_run
    out = tmp_path / "gate.json"
    assert main(["gate", str(run), "--checkpoint", "best", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["checkpoint"]["name"] == "checkpoint-600"
    assert "checkpoint-600 (step 600): PASS" in capsys.readouterr().out
    plain = trainer_run(tmp_path / "plain", falling(40))
    assert main(["gate", str(plain), "--checkpoint", "best"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "sftaudit: error: plain: no checkpoint to keep for --checkpoint best: no evaluation was logged: "
        "nothing tells which checkpoint is best"
    ]


def test_replay_and_the_report_show_the_kept_checkpoint(wer_run, tmp_path, capsys):
    run, verdict = wer_run
    assert main(["replay", str(run), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["keep_checkpoint"] == {"name": "checkpoint-600", "step": 600, "path": "checkpoint-600"}
    assert doc["keep"] == verdict["keep"]
    assert main(["replay", str(run)]) == 0
    text = capsys.readouterr().out
    assert "keep checkpoint-600 to ship (step 600): eval_wer 25.3 at step 600" in text
    html = write_report(run, tmp_path / "report").read_text(encoding="utf-8")
    first_screen = html[html.index('id="summary"') : html.index('id="checkpoint-strip"')]
    assert "Keep <b>checkpoint-600</b> to ship: eval_wer 25.3 at step 600" in first_screen


def test_the_report_says_why_nothing_is_kept(tmp_path):
    wer = [40.0, 34.0, 30.0, 27.0, 24.0, 28.0, 29.0, 29.5, 30.0, 30.5]
    run = eval_run(tmp_path / "never", {"eval_wer": wer}, best="eval_wer", saved=[150, 450, 750])
    audited(run)
    html = write_report(run, tmp_path / "report").read_text(encoding="utf-8")
    assert "No checkpoint to keep: no checkpoint was evaluated at its own step" in html
    assert "The best evaluation (step 500) has no checkpoint: save on the steps you evaluate." in html
    assert "500 steps (50% of the run) came after the best evaluation and bought nothing on eval_wer" in html


def test_a_best_checkpoint_the_run_saved_but_the_folder_lacks_is_not_called_unsaved(tmp_path):
    # Only the final model and trainer_state.json left the training machine: the state names its best checkpoint.
    run = eval_run(tmp_path / "bare", {"eval_wer": WER}, best="eval_wer")
    for step in range(100, 1001, 100):
        shutil.rmtree(run / f"checkpoint-{step}")
    verdict = audited(run)
    keep = verdict["keep"]
    assert verdict["keep_checkpoint"] is None and keep["best_not_saved"] is None
    assert keep["why"] == "no checkpoint is in the run folder (the run saved its best at step 1000, but it is not here)"
