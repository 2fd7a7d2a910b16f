"""The Hugging Face Trainer's ``trainer_state.json``: its ``log_history`` (every log since the run began, as the
branch that saved it ran), its plan (``max_steps``, ``num_train_epochs``, ``logging_steps``, ``eval_steps``,
``save_steps``, ``train_batch_size``) and its other fields (``global_step``, ``best_metric``,
``stateful_callbacks``...). One is saved with every checkpoint and one at the top of the output when training ends:
the Trainer output importer reads them all and tells the runs and branches of the folder apart by what they hold.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...core.safe_io import head, open_regular
from ...errors import InputError
from ..logs import MAX_LOG_BYTES, normalised
from ..source import LogSource, SourceLog, numbers_only

TRAINER_STATE = "trainer_state.json"
# The state's fields that are its plan, in the Trainer's names.
PLAN_FIELDS = ("max_steps", "num_train_epochs", "logging_steps", "eval_steps", "save_steps", "train_batch_size")
# How far into the file the detection looks for the state's own keys (the Trainer sorts them: a few scalars first).
DETECT_BYTES = 1 << 16


class TrainerState(LogSource):
    name = "trainer_state"
    provenance = "imported logs: trainer_state.json"
    patterns = (TRAINER_STATE, f"*/{TRAINER_STATE}")
    what = TRAINER_STATE
    rank = None  # one per checkpoint: the Trainer output importer reads every one and compares them

    def detect(self, path: Path) -> bool:
        """A JSON object whose first keys include the Trainer state's ``log_history`` or ``global_step``."""
        text = head(path, DETECT_BYTES).lstrip()
        return text[:1] == b"{" and (b'"log_history"' in text or b'"global_step"' in text)

    def read(self, files: list[Path], run_dir: Path) -> SourceLog:
        """One state file: its history as the one segment, its plan and its other fields. Raises `InputError` when
        it is not a readable state (a save cut short, a file that is not JSON)."""
        path = files[0]
        state = _load(path, run_dir)
        plan, ignored = numbers_only(state, (*PLAN_FIELDS, "global_step"))
        fields = {k: v for k, v in state.items() if k != "log_history" and k not in ignored}
        history = [normalised(e) for e in state["log_history"] if isinstance(e, dict) and _whole(e.get("step"))]
        return self.log(
            files[:1],
            run_dir,
            segments=[history],
            plan={k: v for k, v in plan.items() if k != "global_step"},
            fields=fields,
            records=len(state["log_history"]),
            ignored=ignored,
        )


def _load(path: Path, run_dir: Path) -> dict[str, Any]:
    try:
        with open_regular(path.absolute(), run_dir, MAX_LOG_BYTES) as f:
            state = json.load(f)
    except RecursionError:
        raise InputError(f"{path}: not a readable trainer state (nested too deeply)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not a readable trainer state (not JSON: {exc})") from None
    if not isinstance(state, dict) or not isinstance(state.get("log_history"), list):
        raise InputError(f"{path}: not a trainer state (no log_history list)")
    return state


def _whole(value: Any) -> bool:
    """A step as the Trainer writes it: an integer (a bool, a float or text is no step: the entry is left out)."""
    return isinstance(value, int) and not isinstance(value, bool)
