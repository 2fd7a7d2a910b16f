"""What the verdict is rendered into: every module (or package) here but `escape` is one output format named
after it, holding its declaration `FORMAT`: `terminal` (the summary the CLI prints), `json` (verdict.json, a
gate's result), `junit`, `sarif`, `markdown` (a model card's section), `github` (Actions annotations and the
step summary), `report` (the HTML report). `webhook` is no format of a verdict: it is the alert `watch` posts for each new finding.

A format is a pure function of one `Rendering` (the verdict, and what its command read beforehand and hands in
as data); it computes nothing and opens nothing. Commands pick formats by name (`rendered`); adding one is one
module here plus its tests (`tests/test_outputs.py` keeps the registry complete).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NOT_FORMATS = frozenset({"escape", "webhook"})  # the escaping every format shares; watch's per-finding alert


@dataclass(frozen=True)
class Rendering:
    """What a renderer is given. `verdict` is the one value every format renders (verdict.json's document);
    the rest is read or decided by the command beforehand."""

    verdict: dict[str, Any]
    run_dir: Path
    gate: dict[str, Any] | None = None  # a gate's result (`sftaudit gate --json`'s document): rendered above the run
    strict: bool = False  # warn findings block too
    versions: dict[str, Any] | None = None  # the run manifest's library versions (None: not read)
    audited_with: str | None = None  # the sftaudit version that wrote the verdict, for a model card
    codes: tuple[str, ...] = ()  # the checks the command judges (preflight: the dataset checks); empty: every one
    report: Any = None  # what the HTML report shows, read from the run database by the command
    written: dict[str, Path] = field(default_factory=dict)  # output name -> where the command wrote it


@dataclass(frozen=True)
class Format:
    """A format's declaration; its name is its module's."""

    what: str  # one line: what it is for
    render: Callable[[Rendering], str]


def registered_formats() -> dict[str, Format]:
    """Every format of this package, by name."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name in NOT_FORMATS:
            continue
        found[info.name] = importlib.import_module(f"{__name__}.{info.name}").FORMAT
    return dict(sorted(found.items()))


def rendered(name: str, rendering: Rendering) -> str:
    """`rendering` in the format `name` (only that format's module is imported)."""
    module = f"{__name__}.{name}"
    if name in NOT_FORMATS or not name.isidentifier() or importlib.util.find_spec(module) is None:
        raise KeyError(f"no output format {name!r}")
    return importlib.import_module(module).FORMAT.render(rendering)
