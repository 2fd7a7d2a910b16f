"""LLaMA-Factory's ``trainer_log.jsonl``: its training log, which survives what ``trainer_state.json`` loses.

LLaMA-Factory's ``LogCallback.on_log`` (``src/llamafactory/train/callbacks.py``) appends one JSON
object per Trainer log to ``output_dir/trainer_log.jsonl``: ``current_steps`` (the global step),
``total_steps``, ``loss``, ``eval_loss``, ``predict_loss``, ``reward``, ``accuracy``, ``lr``,
``epoch``, ``percentage``, ``elapsed_time``, ``remaining_time``, then ``throughput`` and
``total_tokens`` when tokens are counted; keys whose value is None are dropped. It has no
``grad_norm``. The file is opened in append mode and deleted at start only with
``overwrite_output_dir``, so a resumed run appends: ``current_steps`` going back (or a training
log repeating its step) marks a restart, and the lines before it from that step on are the branch
the resume abandoned (which the resumed ``trainer_state.json`` no longer holds).

Here each restart's lines become log-history entries in ``trainer_state.json``'s key names; a key this
list does not know (a newer LLaMA-Factory's, a custom callback's) is kept under its own name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...core.safe_io import open_regular
from ..logs import MAX_LOG_BYTES, is_step, normalised
from ..source import LogSource, SourceLog

TRAINER_LOG = "trainer_log.jsonl"
NO_GRAD_NORM = {
    "grad_norm": "trainer_log.jsonl has no grad_norm (LLaMA-Factory keeps it in trainer_state.json only, "
    "and this run has none)"
}
# A line longer than this is no line LogCallback wrote (a few hundred bytes each): skipped, unread.
MAX_LINE_BYTES = 1 << 20
# trainer_log.jsonl key -> the Trainer's log_history key
KEYS = {
    "loss": "loss",
    "eval_loss": "eval_loss",
    "predict_loss": "predict_loss",
    "reward": "reward",
    "accuracy": "rewards/accuracies",
    "lr": "learning_rate",
    "epoch": "epoch",
    "total_tokens": "num_input_tokens_seen",
    "throughput": "throughput",
}
# Writers a line can continue: the most recently written (processes logging at once are one per GPU or so).
ACTIVE_WRITERS = 16
# The callback's own bookkeeping: progress, not a logged number.
PROGRESS = {"current_steps", "total_steps", "percentage", "elapsed_time", "remaining_time"}


class LlamaFactoryLog(LogSource):
    name = "llamafactory"
    provenance = "imported logs: trainer_log.jsonl (LLaMA-Factory)"
    patterns = (TRAINER_LOG,)
    what = TRAINER_LOG
    rank = 10

    def detect(self, path: Path) -> bool:
        """A JSON object on its first line, with LogCallback's ``current_steps``."""
        with open_regular(path) as f:
            first = f.readline(MAX_LINE_BYTES)
        try:
            raw = json.loads(first)
        except (ValueError, RecursionError):
            return False
        return isinstance(raw, dict) and "current_steps" in raw

    def read(self, files: list[Path], run_dir: Path) -> SourceLog:
        lines, skipped = read_lines(files[0], run_dir)
        total = planned_steps(lines)
        return self.log(
            files[:1],
            run_dir,
            segments=log_segments(lines),
            plan={"max_steps": total} if total else {},
            lacks=NO_GRAD_NORM,
            skipped=skipped,
            records=len(lines),
        )


def read_lines(path: Path, run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The file's JSON object lines, and the lines that are not one (``[{"file", "lines", "of"}]``, [] when none
    but the last: a write cut short by a crash is the one a log may end with). Read a line at a time after a size
    check, each line bounded (a longer one is skipped unread)."""
    out, bad, count, last_bad = [], 0, 0, False
    with open_regular(path.absolute(), run_dir, MAX_LOG_BYTES) as f:
        while line := f.readline(MAX_LINE_BYTES + 1):
            too_long = len(line) > MAX_LINE_BYTES
            while line and not line.endswith(b"\n") and too_long:  # the rest of an overlong line, unread
                line = f.readline(MAX_LINE_BYTES)
            if not too_long and not line.strip():
                continue
            count += 1
            try:
                raw = None if too_long else json.loads(line)
            except (ValueError, RecursionError):
                raw = None
            last_bad = not isinstance(raw, dict)
            if last_bad:
                bad += 1
            else:
                out.append(raw)
    bad -= last_bad  # the torn last line of a crash
    skipped = [{"file": str(path.relative_to(run_dir)), "lines": bad, "of": count}] if bad else []
    return out, skipped


def planned_steps(lines: list[dict[str, Any]]) -> int | None:
    """The run's planned length, as the log states it (``total_steps``, the newest start's)."""
    totals = [raw["total_steps"] for raw in lines if is_step(raw.get("total_steps")) and raw["total_steps"] > 0]
    return totals[-1] if totals else None


def log_segments(lines: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The file's lines as log-history entries, one list per (re)start of the run.

    Several processes may append to the same file at once (a launcher starting the script once per GPU, each
    rank's LogCallback writing): their lines interleave, each step logged once per writer, a step going back
    by a line or two. A restart goes back too, but it is a new process: everything it writes comes after the
    last line of the run it replaced. So the lines are first sorted into writers (each writer's steps go
    forward, and so does its ``elapsed_time``), and writers whose lines interleave in the file are one run:
    each step's line is kept once. Writers that follow one another are the restarts."""
    writers: list[dict[str, Any]] = []  # {"lines": [(file index, raw)], "step", "loss_step", "elapsed"}
    active: list[dict[str, Any]] = []  # the writers a line may continue, least recently written first
    seen = set()
    for index, raw in enumerate(lines):
        step = raw.get("current_steps")
        if not is_step(step) or not any(k not in PROGRESS and k not in ("epoch", "lr") for k in raw):
            continue  # a prediction-progress line, or no training/eval number in it
        text = json.dumps(raw, sort_keys=True)
        if text in seen:
            continue  # the same line written twice
        seen.add(text)
        elapsed = _seconds(raw.get("elapsed_time"))
        # A writer this line can continue: its step goes forward (an eval logs at a training log's step) and its
        # clock does not go back. Of those, the one it follows most closely; on a tie the one written last.
        fits = [
            w
            for w in active
            if (step > w["step"] or (step == w["step"] and not ("loss" in raw and w["loss_step"] == step)))
            and (elapsed is None or w["elapsed"] is None or elapsed >= w["elapsed"])
        ]
        if fits:
            writer = max(fits, key=lambda w: (w["step"], w["lines"][-1][0]))
            active.remove(writer)
        else:
            writer = {"lines": [], "elapsed": None, "loss_step": -1}
            writers.append(writer)
        # A bounded set of writers stays open (processes writing at once are a few): a log whose step goes back
        # line after line opens a writer per line, and stays linear.
        active = active[-(ACTIVE_WRITERS - 1) :] + [writer]
        writer["lines"].append((index, raw))
        writer["step"], writer["elapsed"] = step, elapsed if elapsed is not None else writer["elapsed"]
        writer["loss_step"] = step if "loss" in raw else writer["loss_step"]
    # Writers whose spans in the file overlap wrote at the same time: one run. Those that follow one another: restarts.
    runs: list[list[dict[str, Any]]] = []
    end = -1
    for w in sorted(writers, key=lambda w: w["lines"][0][0]):
        if w["lines"][0][0] > end:
            runs.append([])
        runs[-1].append(w)
        end = max(end, w["lines"][-1][0])
    segments = []
    for group in runs:
        kept: dict[tuple, dict[str, Any]] = {}
        for _index, raw in sorted((x for w in group for x in w["lines"]), key=lambda x: x[0]):
            entry = {"step": raw["current_steps"]} | normalised(
                {KEYS.get(k, k): v for k, v in raw.items() if k not in PROGRESS}
            )
            kept.setdefault((entry["step"], tuple(sorted(entry))), entry)  # the first writer's line of each step
        segments.append(sorted(kept.values(), key=lambda e: e["step"]))
    return segments


def _seconds(text: Any) -> float | None:
    """LogCallback's ``elapsed_time`` (``str(timedelta)``: "H:MM:SS" or "N day(s), H:MM:SS") in seconds."""
    if not isinstance(text, str):
        return None
    days, _, clock = text.rpartition(", ")
    try:
        h, m, s = (float(x) for x in clock.split(":"))
        return (int(days.split()[0]) if days else 0) * 86400 + h * 3600 + m * 60 + s
    except (ValueError, IndexError):
        return None
