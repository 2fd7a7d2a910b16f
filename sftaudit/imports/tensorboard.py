"""TensorBoard event files of a Trainer run (the optional extra ``sftaudit[tensorboard]``).

The Trainer's ``TensorBoardCallback`` writes, at every log, ``add_scalar(tag, value, global_step)``
with the log's keys renamed by ``rewrite_logs``: ``eval_x`` -> ``eval/x``, everything else ->
``train/x`` (``train/loss``, ``train/grad_norm``, ``train/learning_rate``, ``train/epoch``, and
at the end ``train/train_loss``, ``train/train_runtime``...). Every (re)start opens a new
``events.out.tfevents.*`` file (under ``output_dir/runs/<time>_<host>/`` by default), so a resumed
run's files overlap: the earlier file's steps from the restart on are the branch the resume
abandoned, which the resumed ``trainer_state.json`` no longer holds.

Read with tensorboard's own per-file loader (``EventFileLoader``: every event, no sampling and no
purging of "orphaned" steps, which ``EventAccumulator`` would drop by default), one file per restart
in the order they were started. Values are float32, as the callback stored them. A Git LFS pointer in
place of an event file (a clone without git-lfs) holds no events: it is left out, and the import names it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .logs import is_lfs_pointer, normalised

EVENTS_GLOB = "events.out.tfevents.*"
EVENTS_SOURCE = "imported logs: TensorBoard event files"
# The end-of-training log's keys (`Trainer._finalize_training` + `speed_metrics`): a summary, not a step.
SUMMARY = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss"}
# The callback's tag group for `trainer.predict`'s metrics (`test_*` keys).
PREDICTION_GROUPS = {"test"}


def event_files(run_dir: Path) -> list[Path]:
    return sorted(
        p for p in run_dir.rglob(EVENTS_GLOB) if p.is_file() and "sftaudit" not in p.relative_to(run_dir).parts
    )


def event_segments(run_dir: Path) -> tuple[list[list[dict[str, Any]]], dict[str, Any]]:
    """One list of log-history entries per start of the run, in start order, and the callback's text summaries
    by name (``args``: ``max_steps``, ``num_train_epochs``, ``logging_steps``...; ``model_config``); ([], {}) when
    there are no event files or tensorboard is not installed. A file whose steps do not go back from the files
    before it continues their start (a final evaluation, the hparams plugin, open writers of their own); one
    that goes back is a restart (a new process, or ``trainer.train(resume_from_checkpoint=...)`` again in the
    same notebook)."""
    files = [p for p in event_files(run_dir) if not is_lfs_pointer(p)]
    if not files:
        return [], {}
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
        from tensorboard.util import tensor_util
    except ImportError:
        return [], {}
    per_file = []
    texts: dict[str, dict[str, Any]] = {}
    for path in files:
        entries: dict[tuple[int, str], dict[str, Any]] = {}
        first_time = None
        for event in EventFileLoader(str(path)).Load():
            first_time = event.wall_time if first_time is None else first_time
            for value in event.summary.value:
                plugin = value.metadata.plugin_data.plugin_name
                if plugin == "text" and value.tag.partition("/")[0] in ("args", "model_config"):
                    texts[value.tag.partition("/")[0]] = _json_text(tensor_util.make_ndarray(value.tensor)) or {}
                if plugin != "scalars":
                    continue  # text (the run's args) and anything else that is not a logged number
                # An untagged scalar ("loss", "lr": a SummaryWriter of one's own) is a training log's, and so is
                # one in a group of its own ("rewards/chosen" written directly), under its whole tag.
                group, _, key = value.tag.partition("/") if "/" in value.tag else ("train", "", value.tag)
                if group == "eval":
                    kind, key = "eval", f"eval_{key}"
                elif group == "train":
                    kind = "summary" if key in SUMMARY else "train"
                elif group in PREDICTION_GROUPS:
                    continue  # `trainer.predict` after training: no training step
                else:
                    kind, key = "train", value.tag
                entry = entries.setdefault((event.step, kind), {"step": event.step})
                entry[key] = float(tensor_util.make_ndarray(value.tensor).item())
        if entries:
            per_file.append((first_time, entries))
    starts: list[dict[tuple[int, str], dict[str, Any]]] = []
    for _, entries in sorted(per_file, key=lambda f: f[0]):
        if starts and min(k[0] for k in entries) >= max(k[0] for k in starts[-1]):
            for key, entry in entries.items():
                starts[-1].setdefault(key, {}).update(entry)
        else:
            starts.append(dict(entries))
    return [sorted((normalised(e) for e in s.values()), key=lambda e: e["step"]) for s in starts], texts


def _json_text(array: Any) -> dict[str, Any] | None:
    try:
        text = array.reshape(-1)[0]
        value = json.loads(text.decode("utf-8") if isinstance(text, bytes) else str(text))
    except (ValueError, IndexError, UnicodeDecodeError, AttributeError):
        return None
    return value if isinstance(value, dict) else None
