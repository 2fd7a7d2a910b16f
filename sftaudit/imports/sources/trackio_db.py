"""A Trackio project database, ``<TRACKIO_DIR>/<project>.db``, read with the stdlib's sqlite3 (read-only), without
trackio.

Tables read: ``metrics`` (``run_name``, ``step``, ``metrics``: one JSON object per ``trackio.log`` call, stored as
bytes; ``run_id`` from trackio 0.2x on) and ``configs`` (``run_name``, ``config`` JSON). NaN and inf are the strings
``"NaN"``, ``"Infinity"``, ``"-Infinity"``. The Trainer's ``TrackioCallback`` logs as its W&B callback does:
``rewrite_logs(logs)`` (``train/loss``, ``eval/loss``, ...) plus ``train/global_step``, with no step of its own, so
trackio's ``step`` counts log calls and the series is keyed on ``train/global_step`` (`wandb_offline.entries`). The
run config (``args.to_dict()`` and the model config) is the plan. Each run of the project is one start, read in the
order they first logged. A write-ahead log beside the database (a run still logging) is read too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...errors import InputError
from ..source import PLAN_KEYS, LogSource, SourceLog, numbers_only
from .mlflow_sqlite import MLFLOW_TABLES, connected, tables
from .wandb_offline import MAX_VALUE_BYTES, entries

TRACKIO_TABLES = {"metrics", "configs"}
NO_GRAD_NORM = "the Trackio run logged no grad_norm (an older Trainer, or max_grad_norm 0)"


class TrackioDatabase(LogSource):
    name = "trackio"
    provenance = "imported logs: Trackio project database"
    patterns = ("**/*.db",)
    what = "the Trackio database"
    rank = 55
    no_grad_norm = NO_GRAD_NORM

    def detect(self, path: Path) -> bool:
        """An SQLite database with trackio's ``metrics`` and ``configs`` tables (and not MLflow's)."""
        names = tables(path)
        return TRACKIO_TABLES <= names and not MLFLOW_TABLES <= names

    def read(self, files: list[Path], run_dir: Path) -> SourceLog:
        runs: dict[str, dict[str, Any]] = {}
        skipped, records = [], 0
        for path in files:
            bad, read = 0, 0
            with connected(path, run_dir) as db:
                columns = {row[1] for row in db.execute("PRAGMA table_info(metrics)")}
                if not {"run_name", "step", "metrics"} <= columns:
                    raise InputError(f"{path}: not a Trackio database (no run_name, step and metrics columns)")
                run = "run_id" if "run_id" in columns else "run_name"
                for run_key, name, step, text in db.execute(
                    f"SELECT {run}, run_name, step, CAST(metrics AS TEXT) FROM metrics ORDER BY id"
                ):
                    read += 1
                    row = _json(text)
                    if row is None:
                        bad += 1
                        continue
                    found = runs.setdefault(str(run_key), {"name": str(name), "rows": [], "config": {}})
                    found["rows"].append({**row, "_step": step})
                for name, text in db.execute("SELECT run_name, CAST(config AS TEXT) FROM configs"):
                    config = _json(text) or {}
                    for found in runs.values():
                        if found["name"] == name:
                            found["config"] = {k: v for k, v in config.items() if not k.startswith("_")}
            records += read
            if bad:
                skipped.append({"file": str(path.relative_to(run_dir)), "lines": bad, "of": read})
        segments = [seg for r in runs.values() if (seg := entries(r["rows"]))]
        config = {k: v for r in runs.values() for k, v in r["config"].items()}
        plan, ignored = numbers_only(
            {**config, "train_batch_size": config.get("per_device_train_batch_size")}, PLAN_KEYS
        )
        return self.log(
            files,
            run_dir,
            segments=segments,
            plan=plan,
            identity={"config": config, "model_config": None, "runs": [r["name"] for r in runs.values()]},
            skipped=skipped,
            records=records,
            ignored=ignored,
        )


def _json(text: Any) -> dict[str, Any] | None:
    if not isinstance(text, str) or len(text) > MAX_VALUE_BYTES:
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None
