"""Which run each saved log of an output folder belongs to, and which run is the latest, told by what the files
hold and never by when they were written (a git clone or a copy rewrites every file's time: a clone writes in
path order, so ``checkpoint-60/`` can look newer than ``checkpoint-1134/``).

One ``output_dir`` often holds several runs: a second training with other arguments saves its ``checkpoint-N/``
folders beside the first's, and a log history can be carried into a run on other data. What tells them apart:

* **A resume reloads the log history of the checkpoint it resumes from**, so every state of one run, on
  whichever branch, begins with the same first log entry; a new run's first entry is its own. States that
  share their first entry are one run (its branches part where a resume abandoned one). A state with an empty
  history (nothing logged yet) belongs to the run of its plan (``max_steps``, batch size, ``logging_steps``).
* **A log whose step or epoch goes back holds two runs**: the entries before the last such reset are
  another run's (the Trainer's own step and epoch never go back within a run).
* **Which run, or which branch of a resumed run, is later:** a ``checkpoint-N/`` folder holds whichever saved
  there last. A folder of A at a step that B passed on its own save grid (B saved there too) means A wrote
  after B. Without such evidence, the one that reached the higher ``global_step``; then the one whose state
  sits at the top of the folder (``save_state`` writes it when training ends).
"""

from __future__ import annotations

import json
import math
from itertools import repeat
from operator import itemgetter
from typing import Any

import numpy as np

from .logs import holding

# Fields of a trainer state that describe a run's plan: equal in every state of one run unless a resume changed it.
PLAN_FIELDS = ("max_steps", "train_batch_size", "logging_steps")


def plan(state: dict[str, Any]) -> dict[str, int]:
    """The state's plan: the `PLAN_FIELDS` it states as positive integers."""
    return {
        k: state[k]
        for k in PLAN_FIELDS
        if isinstance(state.get(k), int) and not isinstance(state.get(k), bool) and state[k] > 0
    }


def plans_agree(a: dict[str, int], b: dict[str, int]) -> bool:
    """Two plans that state a common field, and agree on every field both state."""
    common = a.keys() & b.keys()
    return bool(common) and all(a[k] == b[k] for k in common)


def plans_differ(a: dict[str, int], b: dict[str, int]) -> bool:
    """Two plans that disagree on a field both state."""
    return any(a[k] != b[k] for k in a.keys() & b.keys())


def split_glued(history: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[int]]:
    """A log history cut at its last reset: (the entries before it, another run's; the entries from it on; the steps
    among those where the epoch count started again at a resume); ([], history, ...) when nothing resets. A reset
    is a training log whose step is below the one before it, or whose epoch is and the epoch after it counts from
    step 0 with another epoch length (the data changed). An epoch that counts again from the step where it fell is
    one run resumed on a streamed dataset, whose position in its epoch the Trainer cannot restore: not a reset but
    a resume the log shows."""
    cut, restarts = _resets(history)
    return history[:cut], history[cut:], [history[i]["step"] for i in restarts if i >= cut]


def _resets(history: list[dict[str, Any]]) -> tuple[int, list[int]]:
    """(the index of the last reset, 0 if none; the indices where the epoch count restarted instead). The training
    logs' steps and epochs as arrays (an evaluation shares a training log's step); only the places where one goes
    back are looked at one by one."""
    index = np.flatnonzero(holding(history, "loss")).tolist()
    if len(index) < 2:
        return 0, []
    trained = list(map(history.__getitem__, index))
    steps = np.fromiter(map(itemgetter("step"), trained), dtype=np.int64, count=len(trained))
    epochs = _epochs(list(map(dict.get, trained, repeat("epoch"))))  # NaN: none
    back = steps[1:] < steps[:-1]
    candidates = np.flatnonzero(back | (epochs[1:] < epochs[:-1])) + 1
    finite = np.flatnonzero(~np.isnan(epochs))
    cut, restarts = 0, []
    for k in candidates.tolist():
        if back[k - 1]:
            cut = index[k]
        else:
            after = finite[np.searchsorted(finite, k) :]  # the finite epochs from the reset on (its own first)
            first, last = after[0], after[-1]
            line = (int(steps[first]), float(epochs[first])), (int(steps[last]), float(epochs[last]))
            if _counts_from_zero(*line):
                cut = index[k]
            else:
                restarts.append(index[k])
    return cut, restarts


def _epochs(values: list[Any]) -> np.ndarray:
    """Each logged epoch that is a finite float, NaN for any other value (floats or absent: in C, as a per-step
    log's are; one by one otherwise)."""
    if set(map(type, values)) <= {float, type(None)}:
        epochs = np.array(values, dtype=np.float64)  # None: NaN
        epochs[~np.isfinite(epochs)] = np.nan
        return epochs
    return np.array([v if type(v) is float and math.isfinite(v) else math.nan for v in values], dtype=np.float64)


def _counts_from_zero(first: tuple[int, float], last: tuple[int, float]) -> bool:
    """Whether the epochs logged from a reset on lie on a line through step 0 (epoch = step / steps per epoch:
    a run on data of another length) rather than through the reset's step (the count restarted there). The line
    through the first and the last of them (step, epoch); rounding (two decimals in older logs) moves it by far
    less than the reset's step."""
    (s_a, e_a), (s_b, e_b) = first, last
    if e_b <= e_a:
        return e_a > 0  # one epoch value only: a count restarted at the reset starts near 0
    origin = s_a - e_a * (s_b - s_a) / (e_b - e_a)  # the step where the line's epoch is 0
    return abs(origin) < 0.5 * s_a


def group_runs(states: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The states grouped into runs: by their first log entry, a state with an empty history by its plan."""
    runs: dict[str, list[dict[str, Any]]] = {}
    empty = []
    for s in states:
        if s["history"]:
            runs.setdefault(json.dumps(s["history"][0], sort_keys=True), []).append(s)
        else:
            empty.append(s)
    out = list(runs.values())
    for s in empty:
        same = next((r for r in out if any(plans_agree(plan(s), plan(t)) for t in r)), None)
        if same is None:
            out.append([s])
        else:
            same.append(s)
    return out


def tip(states: list[dict[str, Any]]) -> dict[str, Any]:
    """The state that reached furthest (at equal steps, the one at the top of the folder; then by folder name)."""
    return max(states, key=lambda s: (s["global_step"], s["top_level"], str(s["folder"])))


def later(a: list[dict[str, Any]], b: list[dict[str, Any]], diverged: int = 0) -> bool:
    """Whether run (or branch) `a` was written after `b`, by content; `diverged`: the first step where the two
    differ (0 for two runs). See the module's docstring."""
    a_over, b_over = overwrote(a, b, diverged), overwrote(b, a, diverged)
    if a_over != b_over:
        return a_over
    ta, tb = tip(a), tip(b)
    return (ta["global_step"], ta["top_level"], str(ta["folder"])) > (
        tb["global_step"],
        tb["top_level"],
        str(tb["folder"]),
    )


def overwrote(a: list[dict[str, Any]], b: list[dict[str, Any]], diverged: int = 0) -> bool:
    """Whether a checkpoint folder of `a` (at or after `diverged`) sits at a step where `b` saved too: a step `b`
    reached, on its save grid (every ``save_steps``, and its last step when it reached ``max_steps``). The grid is
    trusted only when `b`'s own checkpoints lie on it (a run saving per epoch states ``save_steps`` all the same)."""
    last = tip(b)
    save, planned, reach = last.get("save_steps"), last.get("max_steps"), last["global_step"]
    if not isinstance(save, int) or isinstance(save, bool) or save <= 0:
        return False
    own = [s["step"] for s in b if s["step"] is not None]
    if not own or any(x % save and x != planned for x in own):
        return False
    return any(
        s["step"] is not None and diverged <= s["step"] <= reach and (s["step"] % save == 0 or s["step"] == planned)
        for s in a
    )


def latest(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The run written last (`later`, compared in turn)."""
    best = runs[0]
    for run in runs[1:]:
        if later(run, best):
            best = run
    return best


def describe(run: list[dict[str, Any]], run_dir) -> dict[str, Any]:
    """Another run, as the import names it: its checkpoints, how far it got, its plan."""
    last = tip(run)
    logged = [e["step"] for e in last["history"]]
    saved = sorted((s for s in run if not s["top_level"]), key=lambda s: _folder_order(s["folder"].name))
    return {
        "checkpoints": [s["folder"].name for s in saved],
        "checkpoint_steps": [s["step"] for s in saved],  # each checkpoint's step (None: its state names none)
        "state_files": sorted(str((s["folder"] / "trainer_state.json").relative_to(run_dir)) for s in run),
        "global_step": last["global_step"],
        "first_step": min(logged, default=None),
        "last_step": max(logged, default=None),
        **plan(last),
    }


def _folder_order(name: str) -> tuple[int, str]:
    digits = "".join(c for c in name if c.isdigit())
    return (int(digits) if digits else -1, name)
