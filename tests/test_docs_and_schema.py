"""Contracts declared once: verdict.json validates against its published JSON Schema; the per-check
docs pages are generated from the checks and never drift; the docs site builds in strict mode."""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from sftaudit.checks.base import Finding
from sftaudit.core.artifacts import SCHEMA_VERSION, rank_dir
from sftaudit.verdict.attribution import build_verdict
from sftaudit.verdict.audit import audit

from .shared import cached_audit

ROOT = Path(__file__).resolve().parents[1]


def validator() -> Draft202012Validator:
    schema = json.loads((importlib.resources.files("sftaudit") / "schema" / "verdict.schema.json").read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def assert_valid(verdict: dict) -> None:
    errors = sorted(validator().iter_errors(json.loads(json.dumps(verdict))), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors[:5]]


def test_pass_and_fail_verdicts_follow_the_schema(clean_run, nan_run):
    passed, failed = cached_audit(clean_run), cached_audit(nan_run)
    assert (passed["verdict"], failed["verdict"]) == ("pass", "fail")
    assert passed["schema_version"] == SCHEMA_VERSION
    assert_valid(passed)
    assert_valid(failed)


def test_warn_and_unjudged_verdicts_follow_the_schema(clean_run, tmp_path):
    passed = cached_audit(clean_run)
    warned = build_verdict(
        passed["run"],
        [Finding("LOOP-03", "warn", "padding wastes 70% of the batch", step=3)],
        passed["checkpoints"],
        [],
        1,
        passed["evidence"],
    ).to_dict() | {"checks": passed["checks"]}
    assert warned["verdict"] == "warn"
    assert_valid(warned)
    # A run whose step records are gone cannot be judged: unjudged, never pass.
    stripped = Path(shutil.copytree(clean_run, tmp_path / "stripped"))
    (rank_dir(stripped, 0) / "steps.jsonl").write_text("")
    unjudged = audit(stripped)
    assert unjudged["verdict"] == "unjudged" and unjudged["cannot_judge"]
    assert_valid(unjudged)


def test_a_verdict_with_a_wrong_field_is_refused_by_the_schema(clean_run):
    broken = cached_audit(clean_run) | {"verdict": "ok"}
    assert list(validator().iter_errors(broken))


def test_the_architecture_page_is_generated_from_the_import_contracts():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_architecture.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_check_pages_are_generated_from_the_checks():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_check_pages.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(
    shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None,
    reason="mkdocs-material is a test dependency; not installed here",
)
@pytest.mark.slow
def test_docs_site_builds_strict(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    done = subprocess.run(
        [mkdocs, "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_verdict_schema_is_generated_from_the_verdict_types():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_verdict_schema.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_the_verdict_types_never_need_pydantic():
    # pydantic generates the schema (a test/dev dependency): the analyzer imports the types without it.
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['pydantic'] = None; import sftaudit.schema.verdict, sftaudit.verdict.attribution",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


def test_the_golden_schema_is_generated_from_its_declaration():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_golden_schema.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
