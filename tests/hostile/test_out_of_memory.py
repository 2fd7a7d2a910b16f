"""Running out of memory is said with advice that applies to the command that ran: the [ingest] limits only
where the command reads them from --config (diff has none), never "a bug in sftaudit"."""

from __future__ import annotations

import pytest

from sftaudit.cli import _describe, _parser


def _takes_config(command: str) -> bool:
    parser = _parser()
    sub = next(a for a in parser._actions if a.dest == "command")  # the subcommands
    return "--config" in sub.choices[command]._option_string_actions


@pytest.mark.parametrize("command", ["ingest", "audit", "replay", "gate", "diff", "golden", "preflight", "report"])
@pytest.mark.parametrize("exc", [MemoryError(), __import__("duckdb").OutOfMemoryException("Out of Memory Error")])
def test_out_of_memory_advice_applies_to_the_command(command, exc):
    said = _describe(exc, command)
    assert said.startswith("ran out of memory") and "bug in sftaudit" not in said
    if "[ingest]" in said:
        assert _takes_config(command) and command != "preflight", said
    if command in ("diff", "report"):
        assert said == "ran out of memory reading it; free memory"
    if command == "golden":
        assert "--stride" in said
