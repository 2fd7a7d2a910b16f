"""Training logs kept per (re)start (LLaMA-Factory's trainer_log.jsonl, TensorBoard event files), as the
log histories a ``trainer_state.json`` would have held: what the import reads when no state survives.
Also what every log reader shares: the key names loggers use for the Trainer's own keys, and Git LFS
pointer files (a clone without git-lfs leaves them in place of the data)."""

from __future__ import annotations

import json
import math
from itertools import chain, repeat
from pathlib import Path
from typing import Any

import numpy as np

from ..core.safe_io import MAX_WHOLE_FILE_BYTES, UnsafeFile, read_bytes

# Other loggers' names for the Trainer's log keys (custom trainers logging `lr`, W&B/TensorBoard-style
# `train/...` and `eval/...` tags written back into a log history). The Trainer's own name wins when both are there.
ALIASES = {
    "lr": "learning_rate",
    "train/learning_rate": "learning_rate",
    "train/lr": "learning_rate",
    "train/loss": "loss",
    "train/grad_norm": "grad_norm",
    "grad-norm": "grad_norm",
    "train/epoch": "epoch",
    "eval/loss": "eval_loss",
}
# A training log larger than this is refused unread: a per-step log of 10^7 steps is a few GB.
MAX_LOG_BYTES = 16 * 2**30


# A number written as text ("nan", "Infinity", "1e-4"): longer text is no number a logger wrote.
NUMBER_TEXT_CHARS = 40


def number(value: Any) -> float | None:
    """A logged value as a float: a JSON number (``NaN``/``Infinity`` included), or text that spells one
    ("nan", "inf", "-Infinity", "2e-05": loggers that stringify); None for anything else (a bool, a list)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        try:
            return float(value)
        except OverflowError:  # an integer beyond float's range
            return math.copysign(math.inf, value)
    if isinstance(value, str) and len(value) <= NUMBER_TEXT_CHARS:
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def is_step(value: Any) -> bool:
    """A step as loggers write it: an integer (not a bool, a float or text), within a 64-bit integer's range."""
    return type(value) is int and -(2**63) <= value < 2**63


# Key names seen, each mapped once to the Trainer's name for it: every entry of a log then shares one string per
# key (a million entries with eight keys each hold eight strings, not eight million). Bounded: a log with more
# distinct keys than this names the rest one entry at a time.
_NAMES: dict[str, str] = {}
MAX_NAMES = 4096
# Keys of entries (in their order) that are each the Trainer's own name: such an entry whose values are all floats
# but an integer step is normalised already (a per-step log repeats one set of keys a million times).
_OWN_NAMES: set[tuple[str, ...]] = set()


def normalised(entry: dict[str, Any]) -> dict[str, Any]:
    """A log entry with the Trainer's key names (`ALIASES`; any other ``eval/x`` as ``eval_x``) and every value
    that is a number as a float (text spelling one included, so a "nan" stays a NaN); a nested group of numbers
    (``{"rewards": {"chosen": ...}}``) flattened to ``rewards/chosen``. ``step`` stays the integer it is.
    One pass over the keys: a per-step log of a million entries goes through here once."""
    keys = tuple(entry)
    if (
        keys in _OWN_NAMES
        and type(entry.get("step")) is int
        and list(map(type, entry.values())).count(float) == len(keys) - 1
    ):
        return entry
    out: dict[str, Any] = {}
    names = _NAMES
    for key, value in entry.items():
        kind = type(value)
        if kind is dict:
            for k, v in value.items():
                if isinstance(k, str) and type(v) is not dict:
                    out[f"{key}/{k}"] = v if type(v) is float or (n := number(v)) is None else n
            continue
        if kind is not float and key != "step":
            value = v if (v := number(value)) is not None else value
        name = names.get(key)
        if name is None:
            name = _trainer_name(key)
            if len(names) < MAX_NAMES:
                names[key] = name
        if name != key and (name in entry or name in out):
            out.setdefault(key, value)  # the Trainer's own key is there too: both kept, its value used
            continue
        out[name] = value
    if len(_OWN_NAMES) < MAX_NAMES and all(names.get(key) == key for key in keys):
        _OWN_NAMES.add(keys)
    return out


def _trainer_name(key: str) -> str:
    return ALIASES.get(key) or (f"eval_{key[5:]}" if key[:5] == "eval/" else key)


def all_normalised(entries: list[dict[str, Any]]) -> bool:
    """Whether each of `entries` (log entries decoded from JSON) is as `normalised` gives it already and has a
    step: every key the Trainer's own name, every value a float but the step, an integer of 64 bits. Checked in C
    over the whole batch (a per-step log's entries all are: then none is looked at one by one)."""
    if any(_trainer_name(key) != key for key in set().union(*entries)):
        return False
    steps = list(map(dict.get, entries, repeat("step")))
    if set(map(type, steps)) != {int} or not (-(2**63) <= min(steps) and max(steps) < 2**63):
        return False
    values = sum(map(len, entries))
    return list(map(type, chain.from_iterable(map(dict.values, entries)))).count(float) == values - len(entries)


def holding(entries: list[dict[str, Any]], key: str) -> np.ndarray:
    """Per log entry, whether it holds `key` (in C: a per-step log has a million)."""
    return np.fromiter(map(dict.__contains__, entries, repeat(key)), dtype=bool, count=len(entries))


# Keys of the end-of-training log entry: a summary of the run, not a training step.
SUMMARY_KEYS = ("train_runtime", "train_loss")


def training_logs(entries: list[dict[str, Any]], keys: set[str] | None = None) -> np.ndarray:
    """Per log entry, whether it is a training log: a loss, and not the end-of-training summary. `keys`: the keys
    the entries hold, when known (a summary key none of them holds is not looked for entry by entry)."""
    mask = holding(entries, "loss")
    for key in SUMMARY_KEYS:
        if keys is None or key in keys:
            mask &= ~holding(entries, key)
    return mask


def read_json(path: Path, root: Path, max_bytes: int = MAX_WHOLE_FILE_BYTES) -> Any:
    """A small JSON file of the run (config.json, adapter_config.json, sftaudit's own notes), read whole when it is
    a regular file inside `root` of at most `max_bytes`; None when it is not, or not JSON."""
    try:
        return json.loads(read_bytes(path.absolute(), root, max_bytes))
    except (OSError, UnsafeFile, ValueError, RecursionError):
        return None


def latest_history(segments: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The log history the Trainer held after the last restart: the earlier restarts' lines before its first step
    (of each step, the line written last: each restart overwrote what followed it), then its own. One pass: what
    earlier restarts abandoned is the import's to set aside (`trainer._with_log`)."""
    start = segments[-1][0]["step"]
    kept = {}
    for seg in segments[:-1]:
        for e in seg:
            if e["step"] < start:
                kept[(e["step"], tuple(sorted(e)))] = e
    return sorted(kept.values(), key=lambda e: e["step"]) + segments[-1]


def logging_interval(history: list[dict[str, Any]]) -> int | None:
    """``logging_steps`` as the log shows it (the smallest gap between training logs)."""
    steps = sorted({e["step"] for e in history if "loss" in e})
    gaps = [b - a for a, b in zip(steps, steps[1:]) if b > a]
    return min(gaps) if gaps else None
