"""sftaudit: record a supervised fine-tuning run with a thin shim, audit it from its artifacts.

Importing this package imports nothing heavy: the training side lives in
`sftaudit.shim` (torch) and `sftaudit.hf` (transformers), the analyzer in the
other modules (DuckDB, scipy; never torch).
"""

__version__ = "0.1.0"
