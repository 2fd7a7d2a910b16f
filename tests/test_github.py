"""GitHub Actions: workflow-command annotations, the step summary, and `audit`/`gate --github` in a real
subprocess with a step summary file, read back as the Actions runner reads them (`parse_command`)."""

from __future__ import annotations

import io
import os
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sftaudit.core.terminal import shown
from sftaudit.outputs import github
from tests.github_runs import HOSTILE, cli, failed_verdict, parse_command, shared_failed_run

LEVELS = ("error", "warning")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return shared_failed_run(tmp_path_factory)


@pytest.fixture(scope="module")
def verdict(tmp_path_factory):
    return failed_verdict(tmp_path_factory)


def commands(stdout: str) -> list[tuple[str, dict[str, str], str]]:
    return [c for c in map(parse_command, stdout.splitlines()) if c is not None]


def printed(stdout: str) -> tuple[list[str], list[tuple[str, dict[str, str], str]]]:
    """The lines printed with workflow commands off (between `::stop-commands::TOKEN` and `::TOKEN::`, a token
    nobody can guess), and the commands the runner obeys after them."""
    lines = stdout.splitlines()
    assert lines[0].startswith("::stop-commands::")
    token = lines[0].split("::")[2]
    end = lines.index(f"::{token}::")
    assert len(token) == 32 and all(token not in line for line in lines[1:end])
    return lines[1:end], commands("\n".join(lines[end + 1 :]))


@settings(max_examples=300, deadline=None)
@given(st.text(), st.text(), st.text())
def test_each_command_is_one_line_the_runner_reads_back_as_written(message, title, file):
    line = github.command("warning", message, title=title, file=file)
    assert "\n" not in line and "\r" not in line
    name, props, data = parse_command(line)
    assert (name, data) == ("warning", shown(message))
    # The runner trims the properties and drops an empty one; the rest come back whole, `:`, `,` and `=` too.
    assert props == {k: shown(v).strip() for k, v in (("title", title), ("file", file)) if shown(v).strip()}


@pytest.mark.parametrize("hostile", HOSTILE)
def test_hostile_text_cannot_start_another_command(hostile):
    line = github.command("error", f"before {hostile} after", title=hostile)
    assert len(line.splitlines()) == 1  # a `::` or `##[` in the data is data: the runner parses a line once
    assert parse_command(line) == ("error", {"title": shown(hostile)}, shown(f"before {hostile} after"))


def test_escaping_follows_the_runner():
    assert github.data("100%\r\n") == "100%25\\x0d\\x0a"  # line breaks are shown as escapes before anything else
    assert github.data("50% a:b,c") == "50%25 a:b,c"
    assert github.prop("50% a:b,c") == "50%25 a%3Ab%2Cc"


def test_audit_annotations_stay_within_githubs_caps(verdict, tmp_path):
    base = verdict["findings"][0]
    findings = [{**base, "severity": "fail", "code": "LOOP-05", "message": f"fail {i}"} for i in range(25)]
    findings += [{**base, "severity": "warn", "code": f"LOOP-{10 + i % 3}", "message": f"warn {i}"} for i in range(13)]
    findings += [{**base, "severity": "info", "message": "info"}]
    lines = commands(github.annotations({**verdict, "findings": findings}, "runs/x"))
    for level in LEVELS:
        assert sum(name == level for name, _, _ in lines) == github.ANNOTATIONS_PER_LEVEL
    errors = [c for c in lines if c[0] == "error"]
    assert [data for _, _, data in errors[:9]] == [f"fail {i}" for i in range(9)]
    assert errors[-1][2].startswith("16 more errors not annotated (GitHub shows 10 per step): LOOP-05")
    warnings = [c for c in lines if c[0] == "warning"]
    assert warnings[-1][2].startswith(
        "4 more warnings not annotated (GitHub shows 10 per step): LOOP-10, LOOP-11, LOOP-12;"
    )
    # --strict: warn findings block too, so they are errors.
    strict = commands(github.annotations({**verdict, "findings": findings[25:]}, "runs/x", strict=True))
    assert {name for name, _, _ in strict} == {"error"} and len(strict) == 10


def test_a_checkpoint_finding_points_at_the_checkpoint_folder(verdict):
    finding = {**verdict["findings"][0], "severity": "fail", "scope": "checkpoint", "checkpoint": "checkpoint-80"}
    finding["step"] = 80
    [(name, props, _)] = commands(github.annotations({**verdict, "findings": [finding]}, "runs/sft"))
    assert name == "error" and props["file"] == "runs/sft/checkpoint-80"
    assert props["title"] == f"{finding['code']} fail at step 80 (checkpoint-80)"


def test_a_gate_annotates_what_blocks_as_errors_and_the_rest_as_warnings(verdict):
    fail, warn = ({**verdict["findings"][0], "severity": s, "message": s} for s in ("fail", "warn"))
    ignored = {**fail, "code": "LOOP-07", "message": "ignored"}
    gate = {"findings": [fail, warn, ignored], "blocking": [fail]}
    lines = commands(github.annotations(verdict, "r", gate=gate))
    assert [(name, data) for name, _, data in lines] == [("error", "fail"), ("warning", "warn"), ("warning", "ignored")]


def test_the_summary_is_cut_at_a_line_within_the_limit(tmp_path):
    long = "".join(f"| row {i} | {'x' * 100} |\n" for i in range(30_000))  # about 3 MiB
    cut = github.summary(long)
    assert len(cut.encode()) <= github.SUMMARY_LIMIT and cut.endswith(github.TRUNCATED)
    assert long.startswith(cut[: -len(github.TRUNCATED)]) and cut[: -len(github.TRUNCATED)].endswith("|\n")
    assert github.summary("short\n") == "short\n"
    # Appended to a step summary that already holds most of the limit: the file stays within it.
    path = tmp_path / "summary.md"
    path.write_text("a" * (github.SUMMARY_LIMIT - 5000) + "\n")
    out = io.StringIO()
    github.publish("::notice::x\n", long, str(path), out)
    assert out.getvalue() == "::notice::x\n" and path.stat().st_size <= github.SUMMARY_LIMIT
    assert path.read_text().endswith(github.TRUNCATED)


def test_audit_github_prints_annotations_and_appends_the_step_summary(run, tmp_path):
    summary = tmp_path / "step_summary.md"
    summary.write_text("# an earlier step's summary\n")
    env = {**os.environ, "GITHUB_STEP_SUMMARY": str(summary)}
    result = cli("audit", run, "--out", tmp_path / "out", "--no-report", "--github", cwd=tmp_path, env=env)
    assert result.returncode == 1, result.stderr
    # The terminal summary (it quotes the run's text) is printed with workflow commands off.
    human, annotations = printed(result.stdout)
    assert human[0].startswith("run: FAIL")
    assert annotations and all(name in LEVELS for name, _, _ in annotations)
    errors = [data for name, _, data in annotations if name == "error"]
    assert any(data.startswith("loss became non-finite") for data in errors)
    text = summary.read_text(encoding="utf-8")
    assert text.startswith("# an earlier step's summary\n## sftaudit audit\n\n**Verdict: ❌ FAIL** for run run.")
    assert "- **Roll back to:** checkpoint-80" in text and "| transformers | 4.45.2 |" in text


def test_a_hostile_run_name_cannot_command_the_runner(run, tmp_path):
    hostile = tmp_path / "::warning::owned ##[error]legacy %0A"
    shutil.copytree(run, hostile, ignore=shutil.ignore_patterns("sftaudit"))
    env = {k: v for k, v in os.environ.items() if k != "GITHUB_STEP_SUMMARY"}  # outside Actions: annotations only
    result = cli("audit", hostile, "--out", tmp_path / "out", "--no-report", "--github", cwd=tmp_path, env=env)
    assert result.returncode == 1, result.stderr
    assert not list(tmp_path.glob("*.md"))
    human, annotations = printed(result.stdout)
    assert "::warning::owned ##[error]legacy %0A" in human[0]
    # After the runner resumes, every line is one of our annotations, the run's name inside it as data.
    after = result.stdout.splitlines()[len(human) + 2 :]
    assert after and all(line.startswith(("::error ", "::warning ")) for line in after)
    assert len(annotations) == len(after)


@pytest.mark.slow
def test_gate_github_summarises_the_gate_and_exit_2_is_an_error_annotation(run, tmp_path):
    summary = tmp_path / "step_summary.md"
    env = {**os.environ, "GITHUB_STEP_SUMMARY": str(summary)}
    passed = cli("gate", run, "--checkpoint", "checkpoint-80", "--github", cwd=tmp_path, env=env)
    assert passed.returncode == 0, passed.stderr
    assert all(name != "error" for name, _, _ in printed(passed.stdout)[1])
    text = summary.read_text(encoding="utf-8")
    assert text.startswith("## sftaudit gate\n\n**✅ PASS**: checkpoint checkpoint-80 (step 80) of run run.")
    assert "\n### The run's audit\n\n**Verdict: ❌ FAIL**" in text
    failed = cli("gate", run, "--checkpoint", "checkpoint-100", "--github", cwd=tmp_path, env=env)
    assert failed.returncode == 1
    assert any(n == "error" and d.startswith("loss became non-finite") for n, _, d in printed(failed.stdout)[1])
    assert "**❌ FAIL**: checkpoint checkpoint-100" in summary.read_text(encoding="utf-8")
    # Could not judge (exit 2): the one line on stderr, and an error annotation.
    unknown = cli("gate", tmp_path / "nowhere", "--checkpoint", "best", "--github", cwd=tmp_path, env=env)
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1
    [(name, props, data)] = commands(unknown.stdout)
    assert name == "error" and props["title"] == "sftaudit gate: could not judge"
    assert data == f"{tmp_path / 'nowhere'}: no such run directory"
