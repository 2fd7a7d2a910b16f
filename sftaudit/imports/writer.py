"""The one writer of an imported run's artifacts: whatever source the logs came from, the same
``RUN_DIR/sftaudit/rank-0/*.jsonl`` files the shim writes, but for the kinds declared columnar for an import
(``steps`` and ``metrics``: a record per training log and per logged number, millions for a per-step log of a long
run), written as ``<kind>.parquet``, a typed column per field an import writes.

The logged series are built a column at a time and written by Polars' Parquet writer (NaN and infinities as the
doubles they are); the few other records with the json module.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from itertools import compress, repeat
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np

from ..core.artifacts import DATABASE_FILE, artifact_root, rank_dir
from ..schema.records import RECORDS, STEP_METRICS
from .logs import number


def series(segs: Any, entries: list[dict[str, Any]], training: np.ndarray, keys: set[str]):
    """The ``steps`` and ``metrics`` records of the logged `entries` (`segs`: each one's segment; `training`: which
    are training logs, `logs.training_logs`; `keys`: the keys they hold), as polars frames
    built a column at a time (not pyarrow's conversion of lists, which imports pandas: a third of a second of a
    small audit): a step per training log (an entry with a loss that is not the end-of-training summary: its loss,
    learning rate and gradient norm, None where not a number), a metric per number an entry holds under any key but
    ``step`` and a training log's `STEP_METRICS` (records of one name keep the entries' order). A key's values are gathered once, in C (`map`), and taken
    as they are when all are floats or absent, as a per-step log's are (the steps' columns then the training logs'
    rows of the metrics' own); looked at one by one otherwise."""
    import polars as pl

    names = sorted(keys - {"step"})
    # the name once, each record its index (a million records of eight names hold eight strings)
    kind = pl.Enum(names)
    logs = pl.DataFrame(
        [
            pl.Series("seg", segs, pl.Int32),
            pl.Series("step", list(map(itemgetter("step"), entries)), pl.Int64),
        ]
    )
    values = {name: _values(entries, name) for name in names}
    clean = {name: _clean(v) for name, v in values.items()}
    columns = {name: _floats(values[name], None, clean[name]) for name in names}
    mask = pl.Series(training)
    parts = [
        logs.with_columns(name=pl.lit(name, kind), value=columns[name])
        .filter(~mask if name in STEP_METRICS else True)  # a training log's own: in its steps record
        .drop_nulls("value")
        for name in names
    ]
    metrics = pl.concat(parts) if parts else logs.with_columns(name=pl.lit(None, kind), value=pl.lit(None, pl.Float64))

    def logged(key: str):
        """The training logs' `key`: the metric's column where every value was a float or absent, else each value
        made a number by `number` (text spelling one)."""
        if key not in values:
            return pl.lit(None, pl.Float64)
        if clean[key]:
            return columns[key].filter(mask)
        kept = list(compress(values[key], training))
        return _floats(kept, number, _clean(kept))

    steps = logs.filter(mask).with_columns(
        loss=logged("loss"), lr=logged("learning_rate"), grad_norm=logged("grad_norm")
    )
    return steps, metrics


def _values(entries: list[dict[str, Any]], key: str) -> list[Any]:
    return list(map(dict.get, entries, repeat(key)))


def _clean(values: list[Any]) -> bool:
    return set(map(type, values)) <= {float, type(None)}


def _floats(values: list[Any], other: Callable[[Any], float | None] | None, clean: bool):
    """`values` as a float column: a float as it is, None as null, any other value as `other` makes it (null
    without `other`); `clean`: whether all are floats or None (`_clean`)."""
    import polars as pl

    if not clean:
        values = [v if type(v) is float else other(v) if other else None for v in values]
    return pl.Series(values, dtype=pl.Float64)


def write(run_dir: Path, records: dict[str, list[dict[str, Any]]], tables: dict[str, Any]) -> None:
    """Replace an earlier import's files (and its database: ingest is incremental by file offset) with `records`
    (lists of records, as JSONL) and `tables` (frames of records of the kinds written as Parquet,
    `COLUMNAR_IMPORT_KINDS`); the records `sftaudit probe` added are kept."""
    folder = rank_dir(run_dir, 0)
    for kind in [*records, *tables]:
        for suffix in ("jsonl", "parquet"):
            (folder / f"{kind}.{suffix}").unlink(missing_ok=True)  # probe records (`sftaudit probe`) stay
    (artifact_root(run_dir) / DATABASE_FILE).unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    for kind, rows in records.items():
        (folder / f"{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    for kind, table in tables.items():
        _write_columnar(folder, kind, table)


_POLARS_TYPES = {"INTEGER": "Int32", "BIGINT": "Int64", "DOUBLE": "Float64"}


def _write_columnar(folder: Path, kind: str, table: Any) -> None:
    """`table` as ``<kind>.parquet``: the fields an import writes in their order, each of its declared type (text as it is:
    a name column of a few names is an Enum, written as dictionary-encoded text without a string per record),
    written to a hidden name and renamed (a reader never sees half a file)."""
    import polars as pl

    columns = [
        pl.col(f.name).cast(getattr(pl, _POLARS_TYPES[f.type])) if f.type in _POLARS_TYPES else pl.col(f.name)
        for f in RECORDS[kind].columnar_fields()
    ]
    hidden = folder / f".{kind}.parquet.tmp"
    table.select(columns).write_parquet(hidden, statistics=False)
    hidden.replace(folder / f"{kind}.parquet")
