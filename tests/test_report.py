"""The HTML report, rendered from real audited runs (clean and NaN) through `write_report` and the CLI.

Evidence kinds that no check in this tree produces yet (tokens, n-grams, keys, dtypes, ...)
are planted as findings into a copy of an audited run's DuckDB file: that is test data
for the renderer; the checks that produce them are proven in their own tests.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import duckdb
import pytest

from sftaudit.audit import audit
from sftaudit.cli import main
from sftaudit.ingest import database_path
from sftaudit.report import plotly_js, write_report
from sftaudit.report.evidence import blocks
from sftaudit.checks import registered_checks
from sftaudit.checks.base import EVIDENCE
from sftaudit.report.tables import envelope
from tests.conftest import NAN_STEP

XSS_SCRIPT = "<script>window.__xss = 1</script>"
XSS_IMG = '"><img src=x onerror="window.__xss = 2">'
XSS_FILE = f'model{XSS_IMG}.safetensors'

PLANTED = [
    {"code": "LOOP-04", "severity": "fail", "step": NAN_STEP - 2, "checkpoint": None,
     "message": f"sample {XSS_SCRIPT} trains its prompt tokens: mask the prompt before the assistant turn",
     "evidence": {
         "sample_ids": ["row-7", XSS_IMG],
         "text": f"user: hi {XSS_SCRIPT} {XSS_IMG}",
         "tokens": [
             {"pos": 0, "token": "<|user|>", "input_id": 1, "label": -100, "actual": "masked", "expected": "masked"},
             {"pos": 1, "token": XSS_SCRIPT, "input_id": 9, "label": 9, "actual": "trained", "expected": "masked"},
             {"pos": 2, "token": XSS_IMG, "input_id": 10, "label": 10, "actual": "trained", "expected": "masked"},
             {"pos": 3, "token": "<|assistant|>", "input_id": 2, "label": -100, "actual": "masked", "expected": "masked"},
             {"pos": 4, "token": " Paris\n", "input_id": 11, "label": 11, "actual": "trained", "expected": "trained"},
             {"pos": 5, "token": "<pad>", "input_id": 0, "label": -100, "actual": "padding", "expected": "padding"},
         ],
         "value": 0.4, "threshold": 0.001,
     }},
    {"code": "LOOP-07", "severity": "warn", "step": NAN_STEP + 2, "checkpoint": None,
     "message": "distinct-1 stayed below 0.35 for 3 evals in a row: decay the learning rate",
     "evidence": {"ngrams": [{"ngram": "the the the", "count": 41}, {"ngram": XSS_SCRIPT, "count": 7}],
                  "value": 0.21, "threshold": 0.35}},
    {"code": "LOOP-09", "severity": "fail", "step": None, "checkpoint": "checkpoint-20",
     "message": f"checkpoint-20 is missing 1 tensor in {XSS_FILE}: do not resume from it",
     "evidence": {"keys": {"missing": ["lm_head.weight"], "unexpected": [XSS_IMG]},
                  "dtypes": [{"tensor": "model.norm.weight", "dtype": "float32", "expected": "bfloat16"}],
                  "file": XSS_FILE}},
    {"code": "LOOP-05", "severity": "warn", "step": NAN_STEP - 1, "checkpoint": None,
     "message": "model.embed_tokens.weight gradient norm is 12x the mean across tensors",
     "evidence": {"tensors": [{"tensor": "model.embed_tokens.weight", "norm": 5.1, "ratio": 12.0}],
                  "histogram": {"tensor": "model.embed_tokens.weight", "step": NAN_STEP - 1, "edges": [-3, -2, -1, 0],
                                "counts": [5, 40, 3]},
                  "p_value": 1e-6, "effect_size": 3.2, "windows": [[1, 5], [6, 10]]}},
]
PLANTED_SERIES = [("LOOP-06", "top-5 spread", step, 0.02 + 0.01 * step, 0.08) for step in (10, 20)]
PLANTED_CHECK_ERROR = {"code": "LOOP-08", "error": f"ValueError: bad reference {XSS_SCRIPT}"}


def plant(audited_run: Path, dest: Path) -> Path:
    """A copy of an audited run's DuckDB file with the PLANTED findings added to its stored verdict."""
    shutil.copytree(database_path(audited_run).parent, dest / "sftaudit",
                    ignore=shutil.ignore_patterns("*.jsonl", "tokenizer"))
    con = duckdb.connect(str(database_path(dest)))
    try:
        verdict = json.loads(con.execute("SELECT verdict FROM audit_verdict").fetchall()[0][0])
        windows = sorted(verdict["checkpoints"], key=lambda c: c["step"])
        for f in PLANTED:
            f = dict(f)
            if f["checkpoint"] is None:
                f["checkpoint"] = next((c["name"] for c in windows if c["step"] >= f["step"]), None)
            verdict["findings"].append(f)
            for c in verdict["checkpoints"]:
                if c["name"] == f["checkpoint"]:
                    c["findings"].append(f)
            con.execute("INSERT INTO findings VALUES (?, ?, ?, ?, ?, ?)",
                        [f["code"], f["severity"], f["step"], f["checkpoint"], f["message"], json.dumps(f["evidence"])])
        verdict["findings"].sort(key=lambda f: (f["step"] is None, f["step"] or 0, f["code"]))
        verdict["verdict"] = "fail"
        verdict["first_anomalous_step"] = min(f["step"] for f in verdict["findings"] if f["step"] is not None)
        verdict["check_errors"].append(PLANTED_CHECK_ERROR)
        verdict["first_anomaly_chain"] = [{"code": "LOOP-04", "step": NAN_STEP - 2, "message": "prompt trained"},
                                          {"code": "LOOP-05", "step": NAN_STEP, "message": XSS_SCRIPT}]
        con.execute("DELETE FROM audit_verdict")
        con.execute("INSERT INTO audit_verdict VALUES (?)", [json.dumps(verdict)])
        con.executemany("INSERT INTO series VALUES (?, ?, ?, ?, ?)", PLANTED_SERIES)
    finally:
        con.close()
    return dest


@pytest.fixture(scope="module")
def planted_report(nan_run, tmp_path_factory) -> Path:
    audit(nan_run)
    run = plant(nan_run, tmp_path_factory.mktemp("planted") / "planted-run")
    return write_report(run, run.parent / "report")


@pytest.fixture(scope="module")
def clean_report(clean_run, tmp_path_factory) -> Path:
    audit(clean_run)
    return write_report(clean_run, tmp_path_factory.mktemp("clean-report"))


def test_clean_report_is_one_offline_file_with_plotly_inlined_once(clean_report):
    html = clean_report.read_text(encoding="utf-8")
    assert html.count("plotly.js (cartesian - minified) v") == 1  # the bundle's banner: inlined once, not per chart
    ours = html.replace(plotly_js(), "")  # (the bundle itself holds URLs in strings)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", ours)  # no CDN, no remote asset
    assert "PASS" in html and "No anomaly found in 30 recorded steps" in html
    assert 'id="timeline"' in html and 'id="grad-heatmap"' in html


def test_checks_without_data_degrade_to_a_note(clean_report):
    html = clean_report.read_text(encoding="utf-8")
    # The 30-step clean run records no generations or evals (dev profile: every 50 steps).
    assert "no data recorded for this check: no LOOP-07 statistics were stored" in html
    assert "no data recorded for this check: no LOOP-08 statistics were stored" in html
    for check in registered_checks():
        if set(check.needs) & {"generations", "evals"}:
            assert f"not run: not recorded: {EVIDENCE[check.needs[0]]}" in html, check.code


def test_nan_report_names_first_step_cause_and_rollback(planted_report):
    html = planted_report.read_text(encoding="utf-8")
    top = html[html.index('id="summary"'):html.index('id="findings"')]
    assert f"First anomalous step <b>{NAN_STEP - 2}</b>" in top  # the planted LOOP-04 finding comes first
    assert "sample &lt;script&gt;window.__xss" in top  # its message is the one-sentence cause
    assert "Roll back to <b>checkpoint-10</b>" in top
    assert "LOOP-05" in html and f"gradients became non-finite at step {NAN_STEP}" in html


def test_untrusted_text_is_escaped_everywhere(planted_report):
    html = planted_report.read_text(encoding="utf-8")
    assert "<script>window.__xss" not in html
    assert "<img src=x" not in html
    assert "&lt;script&gt;window.__xss = 1&lt;/script&gt;" in html  # shown as text
    assert "model&#34;&gt;&lt;img src=x" in html  # the file name, escaped, in the message


def test_evidence_conventions_render_as_their_own_blocks(planted_report):
    html = planted_report.read_text(encoding="utf-8")
    tokens = re.findall(r'<span class="tok (\w+)( mismatch)?" title=', html)
    assert len(tokens) == 6 and sum(1 for _, m in tokens if m) == 2  # pos 1 and 2 are trained but should be masked
    assert "2 mismatched" in html
    assert "most repeated n-grams" in html and "the the the" in html
    assert "missing keys (1)" in html and "lm_head.weight" in html and "unexpected keys (1)" in html
    assert "bfloat16" in html  # dtypes table
    assert "log10 |gradient| histogram of" in html and html.count('class="hbar"') == 3
    assert "p value" in html and "effect size" in html
    assert 'id="series-check-LOOP-06"' in html  # stored statistics drawn in the probe-stability section
    assert "could not run: ValueError: bad reference" in html
    assert "Chain of checks around the first anomaly" in html


def test_report_command_rebuilds_from_duckdb_without_rerunning_checks(planted_report, capsys):
    run = planted_report.parent.parent / "planted-run"
    out = planted_report.parent.parent / "rebuilt"
    assert main(["report", str(run), "--out", str(out)]) == 0
    html = (out / "report.html").read_text(encoding="utf-8")
    assert "the the the" in html  # a planted finding: only in the stored verdict, no check produces it


def test_report_command_on_an_unaudited_run_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "sftaudit").mkdir()
    duckdb.connect(str(database_path(tmp_path))).close()
    assert main(["report", str(tmp_path)]) == 2
    assert "not audited yet" in capsys.readouterr().err


def test_envelope_keeps_every_spike_and_flagged_step():
    con = duckdb.connect()
    con.execute("""CREATE TABLE t AS SELECT 0 AS seg, i AS step,
                   CASE WHEN i = 77777 THEN 1000.0 WHEN i = 123 THEN -50.0 ELSE sin(i / 100.0) END AS value
                   FROM range(1, 100001) r(i)""")
    shaped = envelope(con, "SELECT seg, step, value FROM t", [], keep_steps=[4242], buckets=500)
    assert shaped.height <= 2 * 500 + 1
    points = dict(zip(shaped["step"].to_list(), shaped["value"].to_list()))
    assert points[77777] == 1000.0 and points[123] == -50.0 and 4242 in points
    assert shaped["step"].to_list() == sorted(shaped["step"].to_list())


def test_unknown_evidence_shapes_become_tables():
    kinds = {b.get("label"): b["kind"] for b in blocks({
        "batches": [{"step": 1, "cv": 0.2}], "lengths": [1, 2, 3], "config": {"a": 1},
        "deep": {"a": {"b": [1]}},
        "samples": [{"sample_id": "s1", "tokens": PLANTED[0]["evidence"]["tokens"]}],
    })}
    assert kinds == {"batches": "table", "lengths": "list", "config": "scalars", "deep": "json", "samples": "group"}
