"""No PASS without evidence: missing, unreadable or crashing evidence makes the verdict unjudged (exit 2,
one line naming what and where); unreadable lines are counted and shown."""

import json
import shutil
import subprocess
import sys

import pytest

from sftaudit.core.artifacts import TOKENIZER_DIR, artifact_root, rank_dir, series_dir
from sftaudit.verdict.audit import audit
from sftaudit.verdict.config import AuditConfig


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "sftaudit.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def copy_run(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("audit.duckdb*"))
    return dst


def one_line_exit_2(result, *words):
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    for w in words:
        assert w in result.stderr, result.stderr


def rewrite(path, change):
    lines = path.read_bytes().splitlines()
    path.write_bytes(b"".join(change(line) + b"\n" for line in lines))


def test_a_single_bare_step_record_is_unjudged(clean_run, tmp_path):
    run = tmp_path / "bare"
    rank_dir(run, 0).mkdir(parents=True)
    shutil.copy(rank_dir(clean_run, 0) / "manifest.jsonl", rank_dir(run, 0))
    (rank_dir(run, 0) / "steps.jsonl").write_text('{"seg": 0, "step": 1, "loss": 1.0}\n')
    result = run_cli("audit", run, "--no-report", "--out", tmp_path / "out")
    one_line_exit_2(result, "could not judge", "1 of 1 recorded steps lack their batch records", "re-record the run")
    assert json.loads((tmp_path / "out" / "verdict.json").read_text())["verdict"] == "unjudged"


def test_a_run_without_batch_or_gradient_records_is_unjudged(clean_run, tmp_path):
    run = copy_run(clean_run, tmp_path / "run")
    (rank_dir(run, 0) / "batches.jsonl").unlink()
    rewrite(
        rank_dir(run, 0) / "steps.jsonl", lambda line: json.dumps({**json.loads(line), "grad_norms": None}).encode()
    )
    shutil.rmtree(series_dir(run, 0))  # schema version 2 keeps the norms in the columnar series
    verdict = audit(run)
    assert verdict["verdict"] == "unjudged"
    assert "30 of 30 recorded steps lack their batch records" in verdict["cannot_judge"]
    assert "30 of 30 recorded steps lack their gradient norms" in verdict["cannot_judge"]


@pytest.mark.parametrize(
    "poison",
    [
        lambda line: b"\x00" * len(line),  # NUL bytes (a sparse or zeroed file)
        lambda line: line.replace(b'"rows":8', b'"rows":"eight"'),  # a field of the wrong type
    ],  # (lone surrogates in the sample ids are kept, escaped: test_run_database.py)
)
def test_a_run_whose_batch_records_are_all_unreadable_is_unjudged(clean_run, tmp_path, poison):
    run = copy_run(clean_run, tmp_path / "run")
    rewrite(rank_dir(run, 0) / "batches.jsonl", poison)
    result = run_cli("audit", run, "--no-report", "--out", tmp_path / "out")
    one_line_exit_2(result, "of the 30 lines of rank-0/batches.jsonl are unreadable")
    verdict = json.loads((tmp_path / "out" / "verdict.json").read_text())
    assert verdict["verdict"] == "unjudged"
    assert verdict["evidence"]["bad_lines"] == [{"file": "rank-0/batches.jsonl", "lines": 30, "of": 30}]
    assert "unreadable lines: 30 of 30 in rank-0/batches.jsonl" in result.stdout


def test_one_bad_line_is_shown_and_judged_against_the_allowed_share(clean_run, tmp_path):
    run = copy_run(clean_run, tmp_path / "run")
    batches = rank_dir(run, 0) / "batches.jsonl"
    lines = batches.read_bytes().splitlines(keepends=True)
    lines[4] = b'{"seg": 0, "step": 5, \x00garbage\n'
    batches.write_bytes(b"".join(lines))
    strict = audit(run)  # 1 of 30 lines (3%) is more than the default 1%
    assert strict["verdict"] == "unjudged" and "1 of the 30 lines of rank-0/batches.jsonl" in strict["cannot_judge"]
    loose = audit(run, AuditConfig(max_missing_share=0.05))
    assert loose["verdict"] in ("pass", "warn") and loose["cannot_judge"] is None
    assert loose["evidence"]["bad_lines"] == [{"file": "rank-0/batches.jsonl", "lines": 1, "of": 30}]
    assert any("1 of the 30 lines of rank-0/batches.jsonl are unreadable" in p for p in loose["evidence"]["partial"])
    [missing] = loose["evidence"]["missing"]  # the step whose batch record was lost
    assert (missing["rank"], missing["steps"], missing["of"], missing["first_step"]) == (0, 1, 30, 5)


# The CLI with LOOP-05 made to raise as a check with a bug would: what sftaudit does then is under test, not the bug.
_CRASHING_LOOP05 = """
import sys
from sftaudit.checks.loop05_gradient_norm import GradientNormAnomaly
def broken(self, ctx):
    raise ValueError("operands could not be broadcast together with shapes (40,) (30,)")
GradientNormAnomaly.run = broken
from sftaudit.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_cli_with_a_crashing_check(*args):
    return subprocess.run(
        [sys.executable, "-c", _CRASHING_LOOP05, *map(str, args)], capture_output=True, text=True, timeout=600
    )


def test_a_check_that_crashes_makes_audit_and_gate_exit_2(nan_run, tmp_path):
    """A check that raises (LOOP-05, made to): a NaN run that would otherwise FAIL cannot be judged, and says
    which check, why, and how to go on."""
    run = copy_run(nan_run, tmp_path / "run")
    result = run_cli_with_a_crashing_check("audit", run, "--no-report", "--out", tmp_path / "out")
    one_line_exit_2(result, "check LOOP-05 failed to run", 'disable it in the config ([audit] disable = ["LOOP-05"')
    verdict = json.loads((tmp_path / "out" / "verdict.json").read_text())
    assert verdict["verdict"] == "unjudged" and "LOOP-05" in verdict["evidence"]["checks_not_run"]
    assert {c["code"]: c["status"] for c in verdict["checks"]}["LOOP-05"] == "error"
    result = run_cli_with_a_crashing_check(
        "gate", run, "--checkpoint", "checkpoint-10", "--junit", tmp_path / "gate.xml"
    )
    one_line_exit_2(result, "check LOOP-05 failed to run")
    assert not (tmp_path / "gate.xml").exists()


def test_steps_recorded_twice_are_refused_before_any_check_runs(nan_run, tmp_path):
    """Duplicated step records (they crashed LOOP-05 and LOOP-10 once): refused at ingest in one line."""
    run = copy_run(nan_run, tmp_path / "run")
    steps = rank_dir(run, 0) / "steps.jsonl"
    steps.write_bytes(steps.read_bytes() * 2)
    one_line_exit_2(run_cli("audit", run, "--no-report", "--out", tmp_path / "out"), "more than once in segment 0")


def test_a_preflight_where_no_sample_renders_is_never_a_pass(clean_run, tmp_path):
    """Every row fails to render: LOOP-01 fails naming them; with LOOP-01 switched off nothing says
    why, and the preflight cannot be judged."""
    data = tmp_path / "rows.jsonl"
    data.write_text('{"id": "a", "text": "no messages"}\n{"id": "b", "text": "none here"}\n')
    config = tmp_path / "audit.toml"
    config.write_text('[audit]\ndisable = ["LOOP-01"]\n')
    args = [
        "preflight",
        "--data",
        data,
        "--tokenizer",
        artifact_root(clean_run) / TOKENIZER_DIR,
        "--no-report",
        "--quiet",
    ]
    result = run_cli(*args, "--out", tmp_path / "out")
    assert result.returncode == 1 and "LOOP-01 fail" in result.stdout and "fail to render" in result.stdout
    result = run_cli(*args, "--out", tmp_path / "off", "--config", config)
    one_line_exit_2(result, "no sample of the 2 dataset rows rendered", "fix the rows or the chat template")
    verdict = json.loads((tmp_path / "off" / "verdict.json").read_text())
    assert verdict["verdict"] == "unjudged" and verdict["evidence"]["dataset"]["rendered"] == 0
