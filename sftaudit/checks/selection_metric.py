"""The run's eval metrics as it judged itself: each logged ``eval_*`` key's direction, its noise band, and the
metric the run selected checkpoints on. Shared by LOOP-26 (which judges them) and the verdict (which names the
checkpoint to keep), so both see one series, one direction and one band."""

from __future__ import annotations

import math
import re
from statistics import NormalDist
from typing import Any

import numpy as np

from .stats.rolling import MAD_TO_SIGMA, log_quantum

# Fewer evaluations than this leave too few second differences (4) to tell the eval's own noise.
MIN_BAND_EVALS = 6
# The band is this many standard deviations of the difference of two evaluations (each with the eval's noise).
BAND_SIGMA = 3.0
# Name parts that say which way is better (the name split at _ / - .). Prefixes for the families of scores.
LOWER_PARTS = frozenset({"loss", "wer", "cer", "mer", "wil", "ter", "perplexity", "ppl", "error"})
HIGHER_PARTS = frozenset({"acc", "em", "f1", "auc", "mcc", "mrr", "map"})
HIGHER_PREFIXES = (
    "accura",
    "bleu",
    "sacrebleu",
    "rouge",
    "chrf",
    "exact",
    "precision",
    "recall",
    "meteor",
    "bertscore",
    "matthews",
    "pearson",
    "spearman",
    "ndcg",
)
# Error rates a degenerate model drives towards 100% (of words, characters).
ERROR_RATES = frozenset({"wer", "cer", "mer", "wil"})
# A classifier's accuracy (not a language model's token accuracy, not a preference accuracy).
CLASSIFIER_ACCURACY = frozenset({"accuracy", "acc"})
CLASSIFIER_HEADS = ("ForSequenceClassification", "ForAudioClassification", "ForImageClassification")
# eval_* keys the Trainer logs that measure the eval itself, not the model.
NOT_METRICS = re.compile(r"(runtime|per_second|_time|gen_len|num_tokens|num_input_tokens_seen|total_flos|epoch)$")
_PARTS = re.compile(r"[_/.\-]+")


def metric_name(key: str) -> str:
    """The metric a logged key names: ``eval_wer`` -> ``wer``."""
    return key.removeprefix("eval_").lower()


def name_parts(key: str) -> list[str]:
    """The words of a metric's name: ``eval_rouge-L`` -> ["rouge", "l"]."""
    return [p for p in _PARTS.split(metric_name(key)) if p]


def direction(key: str) -> str | None:
    """ "lower" or "higher" (which way is better) from the metric's name; None for a name it does not tell
    (``rewards/margins``, ``entropy``): never guessed."""
    parts = name_parts(key)
    lower = any(p in LOWER_PARTS for p in parts)
    higher = any(p in HIGHER_PARTS or p.startswith(HIGHER_PREFIXES) for p in parts)
    return "lower" if lower and not higher else "higher" if higher and not lower else None


def is_metric(key: str) -> bool:
    return key.startswith("eval_") and not NOT_METRICS.search(key)


def eval_series(con) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per logged eval metric (rank 0): its evaluation steps and finite values, one per step (a step a resume
    logged twice keeps the branch the run ended on, the highest segment)."""
    rows = con.execute(
        r"""SELECT name, step, arg_max(value, seg) AS value FROM metrics
            WHERE rank = 0 AND name LIKE 'eval\_%' ESCAPE '\' GROUP BY name, step ORDER BY name, step"""
    ).fetchall()
    out: dict[str, tuple[list, list]] = {}
    for name, step, value in rows:
        if is_metric(name) and value is not None and np.isfinite(value):
            steps, values = out.setdefault(name, ([], []))
            steps.append(int(step))
            values.append(float(value))
    return {k: (np.array(s, dtype=np.int64), np.array(v, dtype=float)) for k, (s, v) in out.items()}


def noise_sigma(values: np.ndarray) -> float | None:
    """One evaluation's noise: the robust spread (1.4826 MAD) of second differences over sqrt(6) (a smooth
    trend, even a curving one, leaves them out), floored at the values' rounding step. None below
    MIN_BAND_EVALS evaluations."""
    v = np.asarray(values, dtype=float)
    if v.size < MIN_BAND_EVALS:
        return None
    d2 = np.diff(v, 2)
    sigma = MAD_TO_SIGMA * float(np.median(np.abs(d2 - np.median(d2)))) / np.sqrt(6)
    return max(sigma, log_quantum(v))


def noise_band(values: np.ndarray) -> float | None:
    """How far two evaluations may differ by noise alone: BAND_SIGMA standard deviations of their difference."""
    sigma = noise_sigma(values)
    return None if sigma is None else BAND_SIGMA * np.sqrt(2) * sigma


def better(values: np.ndarray, way: str) -> np.ndarray:
    """The values oriented so that lower is better (a higher-is-better metric negated)."""
    return np.asarray(values, dtype=float) * (1 if way == "lower" else -1)


def worse_to_the_end(values: np.ndarray, way: str, band: float) -> tuple[int, int] | None:
    """(index of the best evaluation, index of the first of the final evaluations that are all worse than it by
    more than `band`), when at least two evaluations end the run that way; None otherwise."""
    x = better(values, way)
    best = int(np.argmin(x))
    worse = x[best + 1 :] > x[best] + band
    stretch = int(np.flip(np.logical_and.accumulate(np.flip(worse))).sum())
    return (best, x.size - stretch) if stretch >= 2 else None


def worse_than_all_before(values: np.ndarray, way: str, alpha: float) -> int | None:
    """The index of the first evaluation from which every evaluation to the end is worse than every one before it
    (a jump that stayed: the ranks separate completely), when that is too unlikely for noise. By the ranks alone:
    an evaluation series without a trend puts its last m evaluations above all the others with probability
    1 / C(n, m), here taken over the n - 2 places it could split (Bonferroni) and kept at <= `alpha`. Or by how far:
    with 3 evaluations or more on each side, the mean after the split over the mean before, in units of the eval's
    own noise (`noise_sigma` x sqrt(1 / before + 1 / after)), at a one-sided normal p <= `alpha` / (n - 2) (a jump
    early in the run leaves too few evaluations before it for the ranks alone). A falling metric makes either
    rarer still; a metric now worse than its first evaluation is worth the warning whatever its noise. None: no
    such split."""
    x = better(values, way)
    n = x.size
    if n < 4:
        return None
    ahead = np.maximum.accumulate(x)[:-1]  # per split t (1..n-1): the worst evaluation before it
    behind = np.minimum.accumulate(x[::-1])[::-1][1:]  # the best from it to the end
    before = np.arange(1, n)
    after = n - before
    chance = (n - 2) / np.array([math.comb(n, m) for m in after], dtype=float)  # one per evaluation: a few dozen
    likely = chance <= alpha
    sigma = noise_sigma(values)
    if sigma:
        sums = np.cumsum(x)[:-1]
        shift = (sums[-1] + x[-1] - sums) / after - sums / before
        z = shift / (sigma * np.sqrt(1 / before + 1 / after))
        likely |= (before >= 3) & (after >= 3) & (z >= NormalDist().inv_cdf(1 - alpha / (n - 2)))
    split = np.flatnonzero((behind > ahead) & (after >= 2) & likely)
    return int(split[0]) + 1 if split.size else None


def chance_accuracy(manifest: dict[str, Any]) -> float | None:
    """1 / the number of labels of a classifier's head (config.json's id2label), else None."""
    model = manifest.get("model") or {}
    config = model.get("config") if isinstance(model.get("config"), dict) else {}
    head = model.get("class") or ""
    labels = config.get("id2label")
    if not (isinstance(head, str) and head.endswith(CLASSIFIER_HEADS)) or not isinstance(labels, dict):
        return None
    return 1 / len(labels) if len(labels) >= 2 else None


def selection_metric(manifest: dict[str, Any], logged: set[str]) -> dict[str, Any]:
    """The metric the run selected checkpoints on, its direction and where both came from:
    {metric, direction, source ("run": trainer_state.json's best_metric, "default": eval_loss, the Trainer's
    default, when the run recorded none), note (why, in words)}. `metric` is None when none can be named;
    `direction` None when neither best_metric nor the name tells it."""
    selection = manifest.get("selection") if isinstance(manifest.get("selection"), dict) else {}
    chosen = selection.get("metric")
    if chosen in logged:
        told = selection.get("greater_is_better")
        way = ("higher" if told else "lower") if isinstance(told, bool) else direction(chosen)
        note = f"{chosen}, the metric the run selected its best checkpoint on (trainer_state.json's best_metric)"
        if way is None:
            note += ": neither its name nor best_metric against its logged values tells which way is better"
        return {"metric": chosen, "direction": way, "source": "run", "note": note}
    why = (
        f"the run's best_metric matches no logged eval metric ({chosen} is not logged)"
        if chosen
        else "the run's best_metric matches no single logged eval metric"
        if selection
        else "the run recorded no selection metric (no best_metric)"
    )
    if "eval_loss" in logged:
        return {
            "metric": "eval_loss",
            "direction": "lower",
            "source": "default",
            "note": f"eval_loss, the Trainer's default for choosing the best checkpoint: {why}",
        }
    return {"metric": None, "direction": None, "source": None, "note": f"{why}, and no eval_loss was logged"}


def run_selection_series(con, manifest: dict[str, Any]) -> dict[str, Any]:
    """What the verdict needs to name the checkpoint to keep: the selection metric (`selection_metric`) with
    its evaluations (`steps`, `values`), its noise band (None: too few evaluations), the run's last step, and the
    step the run itself saved as its best checkpoint (`best_saved_at`: trainer_state.json's best_model_checkpoint,
    which may no longer be in the folder)."""
    series = eval_series(con)
    chosen = selection_metric(manifest, set(series))
    steps, values = series.get(chosen["metric"], (np.zeros(0, np.int64), np.zeros(0)))
    last = con.execute(
        "SELECT max(step) FROM (SELECT max(step) AS step FROM steps WHERE rank = 0 "
        "UNION ALL SELECT max(step) FROM metrics WHERE rank = 0 "
        "UNION ALL SELECT max(step) FROM checkpoints WHERE rank = 0)"
    ).fetchone()[0]
    return {
        **chosen,
        "steps": steps.tolist(),
        "values": values.tolist(),
        "band": noise_band(values),
        "evaluated": bool(series),
        "last_step": int(last) if last is not None else None,
        "best_saved_at": _best_saved_at(manifest.get("selection")),
    }


def _best_saved_at(selection: Any) -> int | None:
    """The step of the checkpoint the run saved as its best (best_model_checkpoint names it), if any."""
    if not isinstance(selection, dict) or not selection.get("best_model_checkpoint"):
        return None
    step = selection.get("best_global_step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None
