"""Readers of what a run left on disk: checkpoint formats and layouts, optimizer state, one checkpoint inspected,
a Parquet part's page headers walked before its pages are read."""
