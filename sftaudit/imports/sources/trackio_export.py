"""A Trackio project's Parquet export (``<project>.parquet``, with ``<project>_configs.parquet`` beside it), what
trackio writes to sync a project to a Hugging Face dataset or bucket. Read with pyarrow, no trackio needed.

The metrics table's columns (``id``, ``run_id``, ``timestamp``, ``run_name``, ``step``, ``log_id``, ``space_id``)
then one float64 column per logged key (NaN restored, null where a log call did not log the key); the configs table
has one row per run, one column per config key. Rows are read as the database's (`trackio_db`): keyed on
``train/global_step``, each run one start in the order it first logged, the run config the plan.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...core.safe_io import open_regular
from ...errors import InputError
from ..logs import MAX_LOG_BYTES
from ..source import PLAN_KEYS, LogSource, SourceLog, numbers_only
from .trackio_db import NO_GRAD_NORM
from .wandb_export import parquet_columns
from .wandb_offline import entries

# The table's own columns: every row has them; the logged keys are the others.
OWN_COLUMNS = {"id", "run_id", "timestamp", "run_name", "step", "log_id", "space_id"}
CONFIGS_SUFFIX = "_configs.parquet"


class TrackioExport(LogSource):
    name = "trackio-export"
    provenance = "imported logs: Trackio Parquet export"
    patterns = ("**/*.parquet",)
    what = "the Trackio Parquet export"
    rank = 58
    no_grad_norm = NO_GRAD_NORM

    def detect(self, path: Path) -> bool:
        """A Parquet file with the metrics table's ``id``, ``run_name``, ``step`` and ``timestamp`` columns."""
        names = parquet_columns(path)
        return names is not None and {"id", "run_name", "step", "timestamp"} <= names and "_step" not in names

    def read(self, files: list[Path], run_dir: Path) -> SourceLog:
        runs: dict[str, list[dict[str, Any]]] = {}
        skipped, records, config = [], 0, {}
        for path in files:
            table = _table(path, run_dir)
            if table is None:
                skipped.append({"file": str(path.relative_to(run_dir)), "lines": 1, "of": 1})
                continue
            run = "run_id" if "run_id" in table.column_names else "run_name"
            for row in sorted(table.to_pylist(), key=lambda r: (r.get("id") is None, r.get("id") or 0)):
                records += 1
                logged = {k: v for k, v in row.items() if k not in OWN_COLUMNS}
                runs.setdefault(str(row.get(run)), []).append({**logged, "_step": row.get("step")})
            configs = _table(path.with_name(path.name.removesuffix(".parquet") + CONFIGS_SUFFIX), run_dir)
            for row in configs.to_pylist() if configs is not None else []:
                config |= {k: v for k, v in row.items() if not k.startswith("_") and k not in OWN_COLUMNS}
        segments = [seg for rows in runs.values() if (seg := entries(rows))]
        config.pop("created_at", None)
        plan, ignored = numbers_only(
            {**config, "train_batch_size": config.get("per_device_train_batch_size")}, PLAN_KEYS
        )
        return self.log(
            files,
            run_dir,
            segments=segments,
            plan=plan,
            identity={"config": config, "model_config": None, "runs": list(runs)},
            skipped=skipped,
            records=records,
            ignored=ignored,
        )


def _table(path: Path, run_dir: Path):
    """A Parquet table of the run (None: absent or unreadable)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not path.is_file():
        return None
    try:
        with open_regular(path.absolute(), run_dir, MAX_LOG_BYTES) as f:
            return pq.read_table(f)
    except (pa.ArrowException, OSError) as exc:
        if isinstance(exc, InputError):
            raise
        return None
