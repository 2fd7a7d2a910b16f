"""The metric a Trainer run selected its best checkpoint on, read from trainer_state.json alone (the name of
`metric_for_best_model` lives in training_args.bin, a pickle never read), and carried into the manifest."""

import json

from sftaudit.imports import import_run
from sftaudit.imports.selection import run_selection

from .selection_runs import eval_run


def state(tmp_path, history, **best):
    return {"global_step": 300, **best}, history


EVALS = [
    {"step": 100, "eval_loss": 0.50, "eval_wer": 30.0, "eval_runtime": 2.0},
    {"step": 200, "eval_loss": 0.55, "eval_wer": 27.5, "eval_runtime": 2.0},
    {"step": 300, "eval_loss": 0.60, "eval_wer": 28.0, "eval_runtime": 2.0},
]


def test_the_metric_is_the_eval_key_equal_to_best_metric_at_the_best_step(tmp_path):
    fields, history = state(tmp_path, EVALS, best_metric=27.5, best_global_step=200)
    assert run_selection(fields, history) == {
        "metric": "eval_wer",
        "greater_is_better": False,  # 27.5 is the smallest WER logged
        "best_metric": 27.5,
        "best_global_step": 200,
        "best_model_checkpoint": None,
    }


def test_older_states_name_the_step_only_in_best_model_checkpoint(tmp_path):
    fields, history = state(tmp_path, EVALS, best_metric=0.50, best_model_checkpoint="/data/out/checkpoint-100")
    found = run_selection(fields, history)
    assert (found["metric"], found["best_global_step"], found["greater_is_better"]) == ("eval_loss", 100, False)
    accuracy = [{"step": s, "eval_accuracy": a} for s, a in ((100, 0.61), (200, 0.74), (300, 0.70))]
    fields, history = state(tmp_path, accuracy, best_metric=0.74, best_model_checkpoint="out/checkpoint-200")
    assert run_selection(fields, history)["greater_is_better"] is True


def test_what_the_state_does_not_tell_stays_unknown(tmp_path):
    # No best metric tracked (metric_for_best_model unset): no selection.
    assert run_selection(*state(tmp_path, EVALS, best_metric=None)) is None
    # Two keys equal to best_metric at the best step: which one was meant cannot be told.
    tied = [{"step": 100, "eval_loss": 0.5, "eval_other": 0.5}]
    assert run_selection(*state(tmp_path, tied, best_metric=0.5, best_global_step=100))["metric"] is None
    # One evaluation: the direction cannot be told from the values.
    one = [{"step": 100, "eval_bleu": 0.31}]
    found = run_selection(*state(tmp_path, one, best_metric=0.31, best_global_step=100))
    assert (found["metric"], found["greater_is_better"]) == ("eval_bleu", None)
    # A state that is not an object (a broken file): nothing, never an error.
    assert run_selection([], EVALS) is None


def test_the_import_puts_the_selection_in_the_manifest(tmp_path):
    run = eval_run(tmp_path / "run", {"eval_loss": [0.5, 0.4, 0.45], "eval_wer": [30, 25, 26]}, best="eval_wer")
    import_run(run)
    manifest = json.loads((run / "sftaudit" / "rank-0" / "manifest.jsonl").read_text().splitlines()[0])
    assert manifest["selection"] == {
        "metric": "eval_wer",
        "greater_is_better": False,
        "best_metric": 25.0,
        "best_global_step": 200,
        "best_model_checkpoint": "/cluster/out/checkpoint-200",
    }
