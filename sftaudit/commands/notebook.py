"""`sftaudit.open(RUN_DIR)`: a run's audit database as polars frames, for a notebook.

    run = sftaudit.open("runs/demo-nan")
    run.verdict.first_anomalous_step              # the verdict, typed (`.to_dict()`: as verdict.json has it)
    run.steps.filter(pl.col("loss").is_nan())     # polars; .to_pandas() where pandas is wanted
    run.grad_norms                                # long: step, rank, tensor, norm
    run.sql("SELECT tensor, max(norm) FROM grad_norms GROUP BY tensor")
    run.plot("timeline")                          # the report's figures, as plotly objects

Every read first ingests what the run appended since (a run still training shows its new steps), through the
audit's one entry point (`sftaudit.verdict.audit.audited`); the run's own files are only read. The verdict is
judged again when something new was ingested (or this sftaudit never judged it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl

from ..errors import InputError
from ..schema.verdict import Verdict
from ..store.rundb import connect, inside_run_folder
from ..verdict.audit import audited
from ..verdict.config import AuditConfig


class AuditedRun:
    """One run folder (recorded by the shim, or a Trainer output_dir, imported on open)."""

    def __init__(self, run_dir: str | Path, config: AuditConfig | str | Path | dict | None = None):
        self.run_dir = Path(run_dir)
        if not self.run_dir.is_dir():
            raise InputError(f"{run_dir}: no such run directory")
        inside_run_folder(self.run_dir)  # a link out of the run is refused before anything is written
        # None: the config the stored verdict was judged with (else the defaults); a TOML file's path, or its
        # tables as a dict, are read as the CLI's --config is
        if isinstance(config, (str, Path)):
            config = AuditConfig.load(config)
        elif isinstance(config, dict):
            config = AuditConfig.from_dict(config)
        elif config is not None and not isinstance(config, AuditConfig):
            raise InputError(
                f"config must be an AuditConfig, a TOML file's path or a dict, not {type(config).__name__}"
            )
        self.config = config
        self.refresh()

    def __repr__(self) -> str:
        return f"sftaudit.open({str(self.run_dir)!r})"

    def refresh(self) -> dict[str, int]:
        """Import again (a run trained without the shim) and ingest what was appended since the last read;
        returns the new records per kind."""
        with audited(self.run_dir, self.config, judge="never") as done:
            return done.added

    def sql(self, query: str, params: list[Any] | None = None) -> pl.DataFrame:
        """Any query over the run's tables (steps, grad_norms, batches, samples, probes, generations,
        evals, metrics, checkpoints, events, findings, series, ...), as a polars frame. The database is
        opened as sftaudit opens it: the run's own files only, no other file, extension or setting."""
        with audited(self.run_dir, self.config, judge="never"):
            con = connect(self.run_dir, read_only=True)
            try:
                return con.sql(query, params=params or None).pl()
            finally:
                con.close()

    @property
    def verdict(self) -> Verdict:
        """The verdict (`sftaudit.schema.verdict.Verdict`; `.to_dict()` is verdict.json), audited again when new
        records arrived."""
        with audited(self.run_dir, self.config, judge="if_stale") as done:
            return Verdict.from_dict(done.verdict)

    @property
    def steps(self) -> pl.DataFrame:
        return self.sql("SELECT * FROM steps ORDER BY rank, step")

    @property
    def grad_norms(self) -> pl.DataFrame:
        return self.sql("SELECT step, rank, tensor, norm FROM grad_norms ORDER BY rank, step, idx")

    @property
    def batches(self) -> pl.DataFrame:
        return self.sql("SELECT * FROM batches ORDER BY rank, step, micro")

    @property
    def samples(self) -> pl.DataFrame:
        return self.sql("SELECT * FROM samples ORDER BY rank, step, micro, row")

    @property
    def probes(self) -> pl.DataFrame:
        return self.sql("SELECT * FROM probes ORDER BY rank, step, prompt")

    @property
    def checkpoints(self) -> pl.DataFrame:
        return self.sql("SELECT * FROM checkpoints ORDER BY rank, step")

    @property
    def findings(self) -> pl.DataFrame:
        """The verdict's findings, one row each (evidence as a JSON string)."""
        with audited(self.run_dir, self.config, judge="if_stale"):  # audits first when the stored ones are stale
            con = connect(self.run_dir, read_only=True)
            try:
                return con.sql("SELECT * FROM findings ORDER BY step NULLS LAST, code").pl()
            finally:
                con.close()

    def plot(self, name: str | None = None):
        """The report's figures as plotly Figures: all of them by name, or the one named
        (`timeline`, `grad-heatmap`, `ranks`, `series-loop-05`, ...)."""
        import plotly.graph_objects as go

        from ..outputs.report import report_figures

        with audited(self.run_dir, self.config, judge="if_stale") as done:
            con = connect(self.run_dir, read_only=True)
            try:
                figures = {k: go.Figure(v) for k, v in report_figures(con, done.verdict).items()}
            finally:
                con.close()
        if name is None:
            return figures
        if name not in figures:
            raise InputError(f"{self.run_dir}: no figure {name!r}; this run has {', '.join(sorted(figures))}")
        return figures[name]
