"""An MLflow file store (``mlruns/``, ``MlflowClient("file:...")``): plain text, read without mlflow.

One folder per run, ``mlruns/<experiment id>/<run id>/``: ``meta.yaml`` (run_id, run_name, status, start_time in
ms, lifecycle_stage), ``metrics/<key>`` (a ``/`` in a key makes subfolders) with one line ``<timestamp ms> <value>
<step>`` per logged value, in log order (``nan``, ``inf`` as text), ``params/<key>`` (the value as text), ``tags/``.
The Trainer's ``MLflowCallback`` logs the raw log keys (``loss``, ``learning_rate``, ``grad_norm``, ``epoch``,
``eval_loss``, ...) at ``step=state.global_step``: the MLflow step is the optimizer step. Its params are
``args.to_dict()`` and the model config, as text: the plan. Each run found is one start, read in the order they
started (a resumed Trainer run without ``MLFLOW_RUN_ID`` starts a new MLflow run); a deleted run is passed over.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ...core.safe_io import MAX_WHOLE_FILE_BYTES, UnsafeFile, read_text
from ..logs import is_step, number
from ..source import PLAN_KEYS, LogSource, SourceLog, numbers_only
from .tensorboard import SUMMARY

# A run's meta.yaml is a few hundred bytes; a params or tags file holds one value (MLflow caps them at 6000 chars).
MAX_META_BYTES = 1 << 20
# More metric or param files than this in one run are no Trainer run's (a few dozen keys).
MAX_KEYS = 4096
NO_GRAD_NORM = "the MLflow run logged no grad_norm (an older Trainer, or max_grad_norm 0)"
# MLflow's run status codes (file store) and names (database).
STATUS = {1: "RUNNING", 2: "SCHEDULED", 3: "FINISHED", 4: "FAILED", 5: "KILLED"}


class MlflowFileStore(LogSource):
    name = "mlflow"
    provenance = "imported logs: MLflow file store (mlruns/)"
    patterns = ("**/meta.yaml",)
    what = "the MLflow runs (mlruns/)"
    rank = 40
    no_grad_norm = NO_GRAD_NORM

    def detect(self, path: Path) -> bool:
        """A run's ``meta.yaml`` (``run_id`` and ``experiment_id``) beside a ``metrics/`` folder."""
        meta = _meta(path)
        return meta is not None and "run_id" in meta and "experiment_id" in meta and (path.parent / "metrics").is_dir()

    def read(self, files: list[Path], run_dir: Path) -> SourceLog:
        runs, skipped, records = [], [], 0
        for path in files:
            meta = _meta(path.absolute(), run_dir) or {}
            if meta.get("lifecycle_stage") == "deleted":
                continue
            values, bad, count = _metrics(path.parent, run_dir)
            records += count
            skipped += bad
            runs.append(
                {
                    "run_id": str(meta.get("run_id")),
                    "name": str(meta.get("run_name")),
                    "status": STATUS.get(meta.get("status"), meta.get("status")),
                    "started": meta.get("start_time") if is_step(meta.get("start_time")) else 0,
                    "values": values,
                    "params": _texts(path.parent / "params", run_dir),
                }
            )
        return mlflow_log(self, files, run_dir, runs, skipped, records)


def mlflow_log(
    source: LogSource, files: list[Path], run_dir: Path, runs: list[dict], skipped: list[dict], records: int
) -> SourceLog:
    """What both MLflow stores give: one segment per run in start order, the params as the plan."""
    runs.sort(key=lambda r: r["started"])
    segments = [seg for r in runs if (seg := entries(r["values"]))]
    params = {k: v for r in runs for k, v in r["params"].items()}
    parsed = {k: _param(v) for k, v in params.items()}
    plan, ignored = numbers_only({**parsed, "train_batch_size": parsed.get("per_device_train_batch_size")}, PLAN_KEYS)
    return source.log(
        files,
        run_dir,
        segments=segments,
        plan=plan,
        identity={
            "config": params,
            "model_config": None,
            "runs": [{k: r[k] for k in ("run_id", "name", "status", "started")} for r in runs],
        },
        skipped=skipped,
        records=records,
        ignored=ignored,
    )


def entries(values: list[tuple[str, float, int]]) -> list[dict[str, Any]]:
    """Logged ``(key, value, step)`` in log order as log-history entries: per step, the training keys in one entry
    and the ``eval_*`` keys in another (as the Trainer logs them); the end-of-training summary and ``trainer.predict``'s
    ``test_*`` are no step. A key logged twice at one step keeps its last value."""
    train: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    for key, value, step in values:
        if key in SUMMARY or key.startswith(("test_", "test/")) or key == "step":
            continue
        key = f"eval_{key[5:]}" if key.startswith("eval/") else key
        kind = evals if key.startswith("eval_") else train
        kind.setdefault(step, {"step": step})[key] = value
    for step, entry in evals.items():  # the epoch logged with an eval belongs to it too
        if "epoch" in train.get(step, {}) and len(train[step]) == 2:
            entry["epoch"] = train.pop(step)["epoch"]
    return sorted([*train.values(), *evals.values()], key=lambda e: (e["step"], any(k[:5] == "eval_" for k in e)))


def _metrics(run: Path, run_dir: Path) -> tuple[list[tuple[str, float, int]], list[dict[str, Any]], int]:
    """Every metric file of a run: its ``(key, value, step)`` lines in log order, the files with lines that are not
    one (``{"file", "lines", "of"}``; a torn last line is a write cut short, not counted), the lines read."""
    folder = run / "metrics"
    found: list[tuple[int, str, float, int]] = []  # (timestamp, key, value, step)
    skipped, records = [], 0
    for path in sorted(folder.rglob("*"))[:MAX_KEYS]:
        if not path.is_file() or path.is_symlink():
            continue  # a folder of a key with slashes, or a link no run holds
        key = path.relative_to(folder).as_posix()
        text = read_text(path.absolute(), run_dir)  # a file too large: refused in one line
        lines = text.splitlines()
        bad = 0
        for n, line in enumerate(lines):
            parts = line.split()
            value = number(parts[1]) if len(parts) == 3 else None
            if value is None or not parts[0].isdigit() or not _is_int(parts[2]):
                bad += n < len(lines) - 1 or text.endswith("\n")
                continue
            found.append((int(parts[0]), key, value, int(parts[2])))
        records += len(lines)
        if bad:
            skipped.append({"file": str(path.relative_to(run_dir)), "lines": bad, "of": len(lines)})
    found.sort(key=lambda x: x[0])  # stable: a file's lines stay in their order
    return [(k, v, s) for _, k, v, s in found], skipped, records


def _is_int(text: str) -> bool:
    return text.lstrip("-").isdigit() and is_step(int(text))


def _param(text: str) -> Any:
    """A param as the Trainer's value: MLflow keeps ``str(value)`` ("60", "2e-05", "-1", "None")."""
    try:
        return int(text)
    except ValueError:
        value = number(text)
        return value if value is not None and math.isfinite(value) else text


def _texts(folder: Path, run_dir: Path) -> dict[str, str]:
    """A run's params (or tags): one small text file per key, a ``/`` in a key a subfolder."""
    out = {}
    if not folder.is_dir():
        return out
    for path in sorted(folder.rglob("*"))[:MAX_KEYS]:
        try:
            out[path.relative_to(folder).as_posix()] = read_text(path.absolute(), run_dir, MAX_META_BYTES).strip()
        except UnsafeFile:
            continue
    return out


def _meta(path: Path, run_dir: Path | None = None) -> dict[str, Any] | None:
    import yaml  # here, not at module level: the log-source registry imports every source, most runs have no YAML

    try:
        meta = yaml.safe_load(read_text(path, run_dir, min(MAX_META_BYTES, MAX_WHOLE_FILE_BYTES)))
    except (UnsafeFile, yaml.YAMLError, RecursionError):
        return None
    return meta if isinstance(meta, dict) else None
