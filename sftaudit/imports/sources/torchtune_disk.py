"""torchtune's ``DiskLogger``: ``<output_dir>/logs/log_<unix time>.txt``, with the recipe's config saved as
``<output_dir>/torchtune_config.yaml``. Plain text, read without torchtune.

``log_dict(payload, step)`` writes one line ``Step <step> | key:value key:value `` (values as ``str()``: ``nan``,
``inf``); recipes log ``loss``, ``lr``, ``tokens_per_second_per_gpu``, ``grad_norm`` (with ``clip_grad_norm`` only)
and peak memory at ``global_step`` counted from 1 after each update, every ``log_every_n_steps``; recipes with
validation add ``Step <s> | val_loss:<v>`` lines. So ``Step`` is the Trainer's step. The config gives the plan:
``epochs``, ``optimizer.lr``, ``lr_scheduler.num_warmup_steps``, ``batch_size``, ``log_every_n_steps``,
``save_every_n_steps``, ``run_val_every_n_steps``. ``max_steps_per_epoch`` is only a cap on each epoch (a shorter
dataset ends it sooner) and the dataset's length is logged nowhere: the planned length is unknown. Every log file is
one recipe run (a resume opens a new one): several are read in the order of the time in their names.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ...core.safe_io import UnsafeFile, open_regular, read_text
from ..logs import MAX_LOG_BYTES, normalised, number
from ..source import PLAN_KEYS, LogSource, SourceLog, numbers_only

LINE = re.compile(rb"Step (\d{1,18}) \| ?(.*)")
PAIR = re.compile(r"(\S+?):(\S+)")
# A line longer than this is no DiskLogger line (a few hundred bytes): skipped, unread.
MAX_LINE_BYTES = 1 << 16
MAX_CONFIG_BYTES = 1 << 20
CONFIG = "torchtune_config.yaml"
KEYS = {"lr": "learning_rate", "val_loss": "eval_loss"}
NO_PLANNED_LENGTH = (
    "torchtune records no planned length: max_steps_per_epoch is only a cap on each epoch, and the dataset's "
    "length is not logged"
)
NO_GRAD_NORM = "the torchtune log has no grad_norm (the recipe logs it only with clip_grad_norm set)"


class TorchtuneDiskLog(LogSource):
    name = "torchtune"
    provenance = "imported logs: torchtune DiskLogger (log_*.txt)"
    patterns = ("**/log_*.txt",)
    what = "the torchtune log files"
    rank = 60
    no_grad_norm = NO_GRAD_NORM

    def detect(self, path: Path) -> bool:
        """A first line ``Step N | key:value ...``."""
        with open_regular(path) as f:
            first = f.readline(MAX_LINE_BYTES)
        match = LINE.fullmatch(first.rstrip(b"\r\n"))
        return match is not None and PAIR.search(match.group(2).decode("utf-8", errors="replace")) is not None

    def read(self, files: list[Path], run_dir: Path) -> SourceLog:
        segments, skipped, records = [], [], 0
        for path in sorted(files, key=_started):
            entries, bad, count = _entries(path, run_dir)
            records += count
            if bad:
                skipped.append({"file": str(path.relative_to(run_dir)), "lines": bad, "of": count})
            if entries:
                segments.append(entries)
        config = _config(sorted(files, key=_started)[-1], run_dir) if files else {}
        plan, ignored = numbers_only(_plan(config), PLAN_KEYS)
        lacks = {"planned_length": NO_PLANNED_LENGTH}
        return self.log(
            files,
            run_dir,
            segments=segments,
            plan=plan,
            identity={"config": config, "model_config": None},
            lacks=lacks,
            skipped=skipped,
            records=records,
            ignored=ignored,
        )


def _entries(path: Path, run_dir: Path) -> tuple[list[dict[str, Any]], int, int]:
    """The file's lines as log-history entries, the lines that are not one (a torn last line not counted), and the
    lines read. A line's numbers are one entry: a validation line is an entry of its own, as in a log history."""
    out, bad, count, last_bad = [], 0, 0, False
    with open_regular(path.absolute(), run_dir, MAX_LOG_BYTES) as f:
        while line := f.readline(MAX_LINE_BYTES + 1):
            too_long = len(line) > MAX_LINE_BYTES
            while too_long and line and not line.endswith(b"\n"):  # the rest of an overlong line, unread
                line = f.readline(MAX_LINE_BYTES)
            if not too_long and not line.strip():
                continue
            count += 1
            match = None if too_long else LINE.fullmatch(line.rstrip(b"\r\n"))
            values = {}
            if match:
                for key, text in PAIR.findall(match.group(2).decode("utf-8", errors="replace")):
                    value = number(text.removeprefix("tensor(").removesuffix(")"))
                    if value is not None:
                        values[KEYS.get(key, key)] = value
            last_bad = not values
            if last_bad:
                bad += 1
            else:
                out.append({"step": int(match.group(1))} | normalised(values))
    return sorted(out, key=lambda e: e["step"]), bad - last_bad, count


def _config(log: Path, run_dir: Path) -> dict[str, Any]:
    """The recipe's saved config: beside the logs folder (``output_dir``), or beside the log."""
    import yaml  # here, not at module level: the log-source registry imports every source, most runs have no YAML

    for folder in (log.parent.parent, log.parent):
        try:
            loaded = yaml.safe_load(read_text((folder / CONFIG).absolute(), run_dir, MAX_CONFIG_BYTES))
        except (UnsafeFile, yaml.YAMLError, RecursionError):
            continue
        if isinstance(loaded, dict):
            return loaded
    return {}


def _plan(config: dict[str, Any]) -> dict[str, Any]:
    def section(name: str) -> dict[str, Any]:
        value = config.get(name)
        return value if isinstance(value, dict) else {}

    return {
        "num_train_epochs": config.get("epochs"),
        "learning_rate": section("optimizer").get("lr"),
        "warmup_steps": section("lr_scheduler").get("num_warmup_steps"),
        "train_batch_size": config.get("batch_size"),
        "logging_steps": config.get("log_every_n_steps"),
        "save_steps": config.get("save_every_n_steps"),
        "eval_steps": config.get("run_val_every_n_steps"),
    }


def _started(path: Path) -> tuple[int, str]:
    """DiskLogger names its file after the unix time it opened it."""
    match = re.fullmatch(r"log_(\d+)\.txt", path.name)
    return (int(match.group(1)) if match else 0, str(path))
