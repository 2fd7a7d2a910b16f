"""LOOP-08: ROUGE-L/BLEU-4 on one tokenization (Chinese included), eval-set contamination, a silent clean run."""

import pytest
from rouge_score import rouge_scorer

from sftaudit.checks.loop08_eval_metrics import rouge_l_and_bleu_4
from sftaudit.store.rundb import connect
from sftaudit.verdict.audit import audit

from .dynamics_runs import LEAK_STEP, of, run

REFERENCE = "长城是中国古代修建的军事防御工程，总长度超过两万公里。"


def test_rouge_and_bleu_score_chinese_on_the_shared_tokenization():
    assert rouge_l_and_bleu_4([REFERENCE], [REFERENCE]) == pytest.approx((1.0, 1.0))
    half = REFERENCE[: len(REFERENCE) // 2]
    rouge, bleu = rouge_l_and_bleu_4([half], [REFERENCE])
    assert 0.4 < rouge < 0.8 and 0 < bleu < 1
    assert rouge_l_and_bleu_4(["完全不同的句子"], [REFERENCE])[1] < 0.05
    # The bug the shared tokenization avoids: rouge-score's default tokenizer drops Chinese entirely.
    default = rouge_scorer.RougeScorer(["rougeL"]).score(REFERENCE, REFERENCE)["rougeL"].fmeasure
    assert default == 0.0


def test_mixed_language_predictions_score_both_parts():
    rouge, bleu = rouge_l_and_bleu_4(["The Great Wall 长城 is long"], ["The Great Wall 长城 is very long"])
    assert 0.8 < rouge < 1 and 0 < bleu < 1


def test_eval_items_copied_into_training_fail_at_the_step_they_were_trained(runs):
    verdict = audit(run(runs, "eval_leak"))
    [finding] = of(verdict, "LOOP-08")
    assert (finding["severity"], finding["step"]) == ("fail", LEAK_STEP)
    assert finding["evidence"]["sample_ids"] == ["leak-e000", "leak-e001"]
    assert {leak["eval_id"] for leak in finding["evidence"]["leaked"]} == {"e000", "e001"}
    assert all(leak["containment"] == 1.0 for leak in finding["evidence"]["leaked"])
    assert verdict["first_anomalous_step"] == LEAK_STEP


def test_clean_run_with_evals_raises_nothing(runs):
    run_dir = run(runs, "clean_probed")
    verdict = audit(run_dir)
    assert of(verdict, "LOOP-08") == []
    con = connect(run_dir, read_only=True)
    steps = con.execute("SELECT step FROM series WHERE code = 'LOOP-08' AND name = 'ROUGE-L' ORDER BY step").fetchall()
    assert [s for (s,) in steps] == [4, 8, 12, 16, 20]  # it did score every eval step
