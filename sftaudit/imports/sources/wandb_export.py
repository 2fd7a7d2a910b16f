"""A W&B run's history as the server exports it: the ``run-<id>-history`` artifact (type ``wandb-history``), or
``Run.download_history_exports`` (``<entity>_<project>_<run id>_<n>.runhistory.parquet``). Read with pyarrow, no
wandb needed.

One Parquet file per partition, all of them one run: one row per ``log`` call, ``_step`` (W&B's count of log calls),
``_runtime`` and ``_timestamp``, then one column per logged key named exactly as logged (``train/loss`` keeps its
slash; a key logged as a dict is a struct column); a row without the key is null, NaN and inf are IEEE values. The
rows are read as the ``.wandb`` file's history rows are (`wandb_offline.entries`): keyed on ``train/global_step``,
the step every metric of a Trainer run is declared against. The export holds the history only: no run config, so no
plan; rows logged after the export was made are not in it.
"""

from __future__ import annotations

from pathlib import Path

from ...core.safe_io import open_regular
from ...errors import InputError
from ..logs import MAX_LOG_BYTES
from ..source import LogSource, SourceLog
from .wandb_offline import NO_GRAD_NORM, entries

PARQUET_MAGIC = b"PAR1"
# A Parquet footer (the schema) larger than this is no history export's.
MAX_FOOTER_BYTES = 1 << 24


class WandbHistoryExport(LogSource):
    name = "wandb-export"
    provenance = "imported logs: W&B history export (Parquet)"
    patterns = ("**/*.parquet",)
    what = "the W&B history export"
    rank = 35
    no_grad_norm = NO_GRAD_NORM

    def detect(self, path: Path) -> bool:
        """A Parquet file whose schema has W&B's own ``_step`` and ``_runtime`` or ``_timestamp`` columns."""
        names = parquet_columns(path)
        return names is not None and "_step" in names and bool(names & {"_runtime", "_timestamp"})

    def read(self, files: list[Path], run_dir: Path) -> SourceLog:
        import pyarrow as pa
        import pyarrow.parquet as pq

        tables, skipped = [], []
        for path in files:
            try:
                with open_regular(path.absolute(), run_dir, MAX_LOG_BYTES) as f:
                    table = pq.read_table(f)
            except (pa.ArrowException, OSError) as exc:
                if isinstance(exc, InputError):
                    raise
                skipped.append({"file": str(path.relative_to(run_dir)), "lines": 1, "of": 1})
                continue
            tables.append(table)
        if not tables:
            return self.log(files, run_dir, segments=[], skipped=skipped, records=len(skipped))
        history = pa.concat_tables(tables, promote_options="permissive")
        rows = sorted(history.to_pylist(), key=lambda r: (r.get("_step") is None, r.get("_step") or 0))
        found = entries(rows)
        return self.log(
            files,
            run_dir,
            segments=[found] if found else [],
            skipped=skipped,
            records=len(rows) + len(skipped),
        )


def parquet_columns(path: Path) -> set[str] | None:
    """The top-level column names of a Parquet file, read from its footer alone (None: not a Parquet file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open_regular(path) as f:
        if f.read(4) != PARQUET_MAGIC:
            return None
        size = f.seek(0, 2)
        if size < 12:
            return None
        f.seek(size - 8)
        tail = f.read(8)
        if tail[4:] != PARQUET_MAGIC or int.from_bytes(tail[:4], "little") > min(MAX_FOOTER_BYTES, size - 12):
            return None
        f.seek(0)
        try:
            return set(pq.read_schema(f).names)
        except pa.ArrowException:
            return None
