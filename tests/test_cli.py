"""The command line: exit codes, one-line errors, outputs where promised."""

import json
import re
import shutil
import subprocess
import sys

import pytest

from sftaudit.cli import main
from sftaudit.core.artifacts import rank_dir


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "sftaudit.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def test_audit_writes_verdict_and_report_under_reports_by_default(nan_run, tmp_path):
    result = run_cli("audit", nan_run, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    out = tmp_path / "reports" / "nan"
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["verdict"] == "fail" and verdict["run"] == "nan"
    assert set(verdict) >= {"schema_version", "first_anomalous_step", "rollback_checkpoint", "checkpoints", "findings"}
    assert (out / "report.html").stat().st_size > 1_000_000  # plotly.js is inlined: works offline
    # `report` rebuilds the page from DuckDB without re-running the checks.
    (out / "report.html").unlink()
    assert run_cli("report", nan_run, cwd=tmp_path).returncode == 0 and (out / "report.html").exists()


def test_clean_run_passes_and_ingest_is_incremental(clean_run, tmp_path):
    assert main(["audit", str(clean_run), "--out", str(tmp_path), "--no-report"]) == 0
    assert json.loads((tmp_path / "verdict.json").read_text())["verdict"] in ("pass", "warn")
    result = run_cli("ingest", clean_run)
    assert result.returncode == 0 and result.stdout.strip() == "nothing new"


@pytest.mark.parametrize(
    "setup, reason",
    [
        (lambda d: None, "no such run directory"),
        (lambda d: d.mkdir(), "no sftaudit artifacts"),
        (
            lambda d: (
                rank_dir(d, 0).mkdir(parents=True),
                (rank_dir(d, 0) / "steps.jsonl").write_text('{"seg":0,"step":1}\n'),
            ),
            "no manifest",
        ),
        (
            lambda d: (
                rank_dir(d, 0).mkdir(parents=True),
                (rank_dir(d, 0) / "manifest.jsonl").write_text('{"schema_version": 99, "seg": 0}\n'),
            ),
            "schema version 99",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, setup, reason):
    run = tmp_path / "run"
    setup(run)
    result = run_cli("audit", run, "--out", tmp_path / "out")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and reason in result.stderr and "Traceback" not in result.stderr


def test_bad_arguments_and_config_exit_2(clean_run, tmp_path):
    assert run_cli("audit").returncode == 2
    bad = tmp_path / "bad.toml"
    bad.write_text('[checks."LOOP-05"]\nno_such_option = 1\n')
    result = run_cli("audit", clean_run, "--config", bad, "--out", tmp_path)
    assert result.returncode == 2 and "no_such_option" in result.stderr and result.stderr.count("\n") == 1


def test_hostile_run_id_cannot_escape_the_reports_folder(clean_run, tmp_path):
    run = tmp_path / "hostile"
    shutil.copytree(clean_run, run, ignore=shutil.ignore_patterns("audit.duckdb*", "checkpoint-*"))
    manifest = rank_dir(run, 0) / "manifest.jsonl"
    record = json.loads(manifest.read_text().splitlines()[0])
    record["run_id"] = "../../etc/<script>"
    manifest.write_text(json.dumps(record) + "\n")
    result = run_cli("audit", run, "--no-report", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    written = list((tmp_path / "reports").rglob("verdict.json"))
    assert len(written) == 1 and written[0].parent.parent == tmp_path / "reports"


def test_a_second_run_of_the_same_folder_name_never_overwrites_the_first_ones_report(tmp_path, monkeypatch):
    """a/run, then b/run: the first keeps reports/run/, the second gets reports/run-<hash of its path>/, and
    each audit again writes where it wrote before."""
    import numpy as np

    from .checks.logged_runs import trainer_run

    first = trainer_run(tmp_path / "a" / "run", loss=np.linspace(2.0, 1.0, 10))
    second = trainer_run(tmp_path / "b" / "run", loss=np.linspace(2.0, 1.5, 10), lr=5.0)  # a fail, told apart
    monkeypatch.chdir(tmp_path)
    assert main(["audit", str(first), "--no-report"]) == 0
    assert main(["audit", str(second), "--no-report"]) == 1
    assert main(["audit", str(first), "--no-report"]) == 0
    folders = sorted(p.name for p in (tmp_path / "reports").iterdir())
    assert len(folders) == 2 and folders[0] == "run" and re.fullmatch(r"run-[0-9a-f]{8}", folders[1]), folders
    verdicts = {name: json.loads((tmp_path / "reports" / name / "verdict.json").read_text()) for name in folders}
    assert verdicts["run"]["verdict"] == "pass" and verdicts[folders[1]]["verdict"] == "fail"
    owner = (tmp_path / "reports" / folders[1] / ".sftaudit-source").read_text().strip()
    assert owner == str(second.resolve())
