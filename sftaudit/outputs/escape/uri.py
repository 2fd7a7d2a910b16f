"""Paths from a run folder as URI references (SARIF artifact locations): each segment percent-encoded, so a
folder named ``run #1 %41?`` is one path (``run%20%231%20%2541%3F``) and not a fragment, an escape or a query,
and no control character or space survives raw."""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from urllib.parse import quote


def relative(path: str | PurePosixPath) -> str:
    """A relative path (``/``-separated, as the verdict stores it) as a relative URI reference; a trailing
    ``/`` (a folder) is kept."""
    return "/".join(quote(part, safe="") for part in str(path).split("/"))


def folder(path: str | Path) -> str:
    """An absolute ``file:`` URI of a local folder, ending in ``/`` (a base other URIs resolve against)."""
    uri = Path(path).resolve().as_uri()
    return uri if uri.endswith("/") else uri + "/"
