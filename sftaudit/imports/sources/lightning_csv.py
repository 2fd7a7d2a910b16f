"""PyTorch Lightning's ``CSVLogger``: ``lightning_logs/version_<N>/metrics.csv`` and ``hparams.yaml`` beside it
(``config.yaml`` too, for a LightningCLI run). Plain text, read without lightning.

``metrics.csv`` has a header of every key logged (sorted, with ``epoch`` and ``step``; the file is rewritten when a
new key appears), one row per ``log_metrics`` call, empty cells elsewhere, ``nan``/``inf`` as text. Lightning's
``step`` is the count of optimizer steps BEFORE the batch: the update the Trainer would call step s is row step
s - 1, and so are the ``LearningRateMonitor`` row before it (``lr-<Optimizer>``, the rate that update used) and a
validation run after it. So every row is read at its step + 1. The names are the module's own (``self.log``):
``train_loss``/``loss`` (or ``train_loss_step`` when also logged per epoch) is the loss, ``val_x`` is ``eval_x``,
``grad_2.0_norm_total`` (Lightning's ``grad_norm`` utility) or ``grad_norm`` the gradient norm; per-epoch aggregates
(``*_epoch``) are no step. The plan is the module's ``save_hyperparameters()`` (``learning_rate``/``lr``,
``warmup_steps``, ``max_steps``, ``max_epochs``, ``batch_size``), and the LightningCLI config's ``trainer`` section.
Each version folder is one ``fit``: several are read in version order.
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path
from typing import Any

from ...core.safe_io import UnsafeFile, open_regular, read_text
from ..logs import MAX_LOG_BYTES, number
from ..source import PLAN_KEYS, LogSource, SourceLog, numbers_only

# A header row longer than this is no CSVLogger's (a few dozen keys).
MAX_HEADER_BYTES = 1 << 16
MAX_YAML_BYTES = 1 << 20
# The module's own names for the Trainer's keys, the first found wins.
LOSS_KEYS = ("train_loss_step", "train_loss", "loss", "train/loss", "loss_step")
GRAD_NORM_KEYS = ("grad_norm", "grad_2.0_norm_total", "train/grad_norm")
NO_GRAD_NORM = "the Lightning run logged no gradient norm (Lightning logs none unless the module does)"
# save_hyperparameters() / LightningCLI names -> the Trainer's.
PLAN_NAMES = {
    "max_steps": "max_steps",
    "max_epochs": "num_train_epochs",
    "learning_rate": "learning_rate",
    "lr": "learning_rate",
    "warmup_steps": "warmup_steps",
    "batch_size": "train_batch_size",
    "log_every_n_steps": "logging_steps",
}


class LightningCsvLog(LogSource):
    name = "lightning"
    provenance = "imported logs: Lightning CSVLogger (metrics.csv)"
    patterns = ("**/metrics.csv",)
    what = "the Lightning metrics.csv files"
    rank = 50
    no_grad_norm = NO_GRAD_NORM

    def detect(self, path: Path) -> bool:
        """A CSV header with Lightning's ``step`` and ``epoch`` columns."""
        with open_regular(path) as f:
            header = f.readline(MAX_HEADER_BYTES).decode("utf-8", errors="replace").strip()
        names = header.split(",")
        return "step" in names and "epoch" in names

    def read(self, files: list[Path], run_dir: Path) -> SourceLog:
        segments, skipped, records, config = [], [], 0, {}
        for path in sorted(files, key=_version):
            rows, bad, count = _rows(path, run_dir)
            records += count
            if bad:
                skipped.append({"file": str(path.relative_to(run_dir)), "lines": bad, "of": count})
            if seg := entries(rows):
                segments.append(seg)
            config = _config(path.parent, run_dir) or config  # the newest fit's
        plan, ignored = numbers_only({PLAN_NAMES[k]: v for k, v in config.items() if k in PLAN_NAMES}, PLAN_KEYS)
        return self.log(
            files,
            run_dir,
            segments=segments,
            plan=plan,
            identity={"config": config, "model_config": None},
            skipped=skipped,
            records=records,
            ignored=ignored,
        )


def entries(rows: list[dict[str, str]]) -> list[dict[str, Any]]:
    """CSV rows as log-history entries at the Trainer's step (Lightning's + 1): per step, the training numbers (the
    LR monitor's row merged in) in one entry and the validation numbers in another. Lightning's ``epoch`` is the
    epoch's index, not the Trainer's fraction of epochs done: left out."""
    train: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    for row in rows:
        step = int(row["step"]) + 1
        for key, text in row.items():
            value = number(text) if text and key not in ("step", "epoch") else None
            if value is None:
                continue
            name, is_eval = _name(key)
            if not is_eval and key.endswith("_epoch"):
                continue  # a per-epoch aggregate of a training number
            (evals if is_eval else train).setdefault(step, {"step": step}).setdefault(name, value)
    return sorted([*train.values(), *evals.values()], key=lambda e: (e["step"], any(k[:5] == "eval_" for k in e)))


def _name(key: str) -> tuple[str, bool]:
    """A logged key's Trainer name, and whether it is a validation number."""
    if key in LOSS_KEYS:
        return "loss", False
    if key in GRAD_NORM_KEYS:
        return "grad_norm", False
    if key.startswith("lr-") and ("/" not in key or key.endswith("/pg1")):
        return "learning_rate", False
    for prefix in ("val_", "val/", "valid_", "validation_"):
        if key.startswith(prefix):
            return "eval_" + key[len(prefix) :].removesuffix("_epoch"), True
    return key, False


def _rows(path: Path, run_dir: Path) -> tuple[list[dict[str, str]], int, int]:
    """The file's rows with an integer step, how many rows were not one (a torn last row is a write cut short, not
    counted), and how many rows there were."""
    with open_regular(path.absolute(), run_dir, MAX_LOG_BYTES) as f:
        lines = io.TextIOWrapper(f, encoding="utf-8", errors="replace", newline="")
        reader = csv.reader(lines)
        try:
            header = next(reader)
        except (StopIteration, csv.Error):
            return [], 0, 0
        rows, bad, last_bad = [], 0, False
        while True:
            try:
                cells = next(reader)
            except StopIteration:
                break
            except csv.Error:  # a field over csv's limit, a NUL
                cells = None
            row = dict(zip(header, cells)) if cells is not None and len(cells) == len(header) else None
            last_bad = row is None or not re.fullmatch(r"\d{1,18}", row.get("step", ""))
            if last_bad:
                bad += 1
            else:
                rows.append(row)
    return rows, bad - last_bad, len(rows) + bad


def _config(version: Path, run_dir: Path) -> dict[str, Any]:
    """The version's hyperparameters (hparams.yaml), with a LightningCLI ``config.yaml``'s ``trainer`` section."""
    import yaml  # here, not at module level: the log-source registry imports every source, most runs have no YAML

    out: dict[str, Any] = {}
    for name in ("hparams.yaml", "config.yaml"):
        try:
            loaded = yaml.safe_load(read_text((version / name).absolute(), run_dir, MAX_YAML_BYTES))
        except (UnsafeFile, yaml.YAMLError, RecursionError):
            continue
        if isinstance(loaded, dict):
            trainer = loaded.get("trainer") if name == "config.yaml" else None
            out |= {str(k): v for k, v in (trainer if isinstance(trainer, dict) else loaded).items()}
    return out


def _version(path: Path) -> tuple[int, str]:
    match = re.fullmatch(r"version_(\d+)", path.parent.name)
    return (int(match.group(1)) if match else -1, str(path))
