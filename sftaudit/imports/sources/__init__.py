"""The registered log sources: every module in this package holds one `LogSource` subclass.

Adding a log source is one new file here (plus its tests); nothing else changes. `registered_sources` finds them;
`find_log` picks the log of a run folder (or of one file given as the run's own path) and reads it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
from pathlib import Path

from ...core.safe_io import UnsafeFile, regular_file
from ...errors import InputError
from ..source import LogSource, SourceLog

# Folders of a run whose files are never a training log of the run (sftaudit's own artifacts).
NOT_LOGS = {"sftaudit"}


def registered_sources() -> list[LogSource]:
    """One instance of every source class, those read by the Trainer output importer first, then by rank."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        found += [
            obj()
            for obj in vars(module).values()
            if inspect.isclass(obj)
            and issubclass(obj, LogSource)
            and obj is not LogSource
            and obj.__module__ == module.__name__
        ]
    return sorted(found, key=lambda s: (s.rank is not None, s.rank or 0, s.name))


def source_named(name: str) -> LogSource:
    """The registered source called `name`; a one-line error naming the others otherwise."""
    sources = registered_sources()
    for s in sources:
        if s.name == name:
            return s
    raise InputError(f"--source {name}: no such log source (one of: {', '.join(s.name for s in sources)})")


def detected(path: Path) -> LogSource | None:
    """The source a file belongs to by its content (None: none of them)."""
    return next((s for s in registered_sources() if _detects(s, path)), None)


def source_files(source: LogSource, run_dir: Path, forced: bool = False) -> list[Path]:
    """The source's files in a run folder: its patterns' matches that are regular files inside the folder (a link
    out of it, a FIFO or a device is never read) and, unless `forced` (``--source``), whose content is its."""
    out = []
    for pattern in source.patterns:
        for p in sorted(run_dir.glob(pattern)):
            if NOT_LOGS & set(p.relative_to(run_dir).parts):
                continue
            try:
                regular_file(p.absolute(), run_dir)
            except UnsafeFile:
                continue
            if p not in out and (forced or _detects(source, p)):
                out.append(p)
    return out


def find_log(run_dir: Path, name: str | None = None, file: Path | None = None) -> SourceLog | None:
    """The run's training log kept per (re)start: of the sources whose files the folder holds, the first by rank
    that read any entry, else the first that read any record (a log of progress lines alone says so). `name`
    (``--source``) reads that source only, its files taken as its even where their content does not tell; `file`
    (the run given by a log file's own path) reads that file only (a Trainer state: the folder, as usual). None: no
    such log (a run that has only its Trainer states, or nothing)."""
    if file is not None:
        regular_file(file.absolute(), run_dir)
        source = source_named(name) if name else detected(file)
        if source is None:
            raise InputError(f"{file}: not a training log sftaudit reads (name its kind with --source)")
        if source.rank is not None:
            return source.read([file], run_dir)
        name = None
    sources = [source_named(name)] if name else registered_sources()
    empty = None
    for source in sources:
        if source.rank is None or not _installed(source):
            continue
        files = source_files(source, run_dir, forced=name is not None)
        if not files:
            continue
        log = source.read(files, run_dir)
        if log.segments:
            return log
        empty = empty or (log if log.records else None)
    return empty


def missing_extras(run_dir: Path) -> list[str]:
    """What to install to read the logs this folder holds that no installed source can read (their files named by
    the source's patterns alone)."""
    out = []
    for source in registered_sources():
        if source.needs and not _installed(source) and any(next(run_dir.glob(p), None) for p in source.patterns):
            out.append(f"{source.what} need: pip install '{source.needs[1]}'")
    return out


def _installed(source: LogSource) -> bool:
    if source.needs is None:
        return True
    return importlib.util.find_spec(source.needs[0]) is not None


def _detects(source: LogSource, path: Path) -> bool:
    try:
        return source.detect(path)
    except (OSError, InputError):
        return False


__all__ = [
    "LogSource",
    "SourceLog",
    "detected",
    "find_log",
    "missing_extras",
    "registered_sources",
    "source_files",
    "source_named",
]
