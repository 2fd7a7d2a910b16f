"""sftaudit.open(RUN_DIR): polars frames over the run's DuckDB file, matching the verdict and the tables."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import plotly.graph_objects as go
import polars as pl

import sftaudit
from sftaudit.core.artifacts import rank_dir
from sftaudit.store.rundb import connect


def test_frames_match_the_verdict_and_the_tables(nan_run, tmp_path):
    run = sftaudit.open(shutil.copytree(nan_run, tmp_path / "nan"))
    verdict = run.verdict
    assert verdict["verdict"] == "fail" and verdict["first_anomalous_step"] is not None
    steps, grads, findings = run.steps, run.grad_norms, run.findings
    assert isinstance(steps, pl.DataFrame) and grads.columns == ["step", "rank", "tensor", "norm"]
    con = connect(run.run_dir, read_only=True)
    try:
        assert steps.height == con.execute("SELECT count(*) FROM steps").fetchone()[0]
        assert grads.height == con.execute("SELECT count(*) FROM grad_norms").fetchone()[0]
    finally:
        con.close()
    assert sorted(zip(findings["code"], findings["message"])) == sorted(
        (f["code"], f["message"]) for f in verdict["findings"]
    )
    assert run.batches.height and run.checkpoints.height
    worst = run.sql("SELECT tensor, max(norm) AS m FROM grad_norms WHERE isfinite(norm) GROUP BY tensor")
    assert worst.height == grads["tensor"].n_unique()
    assert run.steps.to_pandas()["step"].tolist() == steps["step"].to_list()
    figures = run.plot()
    assert "timeline" in figures and isinstance(run.plot("timeline"), go.Figure)


def test_opening_a_run_while_it_trains_sees_the_new_steps(clean_run, tmp_path):
    """The run grows between two reads (its steps file gains the records the shim appends next)."""
    full = rank_dir(clean_run, 0) / "steps.jsonl"
    lines = full.read_bytes().splitlines(keepends=True)
    run_dir = Path(shutil.copytree(clean_run, tmp_path / "growing"))
    grown = rank_dir(run_dir, 0) / "steps.jsonl"
    grown.write_bytes(b"".join(lines[:10]))
    run = sftaudit.open(run_dir)
    assert run.steps["step"].to_list() == list(range(1, 11))
    first = run.verdict["evidence"]["ranks"][0]["last_step"]
    with grown.open("ab") as f:
        f.write(b"".join(lines[10:]))
    assert run.steps.height == len(lines)
    assert run.verdict["evidence"]["ranks"][0]["last_step"] == len(lines) > first == 10


def test_importing_sftaudit_stays_light():
    """`import sftaudit` (what the shim does) imports no analyzer module, DuckDB or polars."""
    code = (
        "import sys, sftaudit; heavy = [m for m in ('duckdb', 'polars', 'scipy', 'sftaudit.commands.notebook') "
        "if m in sys.modules]; print(json.dumps(heavy))"
    )
    done = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == []


def test_the_docs_example_runs(nan_run, tmp_path, capsys):
    page = (Path(__file__).resolve().parents[1] / "docs" / "notebook.md").read_text()
    example = page.split("```python\n", 1)[1].split("```", 1)[0]
    run_dir = shutil.copytree(nan_run, tmp_path / "demo-nan")
    exec(compile(example.replace('"runs/demo-nan"', repr(str(run_dir))), "docs/notebook.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.startswith("fail ") and "tensors with non-finite gradients" in printed
