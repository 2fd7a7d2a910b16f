"""SARIF 2.1.0 from a verdict: the audit where code-scanning views show lint.

One rule per registered check (id `LOOP-NN`, its name, its docstring's summary and "What it detects",
a link to its docs page); one result per warn/fail finding, `error` for fail and `warning` for warn,
located at the artifact file the check read (the checkpoint folder for a checkpoint finding) with a
logical location naming the step and tensor. Checks that did not run, or judged only part of the
run's evidence, are the invocation's notifications (with the reason), never passing results.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .._version import __version__
from ..checks import registered_checks
from ..checks.base import alternatives
from ..core.artifacts import ARTIFACT_DIR, GRAD_SERIES, SERIES_DIR
from .report.evidence import check_doc, check_page

SARIF_SCHEMA = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
LEVELS = {"fail": "error", "warn": "warning"}
RUN_BASE = "RUN_DIR"  # results' file locations are relative to the audited run folder
# The artifact a kind of evidence is read from (rank 0's folder; imported runs are written there too).
EVIDENCE_FILES = {
    "steps": "steps",
    "batches": "batches",
    "samples": "samples",
    "probes": "probes",
    "generations": "generations",
    "evals": "evals",
    "checkpoints": "checkpoints",
    "metrics": "metrics",
    "tokenizer": "manifest",
    "chat_template": "manifest",
}


def to_sarif(verdict: dict[str, Any], run_dir: str | Path) -> dict[str, Any]:
    """The verdict as one SARIF run, each rule linking its check's documentation page."""
    checks = registered_checks()
    index = {c.code: i for i, c in enumerate(checks)}
    rules = [_rule(c) for c in checks]
    files = {c.code: _artifact(c) for c in checks}
    results = [_result(f, index, files) for f in verdict["findings"] if f["severity"] in LEVELS and f["code"] in index]
    notes = [
        {
            "level": "error" if c["status"] == "error" else "note",
            "message": {"text": f"{c['code']} {c['status'].replace('_', ' ')}: {c['reason']}"},
            "descriptor": {"id": c["code"], "index": index[c["code"]]},
        }
        for c in verdict.get("checks", [])
        if c["status"] in ("not_run", "partial", "error") and c["code"] in index
    ]
    if verdict.get("cannot_judge"):
        notes.append({"level": "error", "message": {"text": f"the run cannot be judged: {verdict['cannot_judge']}"}})
    return {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {"driver": {"name": "sftaudit", "version": __version__, "rules": rules}},
                "originalUriBaseIds": {RUN_BASE: {"uri": Path(run_dir).resolve().as_uri() + "/"}},
                "invocations": [
                    {"executionSuccessful": verdict["verdict"] != "unjudged", "toolExecutionNotifications": notes}
                ],
                "results": results,
                "properties": {
                    "verdict": verdict["verdict"],
                    "first_anomalous_step": verdict["first_anomalous_step"],
                    "rollback_checkpoint": verdict["rollback_checkpoint"],
                },
            }
        ],
    }


def write_sarif(verdict: dict[str, Any], run_dir: str | Path, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(to_sarif(verdict, run_dir), indent=1, ensure_ascii=False), encoding="utf-8")
    return path


def _rule(check) -> dict[str, Any]:
    doc = check_doc(check)
    detects = dict(doc["sections"]).get("What it detects", doc["summary"])
    return {
        "id": check.code,
        "name": check.name.title().replace(" ", "").replace("-", ""),
        "shortDescription": {"text": doc["summary"]},
        "fullDescription": {"text": detects},
        "helpUri": check_page(check.code),
        "help": {"text": "\n\n".join(f"{name}: {body}" for name, body in doc["sections"])},
        "properties": {"name": check.name},
    }


def _artifact(check) -> str:
    first = alternatives(check)[0][0]
    if first == "grad_norms":  # per-tensor norms: rank 0's part of the columnar series (schema version 2)
        return f"{ARTIFACT_DIR}/{SERIES_DIR}/{GRAD_SERIES}/rank=0/"
    return f"{ARTIFACT_DIR}/rank-0/{EVIDENCE_FILES.get(first, 'steps')}.jsonl"


def _result(finding: dict[str, Any], index: dict[str, int], files: dict[str, str]) -> dict[str, Any]:
    about_checkpoint = finding["scope"] == "checkpoint" and finding["checkpoint"]
    uri = finding["checkpoint"] if about_checkpoint else files[finding["code"]]
    logical = []
    if finding["step"] is not None:
        logical.append({"name": f"step {finding['step']}", "kind": "step"})
    tensor = _tensor(finding["evidence"])
    if tensor:
        logical.append({"name": tensor, "fullyQualifiedName": tensor, "kind": "tensor"})
    if finding["checkpoint"]:
        logical.append({"name": finding["checkpoint"], "kind": "checkpoint"})
    location: dict[str, Any] = {"physicalLocation": {"artifactLocation": {"uri": uri, "uriBaseId": RUN_BASE}}}
    if logical:
        location["logicalLocations"] = logical
    return {
        "ruleId": finding["code"],
        "ruleIndex": index[finding["code"]],
        "level": LEVELS[finding["severity"]],
        "message": {"text": finding["message"]},
        "locations": [location],
        "properties": {
            "category": finding.get("category", "anomaly"),
            "step": finding["step"],
            "checkpoint": finding["checkpoint"],
        },
    }


def _tensor(evidence: dict[str, Any]) -> str | None:
    """The first tensor a finding names (`tensor`, or the first of `tensors`)."""
    if isinstance(evidence.get("tensor"), str):
        return evidence["tensor"]
    tensors = evidence.get("tensors")
    if isinstance(tensors, list) and tensors:
        first = tensors[0]
        name = first.get("tensor") or first.get("name") if isinstance(first, dict) else first
        return name if isinstance(name, str) else None
    return None
