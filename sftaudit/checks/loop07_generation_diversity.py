"""LOOP-07 generation diversity."""

from __future__ import annotations

from collections import Counter

import numpy as np

from .base import AuditContext, CannotJudge, Check, Finding, count, share
from .stats.rolling import runs_of
from .stats.text import join_ngram, tokenize


def ngrams(tokens: list[str], n: int) -> list[tuple[str, ...]]:
    return list(zip(*(tokens[i:] for i in range(n))))


class GenerationDiversity(Check):
    """Generation diversity (trigger point: eval steps).

    What it detects:
        Sampled generations on the fixed probe prompts collapsing onto the same words: a model
        that answers everything with a template (e.g. "根据您的问题，答案是...", "based on your question, the answer is...").
    Why it matters:
        Template or repetitive outputs do not show in the loss (the model predicts its training
        data well) nor always in ROUGE; only the diversity of what it generates reveals them.
    Statistic:
        On the shared tokenization (one token per CJK character, per word otherwise), per
        generation step and probe prompt: distinct-n = unique n-grams / all n-grams pooled over
        the prompt's samples (n = 1, 2), averaged over prompts; repetition-n = share of n-grams
        (n = 2, 3) that repeat an earlier n-gram of the same generation, averaged over generations.
    Threshold:
        distinct-1 < `min_distinct_1` (0.35) at `consecutive` (3) generation steps in
        a row: warn at the first of them, recommending learning-rate decay. Fewer generation steps
        than `consecutive`: not judged.
    Evidence:
        distinct-1/2 and repetition-2/3 at the steps of the streak, the most repeated n-grams.
    """

    code = "LOOP-07"
    name = "generation diversity"
    rules = {
        "diversity-lost": "distinct-1 of the generations stayed low for several generation steps",
    }
    needs = ("generations",)
    defaults = {"min_distinct_1": share(0.35), "consecutive": count(3), "top_ngrams": count(10)}

    def run(self, ctx: AuditContext) -> list[Finding]:
        rows = ctx.con.execute("SELECT step, prompt, text FROM generations ORDER BY step, prompt, sample").fetchall()
        if not rows:
            return []
        by_step: dict[int, dict[int, list[list[str]]]] = {}
        for step, prompt, text in rows:
            by_step.setdefault(step, {}).setdefault(prompt, []).append(tokenize(text))
        steps = np.array(sorted(by_step))
        stats = np.array([self._stats(by_step[s]) for s in steps])  # distinct-1, distinct-2, rep-2, rep-3
        for j, name in enumerate(("distinct-1", "distinct-2", "repetition-2", "repetition-3")):
            ctx.add_series(
                self.code,
                name,
                steps.tolist(),
                np.nan_to_num(stats[:, j]).tolist(),
                self.params["min_distinct_1"] if j == 0 else None,
            )
        k = self.params["consecutive"]
        if steps.size < k:  # its values are shown; a streak cannot be told from them
            raise CannotJudge(
                f"{steps.size} generation step(s) recorded: a streak of low diversity needs {k} (generate more often, "
                f"or at each checkpoint with `sftaudit probe`)"
            )
        with np.errstate(invalid="ignore"):
            low = stats[:, 0] < self.params["min_distinct_1"]
        hits = runs_of(low, k)
        if not hits.size:
            return []
        end = hits[0]
        first = end - k + 1
        counts = Counter()
        for tokens in (t for texts in by_step[steps[first]].values() for t in texts):
            counts.update(ngrams(tokens, 3) or ngrams(tokens, 2))
        top = [{"ngram": join_ngram(g), "count": c} for g, c in counts.most_common(self.params["top_ngrams"]) if c > 1]
        return [
            self.finding(
                "diversity-lost",
                "warn",
                f"generations lost diversity from step {steps[first]}: distinct-1 stayed below {self.params['min_distinct_1']} "
                f"for {k} generation steps (down to {stats[first : end + 1, 0].min():.2f}); decay the learning rate and "
                f"remove templated answers from the training data",
                step=steps[first],
                value=stats[first, 0],
                threshold=self.params["min_distinct_1"],
                ngrams=top,
                streak=[
                    {"step": int(s), "distinct_1": d1, "distinct_2": d2, "repetition_2": r2, "repetition_3": r3}
                    for s, (d1, d2, r2, r3) in zip(steps[first : end + 1], stats[first : end + 1])
                ],
            )
        ]

    @staticmethod
    def _stats(prompts: dict[int, list[list[str]]]) -> tuple[float, float, float, float]:
        distinct = {1: [], 2: []}
        repetition = {2: [], 3: []}
        for texts in prompts.values():
            for n in (1, 2):
                grams = [g for t in texts for g in ngrams(t, n)]
                if grams:
                    distinct[n].append(len(set(grams)) / len(grams))
            for n in (2, 3):
                for t in texts:
                    grams = ngrams(t, n)
                    if grams:
                        repetition[n].append(1 - len(set(grams)) / len(grams))
        mean = lambda v: float(np.mean(v)) if v else float("nan")  # noqa: E731
        return mean(distinct[1]), mean(distinct[2]), mean(repetition[2]), mean(repetition[3])
