"""The commands behind the CLI and the notebook API: gate, replay, preflight, diff."""
