"""Every registered check: a stable code, its docs in the fixed sections, its own tests, no crash on real runs."""

import re
from pathlib import Path

from sftaudit.checks import registered_checks
from sftaudit.checks.base import DOC_SECTIONS, EVIDENCE, needed
from sftaudit.verdict.audit import audit
from sftaudit.verdict.config import AuditConfig

from ..shared import cached_audit

HERE = Path(__file__).parent


def test_codes_are_stable_unique_and_numbered_by_their_file():
    checks = registered_checks()
    codes = [c.code for c in checks]
    assert len(codes) == len(set(codes)) and all(re.fullmatch(r"LOOP-\d\d", c) for c in codes)
    for check in checks:
        assert check.__module__.rsplit(".", 1)[1].startswith("loop" + check.code[-2:] + "_"), check
        assert check.name and isinstance(check.defaults, dict)


def test_every_check_documents_its_sections_in_order():
    for check in registered_checks():
        doc = check.__doc__ or ""
        positions = [doc.find(f"{section}:") for section in DOC_SECTIONS]
        assert -1 not in positions and positions == sorted(positions), (check.code, positions)


def test_every_check_has_its_own_test_file():
    for check in registered_checks():
        module = check.__module__.rsplit(".", 1)[1]
        assert (HERE / f"test_{module}.py").is_file(), f"{check.code}: tests/checks/test_{module}.py is missing"


def test_no_check_crashes_on_the_clean_and_the_failed_run(clean_run, nan_run):
    for run in (clean_run, nan_run):
        assert audit(run)["check_errors"] == []


def test_every_check_names_the_evidence_it_needs():
    for check in registered_checks():
        assert check.needs and set(needed(check) + list(check.uses)) <= set(EVIDENCE), check.code


def test_coverage_says_which_checks_ran_and_why_the_others_did_not(clean_run):
    coverage = {c["code"]: c for c in cached_audit(clean_run)["checks"]}
    assert set(coverage) == {c.code for c in registered_checks()}
    # The 30-step clean run records steps and gradients but no generations or evals (dev profile).
    assert coverage["LOOP-05"]["status"] == "ran" and coverage["LOOP-05"]["sources"] == ["shim"]
    assert coverage["LOOP-07"] == {
        "code": "LOOP-07",
        "name": "generation diversity",
        "status": "not_run",
        "reason": "not recorded: generations on the probe prompts",
        "evidence": [],
        "sources": [],
    }
    assert cached_audit(clean_run, AuditConfig(disabled=["LOOP-10"]))["checks"][9]["status"] == "disabled"
