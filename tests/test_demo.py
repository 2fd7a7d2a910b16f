"""`sftaudit demo` audits its runs as `sftaudit audit` does: a verdict.json beside each report, the same summary."""

import json

import pytest

from sftaudit.cli import main

pytestmark = pytest.mark.slow  # trains two tiny runs


def test_the_demo_writes_each_verdict_and_prints_the_audit_summary(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--workdir", str(tmp_path / "runs"), "--steps", "4"]) == 0
    out = capsys.readouterr().out
    for name, verdict in (("demo-clean", "pass"), ("demo-nan", "fail")):
        written = json.loads((tmp_path / "reports" / name / "verdict.json").read_text())
        assert written["run"] == name and (
            written["verdict"] == verdict or verdict == "pass" and written["verdict"] == "warn"
        )
        assert f"verdict: reports/{name}/verdict.json" in out and f"report:  reports/{name}/report.html" in out
    assert "demo-nan: FAIL; first anomalous step 4" in out
    assert "step None" not in out  # run-scope findings say "run", as the audit prints them
    assert out.rstrip().endswith("demo ok")
