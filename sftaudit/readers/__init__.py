"""Readers of what a run left on disk: checkpoint formats and layouts, optimizer state, one checkpoint inspected."""
