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
in the order they were started. Values are float32, as the callback stored them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

EVENTS_GLOB = "events.out.tfevents.*"
EVENTS_SOURCE = "imported logs: TensorBoard event files"
# The end-of-training log's keys (`Trainer._finalize_training` + `speed_metrics`): a summary, not a step.
SUMMARY = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss"}


def event_files(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.rglob(EVENTS_GLOB) if p.is_file() and "sftaudit" not in p.relative_to(run_dir).parts)


def event_segments(run_dir: Path) -> list[list[dict[str, Any]]]:
    """One list of log-history entries per event file (a start of the run), in start order; [] when
    there are no event files or tensorboard is not installed."""
    files = event_files(run_dir)
    if not files:
        return []
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
        from tensorboard.util import tensor_util
    except ImportError:
        return []
    starts = []
    for path in files:
        entries: dict[tuple[int, str], dict[str, Any]] = {}
        first_time = None
        for event in EventFileLoader(str(path)).Load():
            first_time = event.wall_time if first_time is None else first_time
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name != "scalars":
                    continue  # text (the run's args) and anything else that is not a logged number
                group, _, key = value.tag.partition("/")
                if group == "eval":
                    kind, key = "eval", f"eval_{key}"
                elif group == "train":
                    kind = "summary" if key in SUMMARY else "train"
                else:
                    continue
                entry = entries.setdefault((event.step, kind), {"step": event.step})
                entry[key] = float(tensor_util.make_ndarray(value.tensor).item())
        if entries:
            starts.append((first_time, sorted(entries.values(), key=lambda e: e["step"])))
    return [entries for _, entries in sorted(starts, key=lambda s: s[0])]
