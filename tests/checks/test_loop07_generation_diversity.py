"""LOOP-07: template answers collapse the generations; the clean run's generations stay diverse."""

from sftaudit.checks.loop07_generation_diversity import GenerationDiversity
from sftaudit.checks.stats.text import join_ngram, tokenize
from sftaudit.store.rundb import connect
from sftaudit.verdict.audit import audit

from .dynamics_runs import of, run


def test_tokenization_splits_chinese_characters_and_english_words():
    assert tokenize("根据您的问题，答案是 Paris!") == ["根", "据", "您", "的", "问", "题", "答", "案", "是", "paris"]
    assert join_ngram(("答", "案", "是")) == "答案是" and join_ngram(("the", "capital")) == "the capital"


def test_template_answers_warn_at_the_first_low_diversity_step_with_the_template_ngrams(runs):
    run_dir = run(runs, "template")
    verdict = audit(run_dir)
    [finding] = of(verdict, "LOOP-07")
    assert finding["severity"] == "warn" and "learning rate" in finding["message"]
    streak = finding["evidence"]["streak"]
    assert len(streak) == 3 and all(s["distinct_1"] < 0.35 for s in streak)
    # The finding's step is the first generation step of the streak, recomputed from the series.
    con = connect(run_dir, read_only=True)
    series = con.execute(
        "SELECT step, value FROM series WHERE code = 'LOOP-07' AND name = 'distinct-1' ORDER BY step"
    ).fetchall()
    low = [s for s, v in series if v < 0.35]
    assert finding["step"] == low[0] == streak[0]["step"]
    assert all(v >= 0.35 for s, v in series if s < low[0])
    grams = [g["ngram"] for g in finding["evidence"]["ngrams"]]
    assert any(g in "根据您的问题，答案是这样的。" for g in grams[:3])


def test_clean_generations_raise_nothing(runs):
    verdict = audit(run(runs, "clean_probed"))
    assert of(verdict, "LOOP-07") == []
    assert GenerationDiversity.defaults["min_distinct_1"] == 0.35  # the seed's threshold
