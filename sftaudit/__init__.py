"""sftaudit: record a supervised fine-tuning run with a thin shim, audit it from its artifacts.

Importing this package imports nothing heavy: the training side lives in
`sftaudit.shim` (torch) and `sftaudit.hf` (transformers), the analyzer in the
other modules (DuckDB, scipy; never torch).
"""

__version__ = "0.1.0"


def open(run_dir, config=None):  # noqa: A001 - sftaudit.open(RUN_DIR), as a notebook calls it
    """A run's audit database as polars frames (`sftaudit.notebook.AuditedRun`); the analyzer is
    imported here, on first use, so `import sftaudit` stays light for the shim."""
    from .notebook import AuditedRun

    return AuditedRun(run_dir, config)
