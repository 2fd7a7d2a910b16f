"""LOOP-08 eval metric drift and eval-set contamination."""

from __future__ import annotations

import numpy as np

from ..core.artifacts import TOKENIZER_DIR, artifact_root
from .base import AuditContext, CannotJudge, Check, Finding, at_least, count, probability, share
from .stats.text import SharedTokenizer, tokenize


def shingles(tokens: list[str], n: int) -> set[tuple[str, ...]]:
    return set(zip(*(tokens[i:] for i in range(n)))) if len(tokens) >= n else {tuple(tokens)} if tokens else set()


def rouge_l_and_bleu_4(predictions: list[str], references: list[str]) -> tuple[float, float]:
    """Mean ROUGE-L F1 (rouge-score) and corpus BLEU-4 (sacrebleu), both in [0, 1], on one tokenization."""
    import sacrebleu  # imported on use: rouge-score alone (nltk) costs seconds that preflight and --help never need
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=SharedTokenizer())
    rouge = float(np.mean([scorer.score(r, p)["rougeL"].fmeasure for p, r in zip(predictions, references)]))
    # sacrebleu on pre-tokenized text: tokenize='none' keeps exactly the shared tokens.
    bleu = (
        sacrebleu.corpus_bleu(
            [" ".join(tokenize(p)) for p in predictions], [[" ".join(tokenize(r)) for r in references]], tokenize="none"
        ).score
        / 100
    )
    return rouge, bleu


class EvalMetricDrift(Check):
    """Eval metric drift and eval-set contamination (trigger point: after eval).

    What it detects:
        ROUGE-L and BLEU-4 of the eval-set generations no longer moving together, or one of them
        trending down; eval items whose prompt and reference also appear among the recorded
        training samples (a leaked test set).
    Why it matters:
        Two metrics of the same outputs that stop agreeing mean the measurement is broken (e.g. the
        two computed on different tokenizers), not the model; a contaminated eval set inflates every metric
        computed on it.
    Statistic:
        sftaudit computes both metrics itself from the recorded predictions and references on
        one shared tokenization (CJK characters, words otherwise; see `text.py`): ROUGE-L F1 with
        rouge-score given that tokenizer (its default drops Chinese), corpus BLEU-4 with sacrebleu
        on the pre-tokenized text (tokenize='none'). Pearson r between them over a rolling window
        of `window` (5) eval steps; Kendall's tau of each metric against the step. Contamination:
        containment of an eval item's prompt and of its reference (token 3-gram sets, the smaller
        of the two) in a decoded training sample's 3-gram set (1.0 is an exact copy).
    Threshold:
        abs(r) < `min_abs_r` (0.3) in a window where both metrics vary (std >= `min_std`, 0.005):
        warn at the window's last step. A falling trend with Kendall p < `trend_p` (0.01) over at
        least 6 evals: warn. Containment >= `near_duplicate` (0.85): warn
        per run, fail when the leaked share of the eval set is >= `max_leaked_share` (5%), at the
        first step a leaked sample was trained. Fewer than `window` evaluations, or no eval set
        and training samples to compare: that part is not judged (the check ran on partial
        evidence; neither: not judged).
    Evidence:
        The window's metric values and r; leaked eval ids with the training sample ids, their
        containment and the step they were trained.
    """

    code = "LOOP-08"
    name = "eval metric drift"
    rules = {
        "metrics-disagree": "ROUGE-L and BLEU-4 stopped agreeing over the rolling window",
        "metric-fell": "an eval metric fell over the run",
        "eval-leak": "eval items also appear in the training data",
    }
    needs = (("evals", "samples"),)  # the metrics judge eval predictions; contamination, the training samples
    uses = ("evals", "samples")
    defaults = {
        "window": count(5, low=3),  # a correlation over two points is always +-1
        "min_abs_r": share(0.3),
        "min_std": at_least(0.005, 0),
        "trend_p": probability(0.01),
        "near_duplicate": share(0.85),
        "max_leaked_share": share(0.05),
        "shingle": count(3),
    }

    def run(self, ctx: AuditContext) -> list[Finding]:
        findings = self._metrics(ctx) + self._contamination(ctx)
        # What the run's evidence left unjudged: the drift needs `window` evaluations, contamination an eval
        # set and the training samples.
        evals = ctx.scalar("SELECT count(DISTINCT step) FROM evals") if ctx.has_rows("evals") else 0
        drift = (
            None
            if evals >= self.params["window"]
            else f"{evals} evaluation(s) recorded: the agreement of ROUGE-L and BLEU-4 needs {self.params['window']}, "
            f"their trend 6"
        )
        contamination = None if self._contamination_judged(ctx) else "no eval set and training samples to compare"
        if drift and contamination and not findings:
            raise CannotJudge(f"{drift}; {contamination}")
        if drift or contamination:
            ctx.partly_judged[self.code] = drift or contamination
        return findings

    def _metrics(self, ctx: AuditContext) -> list[Finding]:
        rows = ctx.con.execute("SELECT step, prediction, reference FROM evals ORDER BY step, item").fetchall()
        if not rows:
            return []
        from scipy import stats  # here, not at module level nor before: only a run with generated evals pays for it

        by_step: dict[int, tuple[list[str], list[str]]] = {}
        for step, prediction, reference in rows:
            preds, refs = by_step.setdefault(step, ([], []))
            preds.append(prediction or "")
            refs.append(reference or "")
        steps = np.array(sorted(by_step))
        rouge, bleu = np.array([rouge_l_and_bleu_4(*by_step[s]) for s in steps]).T
        ctx.add_series(self.code, "ROUGE-L", steps.tolist(), rouge.tolist())
        ctx.add_series(self.code, "BLEU-4", steps.tolist(), bleu.tolist())
        findings = []
        w = self.params["window"]
        if steps.size >= w:
            view = np.lib.stride_tricks.sliding_window_view
            rw, bw = view(rouge, w), view(bleu, w)
            varying = (rw.std(axis=1) >= self.params["min_std"]) & (bw.std(axis=1) >= self.params["min_std"])
            r = np.full(rw.shape[0], np.nan)
            if varying.any():
                r[varying] = stats.pearsonr(rw[varying], bw[varying], axis=1).statistic
            ctx.add_series(
                self.code,
                f"Pearson r(ROUGE-L, BLEU-4), window {w}",
                steps[w - 1 :].tolist(),
                np.nan_to_num(r, nan=1.0).tolist(),
                self.params["min_abs_r"],
            )
            low = np.flatnonzero(varying & (np.abs(r) < self.params["min_abs_r"]))
            if low.size:
                i = low[0]
                findings.append(
                    self.finding(
                        "metrics-disagree",
                        "warn",
                        f"ROUGE-L and BLEU-4 stopped agreeing at step {steps[i + w - 1]} (Pearson r = {r[i]:.2f} over the last "
                        f"{w} evals); check that both metrics score the same outputs on the same tokenization before trusting either",
                        step=steps[i + w - 1],
                        value=r[i],
                        threshold=self.params["min_abs_r"],
                        window=[
                            {"step": int(s), "rouge_l": a, "bleu_4": b}
                            for s, a, b in zip(steps[i : i + w], rouge[i : i + w], bleu[i : i + w])
                        ],
                    )
                )
        if steps.size >= 6:
            for name, values in (("ROUGE-L", rouge), ("BLEU-4", bleu)):
                if np.ptp(values) < self.params["min_std"]:
                    continue
                tau = stats.kendalltau(steps, values)
                if tau.statistic < 0 and tau.pvalue < self.params["trend_p"]:
                    findings.append(
                        self.finding(
                            "metric-fell",
                            "warn",
                            f"{name} fell over the run ({values[0]:.3f} at step {steps[0]} to {values[-1]:.3f} at step "
                            f"{steps[-1]}, Kendall tau {tau.statistic:.2f}); compare checkpoints and keep the best, not the last",
                            step=steps[int(np.argmax(values))],
                            value=tau.statistic,
                            p_value=tau.pvalue,
                            threshold=self.params["trend_p"],
                        )
                    )
        return findings

    @staticmethod
    def _contamination_judged(ctx: AuditContext) -> bool:
        tokenizer_file = artifact_root(ctx.run_dir) / TOKENIZER_DIR / "tokenizer.json"
        return bool(ctx.manifest.get("eval_set")) and tokenizer_file.is_file() and ctx.has_rows("samples")

    def _contamination(self, ctx: AuditContext) -> list[Finding]:
        eval_set = ctx.manifest.get("eval_set") or []
        tokenizer_file = artifact_root(ctx.run_dir) / TOKENIZER_DIR / "tokenizer.json"
        if not self._contamination_judged(ctx):
            return []
        from tokenizers import Tokenizer  # the run's own tokenizer decodes the recorded rows

        samples = ctx.con.execute(
            "SELECT sample_id, arg_min(input_ids, step), min(step) FROM samples GROUP BY sample_id"
        ).fetchall()
        texts = Tokenizer.from_file(str(tokenizer_file)).decode_batch([s[1] for s in samples], skip_special_tokens=True)
        n = self.params["shingle"]
        train = [shingles(tokenize(t), n) for t in texts]
        leaks = []
        for item in eval_set:
            prompt = " ".join(m.get("content", "") for m in item.get("messages", []) if m.get("role") != "system")
            parts = [shingles(tokenize(text), n) for text in (prompt, item.get("reference", ""))]
            if not all(parts):
                continue
            # Both the prompt and the reference must be in the sample (the template's role names sit between them).
            containment = np.array([min(len(p & t) / len(p) for p in parts) for t in train])
            hit = np.flatnonzero(containment >= self.params["near_duplicate"])
            if hit.size:
                leaks.append(
                    {
                        "eval_id": item.get("id"),
                        "training_samples": [samples[i][0] for i in hit],
                        "containment": float(containment[hit].max()),
                        "first_trained_step": int(min(samples[i][2] for i in hit)),
                    }
                )
        if not leaks:
            return []
        # The first step a leaked sample went through training, from every batch (not just the recorded rows).
        ids = sorted({s for leak in leaks for s in leak["training_samples"]})
        first = ctx.scalar(
            "SELECT min(step) FROM (SELECT step, unnest(sample_ids) AS id FROM batches) "
            "WHERE id IN (SELECT unnest(?::VARCHAR[]))",
            [ids],
        ) or min(leak["first_trained_step"] for leak in leaks)
        share = len(leaks) / len(eval_set)
        return [
            self.finding(
                "eval-leak",
                "fail" if share >= self.params["max_leaked_share"] else "warn",
                f"{len(leaks)} of {len(eval_set)} eval items ({share:.0%}) also appear in the training data, first trained at "
                f"step {first}; remove them from the eval set (or the training set) and recompute the eval metrics",
                step=first,
                value=share,
                threshold=self.params["max_leaked_share"],
                sample_ids=ids,
                leaked=leaks,
            )
        ]
