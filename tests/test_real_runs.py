"""A few of the real, uninstrumented run folders in ``<repo>/../shared/realruns``, chosen for their shapes,
audited as a user would: no traceback, no numpy warning, no check error, exit 0/1/2 only. Skipped when the
folder is absent (``SFTAUDIT_REAL_RUNS`` points elsewhere). All of them: ``benchmarks/real_runs.py``."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest

from sftaudit.cli import main

REAL_RUNS = Path(
    os.environ.get("SFTAUDIT_REAL_RUNS") or Path(__file__).resolve().parents[1] / ".." / "shared" / "realruns"
)
pytestmark = pytest.mark.slow  # every real run audited

SHAPES = [
    "lf-two-writers",  # a LLaMA-Factory log two processes wrote at once, then a resume
    # TensorBoard event files that are Git LFS pointers, last-checkpoint/
    "whisper-ja-lfs-tb",
    "star-multihead-stopped",  # a custom Trainer logging `lr` and train/* keys, stopped at 40,000 of 252,780
    "gpt2-ja-tb-only",  # TensorBoard event files alone, a final evaluation in a file of its own
    "tiny-gpt2-as-checkpoint",  # a bare checkpoint folder with weights and optimizer state
    "empty-log-history",  # a trainer_state.json with nothing logged
]


@pytest.mark.parametrize("name", SHAPES)
def test_a_real_run_is_audited_without_a_crash_or_a_warning(name, tmp_path):
    source = REAL_RUNS / name
    if not source.is_dir():
        pytest.skip(f"{source}: not here")
    run = tmp_path / name
    shutil.copytree(source, run)  # the audit writes its database into the run folder
    for p in [run, *run.rglob("*")]:
        p.chmod(p.stat().st_mode | 0o200)
    printed, errors = io.StringIO(), io.StringIO()
    with (
        warnings.catch_warnings(record=True) as caught,
        contextlib.redirect_stdout(printed),
        contextlib.redirect_stderr(errors),
    ):
        warnings.simplefilter("always")
        code = main(["audit", str(run), "--out", str(tmp_path / "out"), "--no-report"])
    assert code in (0, 1, 2)
    assert "Traceback" not in errors.getvalue() and "SFTAUDIT_DEBUG" not in errors.getvalue(), errors.getvalue()
    numpy = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if issubclass(w.category, RuntimeWarning)]
    assert numpy == []
    verdict_file = tmp_path / "out" / "verdict.json"
    if verdict_file.is_file():
        verdict = json.loads(verdict_file.read_text(encoding="utf-8"))
        assert verdict["check_errors"] == [] and not [c for c in verdict["checks"] if c["status"] == "error"]
    else:
        assert code == 2 and len(errors.getvalue().strip().splitlines()) == 1, errors.getvalue()
