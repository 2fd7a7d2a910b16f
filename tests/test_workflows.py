"""The repository's GitHub files: the composite action (action.yml) and the docs site workflow.

The action's `run:` steps are run here as the runner runs them (`bash --noprofile --norc -eo pipefail`), with
the inputs substituted as GitHub substitutes `${{ }}` expressions, on a run built in the test. GitHub itself
(setup-python, the Pages deployment) cannot run here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from sftaudit.outputs.report.evidence import DOCS_URL
from tests.github_runs import TIMEOUT_S, failed_run, parse_command

ROOT = Path(__file__).resolve().parents[1]
ACTION = yaml.safe_load((ROOT / "action.yml").read_text(encoding="utf-8"))
DOCS = yaml.safe_load((ROOT / ".github" / "workflows" / "docs.yml").read_text(encoding="utf-8"))
BASH = ["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c"]  # GitHub's `shell: bash`
EXPRESSION = re.compile(r"\$\{\{\s*([\w.-]+)\s*\}\}")


def expand(value: str, context: dict[str, str]) -> str:
    """`${{ name }}` expressions replaced by their values, as GitHub does before a step runs."""
    return EXPRESSION.sub(lambda m: context[m.group(1)], str(value))


def action_steps(inputs: dict[str, str], action_path: Path) -> list[tuple[str, dict[str, str]]]:
    """The action's shell steps (script, env) for these inputs (the others take their defaults)."""
    unknown = set(inputs) - set(ACTION["inputs"])
    assert not unknown, unknown
    context = {f"inputs.{k}": inputs.get(k, v.get("default", "")) for k, v in ACTION["inputs"].items()}
    context["github.action_path"] = str(action_path)
    return [
        (expand(s["run"], context), {k: expand(v, context) for k, v in (s.get("env") or {}).items()})
        for s in ACTION["runs"]["steps"]
        if "run" in s
    ]


def run_step(script: str, env: dict[str, str], cwd: Path, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*BASH, script],
        cwd=cwd,
        env={**os.environ, **env, **extra},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


def annotations(stdout: str) -> list[tuple[str, dict[str, str], str]]:
    return [c for c in map(parse_command, stdout.splitlines()) if c and c[0] in ("error", "warning")]


def test_the_action_is_a_composite_that_installs_from_its_checkout_without_torch():
    assert ACTION["runs"]["using"] == "composite"
    assert ACTION["inputs"]["run-dir"]["required"] is True
    assert {k: v.get("default") for k, v in ACTION["inputs"].items() if k != "run-dir"} == {
        "checkpoint": "",
        "python-version": "3.12",
        "strict": "false",
        "args": "",
    }
    setup, *shell = ACTION["runs"]["steps"]
    assert (
        setup["uses"].startswith("actions/setup-python@") and "inputs.python-version" in setup["with"]["python-version"]
    )
    assert all(s["shell"] == "bash" for s in shell)
    # An input is never spliced into a script (a run-dir named `$(curl ...)` stays a name): env only.
    assert not any("${{" in s["run"] for s in shell)
    assert shell[0]["run"].startswith("python -m pip install") and '"$GITHUB_ACTION_PATH"' in shell[0]["run"]
    # What it installs needs no torch: no step asks for it, and the package's own dependencies hold none.
    assert not any("torch" in s["run"] for s in shell)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert not any(re.match(r"torch\b", d) for d in project["dependencies"])


def test_the_action_audits_with_annotations_and_its_exit_code(tmp_path):
    """The audit step as the runner runs it, `sftaudit` being this checkout's (the install step is the slow
    test below)."""
    run = failed_run(tmp_path, "runs with spaces")
    summary = tmp_path / "summary.md"
    path = {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "GITHUB_STEP_SUMMARY": str(summary),
    }
    _, (audit_step, env) = action_steps({"run-dir": run.name, "args": "--no-report"}, ROOT)
    audited = run_step(audit_step, env, tmp_path, **path)
    assert audited.returncode == 1, audited.stderr
    assert any(n == "error" and d.startswith("loss became non-finite") for n, _, d in annotations(audited.stdout))
    assert (tmp_path / "reports" / "runs_with_spaces" / "verdict.json").is_file()
    assert not (tmp_path / "reports" / "runs_with_spaces" / "report.html").exists()  # `args` reached the command
    assert summary.read_text(encoding="utf-8").startswith("## sftaudit audit\n\n**Verdict: ❌ FAIL**")
    # An input that looks like shell is a plain argument: could not judge (exit 2), nothing executed.
    _, (step, env) = action_steps({"run-dir": "$(touch pwned)"}, ROOT)
    refused = run_step(step, env, tmp_path, **path)
    assert refused.returncode == 2 and not (tmp_path / "pwned").exists()
    assert [(n, d) for n, _, d in annotations(refused.stdout)] == [("error", "$(touch pwned): no such run directory")]


@pytest.mark.slow
def test_the_action_gates_a_checkpoint_when_given_one(tmp_path):
    """A checkpoint: the gate; strict, so warn findings block too; `args` split on spaces."""
    run = failed_run(tmp_path)
    summary = tmp_path / "summary.md"
    path = {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "GITHUB_STEP_SUMMARY": str(summary),
    }
    inputs = {"run-dir": run.name, "checkpoint": "checkpoint-80", "strict": "true", "args": "--json gate.json"}
    _, (gate_step, env) = action_steps(inputs, ROOT)
    gated = run_step(gate_step, env, tmp_path, **path)
    assert gated.returncode == 0, gated.stderr
    assert (tmp_path / "gate.json").is_file() and "## sftaudit gate\n\n**✅ PASS**" in summary.read_text(
        encoding="utf-8"
    )
    inputs["checkpoint"] = "checkpoint-100"
    _, (gate_step, env) = action_steps(inputs, ROOT)
    blocked = run_step(gate_step, env, tmp_path, **path)
    assert blocked.returncode == 1 and any(n == "error" for n, _, _ in annotations(blocked.stdout))


@pytest.mark.slow
def test_the_action_installs_sftaudit_from_its_own_checkout(tmp_path):
    """The install step, run for real on a copy of this checkout (what `uses:` checks out), offline: pip builds
    the wheel here and installs it without dependencies into a folder the audit step then runs from."""
    checkout = tmp_path / "action"
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    for name in files:
        if (ROOT / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, checkout / name)
    site = tmp_path / "site"
    offline = {"PIP_NO_INDEX": "1", "PIP_NO_DEPS": "1", "PIP_TARGET": str(site), "PIP_NO_BUILD_ISOLATION": "0"}
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    (install, install_env), (audit_step, env) = action_steps({"run-dir": "run"}, checkout)
    installed = run_step(install, install_env, tmp_path, PATH=path, GITHUB_ACTION_PATH=str(checkout), **offline)
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
    assert (site / "sftaudit" / "cli.py").is_file() and (site / "bin" / "sftaudit").is_file()
    assert not list(site.glob("torch*"))
    failed_run(tmp_path)
    from_site = {"PATH": f"{site / 'bin'}{os.pathsep}{path}", "PYTHONPATH": str(site)}
    where = run_step('python -c "import sftaudit; print(sftaudit.__file__)"', {}, tmp_path, **from_site)
    assert where.stdout.strip() == str(site / "sftaudit" / "__init__.py")
    audited = run_step(audit_step, env, tmp_path, **from_site)
    assert audited.returncode == 1, audited.stderr
    assert any(n == "error" for n, _, _ in annotations(audited.stdout))


def test_the_docs_site_is_built_strict_and_deployed_to_pages():
    build, deploy = DOCS["jobs"]["build"], DOCS["jobs"]["deploy"]
    scripts = "\n".join(s.get("run", "") for s in build["steps"])
    assert "mkdocs build --strict" in scripts
    uses = [s.get("uses", "").split("@")[0] for s in build["steps"] + deploy["steps"]]
    assert {"actions/configure-pages", "actions/upload-pages-artifact", "actions/deploy-pages"} <= set(uses)
    assert deploy["needs"] == "build" and deploy["permissions"] == {"pages": "write", "id-token": "write"}
    assert DOCS[True]["push"]["branches"] == ["main"]  # (YAML 1.1 reads the `on:` key as true)


@pytest.mark.parametrize("pages", [DOCS_URL, DOCS_URL + "/", "https://someone.github.io/sftaudit"])
def test_the_docs_workflow_fails_when_pages_is_not_where_the_reports_link(pages, tmp_path):
    """The check step, run on this checkout with the address configure-pages would give."""
    [check] = [s for s in DOCS["jobs"]["build"]["steps"] if "PAGES_URL" in (s.get("env") or {})]
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    done = run_step(check["run"], {"PAGES_URL": pages}, ROOT, PATH=path)
    assert (done.returncode == 0) == (pages.rstrip("/") == DOCS_URL), done.stderr
    if done.returncode:
        assert "set both it and DOCS_URL" in done.stderr


def test_the_documentation_address_is_declared_once_for_the_package():
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["urls"]
    assert urls["Documentation"] == DOCS_URL
    assert re.fullmatch(r"https://[a-z0-9-]+\.github\.io/[A-Za-z0-9._-]+", DOCS_URL)  # a Pages project site
