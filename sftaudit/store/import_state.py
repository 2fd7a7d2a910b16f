"""What a run's import was made from, so an audit of a Trainer output that has not changed reuses its artifacts
instead of reading a per-step log of a million entries again.

The run folder's state is the identity (path, size, mtime_ns, inode) of every file in it, links not followed
(a link's target named instead), walked once: the sources the importer read and the artifacts it wrote. It is
kept as two digests beside the run's database in sftaudit's cache (never in the run folder, where a planted file
could forge it), with the importer's own identity (its version, the files of its code) and what the import was
asked for (``--source``, a log file). A state taken while a source changed (between the walks before and after
the import, or within the last second, where an mtime may not have ticked yet) is not kept: the next audit
imports again.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

from .._version import __version__
from ..core.artifacts import ARTIFACT_DIR
from .rundb import database_dir

STATE_FILE = "imported.json"
# A folder with more entries than this is imported on every audit rather than walked.
MAX_ENTRIES = 100_000
# An mtime this close to the walk may be followed by a write in the same tick: not trusted.
RACY_NS = 1_000_000_000


def folder_state(run_dir: str | Path) -> tuple[str, str, int] | None:
    """(digest of the sources, digest of the artifacts folder, the newest source mtime_ns) of the run folder; None
    when it holds more than `MAX_ENTRIES` entries."""
    root = os.path.realpath(run_dir)
    sources, artifacts = hashlib.sha256(), hashlib.sha256()
    newest, seen, stack = 0, 0, [""]
    while stack:
        relative = stack.pop()
        try:
            entries = sorted(os.scandir(os.path.join(root, relative)), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            seen += 1
            if seen > MAX_ENTRIES:
                return None
            name = os.path.join(relative, entry.name)
            mine = name == ARTIFACT_DIR or name.startswith(ARTIFACT_DIR + os.sep)
            digest = artifacts if mine else sources
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):  # its entries say what it holds (its mtime moves when sftaudit/ is made)
                stack.append(name)
                digest.update(f"d {name}\0".encode("utf-8", "surrogateescape"))
                continue
            target = os.readlink(entry.path) if stat.S_ISLNK(st.st_mode) else ""
            digest.update(
                f"{name}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{target}\0".encode(
                    "utf-8", "surrogateescape"
                )
            )
            if not mine:
                newest = max(newest, st.st_mtime_ns)
    return sources.hexdigest(), artifacts.hexdigest(), newest


def importer_key(source: str | None, log_file: str | Path | None) -> str:
    """The importer's identity (its version, its code's files) and what it was asked to read."""
    code = Path(__file__).resolve().parents[1] / "imports"
    files = sorted(code.rglob("*.py"))
    stats = [(str(p.relative_to(code)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    text = json.dumps([__version__, stats, source, None if log_file is None else str(log_file)])
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def imported_if_changed(
    run_dir: str | Path, ensure: Callable[[], bool], source: str | None, log_file: str | Path | None, always: bool
) -> bool:
    """Call `ensure` (the import: returns whether the folder was imported) unless the run folder is as the last
    import of it left it, with the same importer and arguments (`always`: call it regardless, as with training
    data given). Returns whether it was called."""
    key = importer_key(source, log_file)
    if not always and _unchanged(run_dir, key):
        return False
    (database_dir(run_dir) / STATE_FILE).unlink(missing_ok=True)  # kept again only once this import is done
    started = time.time_ns()
    before = folder_state(run_dir)
    if ensure():
        _remember(run_dir, key, before, started)
    return True


def _unchanged(run_dir: str | Path, key: str) -> bool:
    try:
        kept = json.loads((database_dir(run_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return False
    now = folder_state(run_dir)
    return (
        isinstance(kept, dict)
        and now is not None
        and kept.get("key") == key
        and [kept.get("sources"), kept.get("artifacts")] == list(now[:2])
    )


def _remember(run_dir: str | Path, key: str, before: tuple[str, str, int] | None, started_ns: int) -> None:
    """Keep the run folder's state after an import that began at `started_ns` with the folder in state `before`,
    unless a source changed meanwhile or too recently to tell."""
    after = folder_state(run_dir)
    if before is None or after is None or after[0] != before[0] or after[2] > started_ns - RACY_NS:
        return
    folder = database_dir(run_dir)
    tmp = folder / f"{STATE_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"key": key, "sources": after[0], "artifacts": after[1]}) + "\n")
    os.replace(tmp, folder / STATE_FILE)
