"""An MLflow database store (``mlflow.db``, ``MlflowClient("sqlite:///...")``), read with the stdlib's sqlite3,
without mlflow (whose client migrates a database it opens, and would downgrade pyarrow).

The database is opened read-only and immutable (``file:PATH?mode=ro&immutable=1``: nothing is written, no journal
is looked for), with its schema untrusted. Tables read: ``runs`` (run_uuid, name, status, start_time,
lifecycle_stage), ``params`` (key, value, run_uuid) and ``metrics`` (key, value, timestamp, step, is_nan,
run_uuid). MLflow stores a NaN as value 0.0 with ``is_nan`` set, and +/-inf as +/-1.7976931348623157e308 (the largest
double): both are turned back into what was logged. Steps, runs and the plan as in the file store (`mlflow_files`).
"""

from __future__ import annotations

import math
import shutil
import sqlite3
import sys
import tempfile
import urllib.parse
from pathlib import Path
from typing import Any

from ...core.safe_io import UnsafeFile, open_regular, regular_file
from ...errors import InputError
from ..logs import MAX_LOG_BYTES, is_step, number
from ..source import LogSource, SourceLog
from .mlflow_files import NO_GRAD_NORM, mlflow_log

SQLITE_MAGIC = b"SQLite format 3\x00"
# The tables that make a database MLflow's.
MLFLOW_TABLES = {"runs", "metrics", "params", "experiments"}


class MlflowDatabase(LogSource):
    name = "mlflow-db"
    provenance = "imported logs: MLflow database (mlflow.db)"
    patterns = ("**/*.db", "**/*.sqlite")
    what = "the MLflow database"
    rank = 45
    no_grad_norm = NO_GRAD_NORM

    def detect(self, path: Path) -> bool:
        """An SQLite database holding MLflow's tables."""
        return MLFLOW_TABLES <= tables(path)

    def read(self, files: list[Path], run_dir: Path) -> SourceLog:
        runs, records = [], 0
        for path in files:
            with connected(path, run_dir) as db:
                if not MLFLOW_TABLES <= _names(db):
                    raise InputError(f"{path}: not an MLflow database (no runs, metrics and params tables)")
                for run_uuid, name, status, started, stage in db.execute(
                    "SELECT run_uuid, name, status, start_time, lifecycle_stage FROM runs ORDER BY start_time"
                ):
                    if stage == "deleted":
                        continue
                    rows = db.execute(
                        "SELECT key, value, step, is_nan FROM metrics WHERE run_uuid = ? ORDER BY timestamp, step",
                        (run_uuid,),
                    ).fetchall()
                    records += len(rows)
                    params = db.execute("SELECT key, value FROM params WHERE run_uuid = ?", (run_uuid,)).fetchall()
                    runs.append(
                        {
                            "run_id": str(run_uuid),
                            "name": str(name),
                            "status": str(status),
                            "started": started if is_step(started) else 0,
                            "values": [v for row in rows if (v := _metric(*row)) is not None],
                            "params": {str(k): str(v) for k, v in params},
                        }
                    )
        return mlflow_log(self, files, run_dir, runs, [], records)


def _metric(key: Any, value: Any, step: Any, is_nan: Any) -> tuple[str, float, int] | None:
    if not isinstance(key, str) or not is_step(step):
        return None
    if is_nan:
        return key, math.nan, step
    value = number(value)
    if value is None:
        return None
    if abs(value) == sys.float_info.max:  # how MLflow's database stores +/-inf
        value = math.copysign(math.inf, value)
    return key, value, step


class connected:
    """A read-only connection to an SQLite file of the run (checked as a regular file inside it, of at most
    MAX_LOG_BYTES), with the database's own schema untrusted (no function it names runs). Opened immutable: nothing
    is written beside it. A write-ahead log beside it (``<db>-wal``: a tracker still running, or one that never
    checkpointed) holds the newest rows: then both are copied into a temporary folder and read there."""

    def __init__(self, path: Path, run_dir: Path | None = None):
        target = regular_file(path.absolute(), run_dir, MAX_LOG_BYTES)
        self.copy = None
        wal = path.with_name(path.name + "-wal")
        try:
            has_wal = regular_file(wal.absolute(), run_dir, MAX_LOG_BYTES).stat().st_size > 0
        except UnsafeFile:
            has_wal = False
        if has_wal:
            self.copy = tempfile.TemporaryDirectory(prefix="sftaudit-sqlite-")
            for source, name in ((target, "db"), (wal, "db-wal")):
                with (
                    open_regular(source.absolute(), run_dir, MAX_LOG_BYTES) as f,
                    open(Path(self.copy.name) / name, "wb") as out,
                ):
                    shutil.copyfileobj(f, out)
            uri = f"file:{urllib.parse.quote(self.copy.name)}/db?mode=ro"
        else:
            uri = f"file:{urllib.parse.quote(str(target))}?mode=ro&immutable=1"
        try:
            self.db = sqlite3.connect(uri, uri=True)
            self.db.execute("PRAGMA trusted_schema = OFF")
            self.db.execute("PRAGMA query_only = ON")
        except sqlite3.Error as exc:
            self._cleanup()
            raise InputError(f"{path}: not a readable SQLite database ({exc})") from None

    def __enter__(self) -> sqlite3.Connection:
        return self.db

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        self.db.close()
        self._cleanup()
        if isinstance(exc, sqlite3.Error):
            raise InputError(f"damaged SQLite database: {exc}") from None

    def _cleanup(self) -> None:
        if self.copy is not None:
            self.copy.cleanup()


def tables(path: Path) -> set[str]:
    """The table names of an SQLite file (empty: not one)."""
    with open_regular(path) as f:
        if f.read(len(SQLITE_MAGIC)) != SQLITE_MAGIC:
            return set()
    try:
        with connected(path) as db:
            return _names(db)
    except InputError:
        return set()


def _names(db: sqlite3.Connection) -> set[str]:
    return {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
