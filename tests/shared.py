"""Fixture runs built once per pytest invocation, shared by its xdist workers, and verdicts cached per run.

`shared_dir` builds a folder once: the first worker to take the lock builds it in a private scratch
folder and renames it into place (a built folder is whole or absent), the others wait on the lock and
use it. The built folder is never written to: each worker gets its own copy, since an audit writes
RUN/sftaudit/audit.duckdb and some tests change the run they are given. Everything lives under the
invocation's own base temp, so two checkouts testing at once on one machine share nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

BUILT_AT = ".built-at"  # beside the built folder: the scratch path it was built under


def invocation_dir(tmp_path_factory) -> Path:
    """A folder of this invocation alone, seen by all its workers (xdist gives each worker a base temp
    inside the controller's)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_dir(tmp_path_factory, key: str, build: Callable[[Path], object]) -> Path:
    """`build(folder)` fills an empty folder, once per invocation; returns this worker's copy of it.

    `build` must not call shared_dir itself (resolve what it needs first: a lock held while waiting for
    another could deadlock two workers)."""
    root = invocation_dir(tmp_path_factory) / "shared-runs"
    root.mkdir(exist_ok=True)
    built = root / key
    with FileLock(str(root / f"{key}.lock")):
        if not built.is_dir():
            scratch = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
            build(scratch)
            (root / f"{key}{BUILT_AT}").write_text(str(scratch), encoding="utf-8")
            os.rename(scratch, built)
    mine = Path(shutil.copytree(built, tmp_path_factory.mktemp(key), symlinks=True, dirs_exist_ok=True))
    relocate(mine, (root / f"{key}{BUILT_AT}").read_text(encoding="utf-8"))
    return mine


def relocate(folder: Path, trained_at: str) -> None:
    """The plain loop records its own resume command with the folder it trained in (`sftaudit replay`
    prints it): make the copy's name itself, as a run trained where it lies does."""
    old, new = trained_at.encode(), str(folder).encode()
    for path in folder.rglob("*.jsonl"):
        data = path.read_bytes()
        if old in data:
            path.write_bytes(data.replace(old, new))


_VERDICTS: dict[tuple[str, str], dict] = {}


def cached_audit(run_dir: Path, config=None) -> dict:
    """`audit(run_dir, config)`, run once per worker for each run and config: for tests that only read the
    verdict (each gets its own copy to read). A test that changes the run, or reads what the audit
    stored in it, calls `audit` itself."""
    from sftaudit.verdict.audit import audit
    from sftaudit.verdict.config import AuditConfig

    key = (str(Path(run_dir).resolve()), json.dumps(dataclasses.asdict(config or AuditConfig()), sort_keys=True))
    if key not in _VERDICTS:
        _VERDICTS[key] = audit(run_dir, config)
    return copy.deepcopy(_VERDICTS[key])
