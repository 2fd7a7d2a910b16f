"""The one writer of an imported run's artifacts: whatever source the logs came from, the same
``RUN_DIR/sftaudit/rank-0/*.jsonl`` files the shim writes.

The logged series (a record per training log in ``steps``, a record per logged number in ``metrics``: millions
for a per-step log of a long run) are built a column at a time and written by DuckDB's JSON writer (``NaN`` and
``Infinity`` as Python's json writes them, every double exactly); the few other records with the json module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..core.artifacts import DATABASE_FILE, artifact_root, rank_dir
from .logs import number

# Keys of the end-of-training log entry: a summary of the run, not a training step.
SUMMARY_KEYS = ("train_runtime", "train_loss")
SERIES = ("steps", "metrics")


def series(logged: list[tuple[int, dict[str, Any]]]):
    """The ``steps`` and ``metrics`` records of the logged entries, each given with its segment, as Arrow tables:
    a step per training log (an entry with a loss that is not the end-of-training summary: its loss, learning rate
    and gradient norm, None where not a number), a metric per number an entry holds under any key but ``step``
    (records of one name keep the entries' order)."""
    import pyarrow as pa

    segs = pa.array([seg for seg, _ in logged], pa.int32())
    entries = [e for _, e in logged]
    step_ids = pa.array([e["step"] for e in entries], pa.int64())
    names = sorted(set().union(*entries) - {"step"}) if entries else []
    names_array = pa.array(names, pa.string())
    parts = []
    for index, name in enumerate(names):
        values = pa.array([v if type(v) is float else None for v in (e.get(name) for e in entries)], pa.float64())
        valid = values.is_valid()
        count = len(values) - values.null_count
        parts.append(
            pa.table(
                {
                    "seg": segs.filter(valid),
                    "step": step_ids.filter(valid),
                    # the name once, each record its index (a million records of eight names hold eight strings)
                    "name": pa.DictionaryArray.from_arrays(pa.repeat(pa.scalar(index, pa.int32()), count), names_array),
                    "value": values.filter(valid),
                }
            )
        )
    metrics = pa.concat_tables(parts) if parts else _empty_metrics()
    summary, last = SUMMARY_KEYS
    training = pa.array(["loss" in e and summary not in e and last not in e for e in entries], pa.bool_())
    chosen = [e for e, keep in zip(entries, training.to_pylist()) if keep]

    def column(key: str):
        return pa.array([v if type(v) is float else number(v) for v in (e.get(key) for e in chosen)], pa.float64())

    steps = pa.table(
        {
            "seg": segs.filter(training),
            "step": step_ids.filter(training),
            "loss": column("loss"),
            "lr": column("learning_rate"),
            "grad_norm": column("grad_norm"),
        }
    )
    return steps, metrics


def _empty_metrics():
    import pyarrow as pa

    return pa.table(
        {
            "seg": pa.array([], pa.int32()),
            "step": pa.array([], pa.int64()),
            "name": pa.DictionaryArray.from_arrays(pa.array([], pa.int32()), pa.array([], pa.string())),
            "value": pa.array([], pa.float64()),
        }
    )


def write(run_dir: Path, records: dict[str, list[dict[str, Any]]], tables: dict[str, Any]) -> None:
    """Replace an earlier import's files (and its database: ingest is incremental by file offset) with `records`
    (lists of records) and `tables` (Arrow tables of records); the records `sftaudit probe` added are kept."""
    folder = rank_dir(run_dir, 0)
    for kind in [*records, *tables]:
        (folder / f"{kind}.jsonl").unlink(missing_ok=True)  # probe records (`sftaudit probe`) stay
    (artifact_root(run_dir) / DATABASE_FILE).unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    for kind, rows in records.items():
        (folder / f"{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    if tables:
        import duckdb

        con = duckdb.connect()
        try:
            # One thread writes the records in order as it reads them (no buffering to restore the order).
            con.execute("SET enable_progress_bar = false; SET threads = 1")
            for kind, table in tables.items():
                path = (folder / f"{kind}.jsonl").absolute()
                con.register("records", table)
                literal = str(path).replace("'", "''")
                con.execute(f"COPY records TO '{literal}' (FORMAT JSON)")
                con.unregister("records")
        finally:
            con.close()
