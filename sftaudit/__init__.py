"""sftaudit: record a supervised fine-tuning run with a thin shim, audit it from its artifacts.

Importing this package imports nothing heavy: the training side lives in
`sftaudit.shim` (torch) and `sftaudit.hf` (transformers), the analyzer in the
other modules (DuckDB, scipy; never torch).
"""

from ._version import __version__

__all__ = ["__version__", "open"]


def open(run_dir, config=None):  # noqa: A001 - sftaudit.open(RUN_DIR), as a notebook calls it
    """A run's audit database as polars frames (`sftaudit.commands.notebook.AuditedRun`); `config` is a TOML
    file's path (as `--config`), its tables as a dict, or an AuditConfig. The analyzer is imported here, on first
    use, so `import sftaudit` stays light for the shim."""
    from .commands.notebook import AuditedRun

    return AuditedRun(run_dir, config)
