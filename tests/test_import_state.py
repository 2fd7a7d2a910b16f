"""An audit of a Trainer output imports it again only when the run folder changed since the last import (issue 34:
a per-step log of a million entries is not read again for nothing); what the import was made from is kept in
sftaudit's cache, where no file planted in the run folder can forge it."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import time

from sftaudit.cli import main
from sftaudit.core.artifacts import artifact_root, rank_dir
from sftaudit.store.import_state import STATE_FILE
from sftaudit.store.rundb import database_dir


def _trainer_output(run, steps: int = 60, nan_at: int | None = None):
    """A Trainer output: a per-step trainer_state.json, written 10 s in the past (older than the race window)."""
    run.mkdir(parents=True, exist_ok=True)
    history = [
        {
            "epoch": s / steps,
            "grad_norm": 1.0,
            "learning_rate": 1e-4,
            "loss": math.nan if s == nan_at else 2.0 - s / 100,
            "step": s,
        }
        for s in range(1, steps + 1)
    ]
    state = {"global_step": steps, "max_steps": steps, "logging_steps": 1, "log_history": history}
    path = run / "trainer_state.json"
    path.write_text(json.dumps(state, indent=2))
    old = time.time() - 10
    os.utime(path, (old, old))
    return run


def _audit(run, out) -> tuple[int, dict]:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(["audit", str(run), "--no-report", "--out", str(out)])
    return code, json.loads((out / "verdict.json").read_text())


def _manifest_identity(run) -> tuple[int, int]:
    st = (rank_dir(run, 0) / "manifest.jsonl").stat()
    return st.st_ino, st.st_mtime_ns


def _codes(verdict) -> list[tuple[str, str]]:
    return sorted((f["code"], f["rule"], f["severity"], f["step"]) for f in verdict["findings"])


def test_an_unchanged_output_is_not_imported_again(tmp_path):
    run = _trainer_output(tmp_path / "run", nan_at=40)
    code, first = _audit(run, tmp_path / "out")
    imported = _manifest_identity(run)
    assert (database_dir(run) / STATE_FILE).is_file()
    again, second = _audit(run, tmp_path / "out")
    assert _manifest_identity(run) == imported  # the artifacts as the first audit's import wrote them
    assert (code, _codes(first)) == (again, _codes(second)) and code == 1


def test_a_changed_source_or_artifact_is_imported_again(tmp_path):
    run = _trainer_output(tmp_path / "run")
    code, verdict = _audit(run, tmp_path / "out")
    assert code == 0, _codes(verdict)
    _trainer_output(run, nan_at=40)  # rewritten in place, the same size (NaN for 1.6): its mtime moved
    imported = _manifest_identity(run)
    code, verdict = _audit(run, tmp_path / "out")
    assert _manifest_identity(run) != imported and code == 1  # read again: the NaN is found
    steps = rank_dir(run, 0) / "steps.parquet"
    steps.write_text("")  # an artifact emptied: the import wrote it otherwise, so it is written again
    _audit(run, tmp_path / "out")
    assert steps.stat().st_size > 0


def test_a_planted_state_file_changes_nothing(tmp_path):
    """The run folder is untrusted: a state file planted where the cache keeps its own is never read, and the
    run's own state is not in the run folder."""
    run = _trainer_output(tmp_path / "run")
    _audit(run, tmp_path / "out")
    kept = (database_dir(run) / STATE_FILE).read_text()
    assert not any(p.name == STATE_FILE for p in run.rglob("*"))
    _trainer_output(run, nan_at=40)
    (artifact_root(run) / STATE_FILE).write_text(kept)  # a copy of the state as it was, planted
    code, _ = _audit(run, tmp_path / "out")
    assert code == 1


def test_a_source_written_a_moment_ago_is_not_trusted(tmp_path):
    """An mtime within the last second may be followed by another write in the same tick: the import is not
    remembered, and the next audit imports again."""
    run = _trainer_output(tmp_path / "run")
    os.utime(run / "trainer_state.json")  # now
    _audit(run, tmp_path / "out")
    assert not (database_dir(run) / STATE_FILE).exists()
