"""SARIF 2.1.0 from a verdict: the audit where code-scanning views show lint.

One rule per rule id of a registered check (id `LOOP-NN/slug`, the rule's one line, the check's docstring as
its help, a link to the check's docs page); one result per warn/fail finding, under its rule id, `error` for fail and `warning` for warn,
located at the artifact file the check read (the checkpoint folder for a checkpoint finding) with a
logical location naming the step and tensor. Checks that did not run, or judged only part of the
run's evidence, are the invocation's notifications (with the reason), never passing results. A gate's SARIF
holds the findings up to its checkpoint.

Run text is untrusted: code-scanning views render message text as Markdown, so every message passes through
`escape.markdown` (SARIF's own embedded-link syntax is Markdown's: its brackets are escaped too; literal braces
are doubled, as SARIF's placeholders ask); artifact URIs are percent-encoded (`escape.uri`: a folder named
``run #1 %41?`` stays one path); names in logical locations and properties have their control and bidi
characters written as escapes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .._version import __version__
from ..checks import registered_checks
from ..checks.base import alternatives
from ..core.artifacts import ARTIFACT_DIR, COLUMNAR_IMPORT_KINDS, GRAD_SERIES, SERIES_DIR, rank_dir
from ..core.terminal import shown
from . import Format, Rendering
from .escape import markdown, uri
from .report.evidence import check_doc, check_page

SARIF_SCHEMA = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
LEVELS = {"fail": "error", "warn": "warning"}
MESSAGE_LIMIT = 4000  # characters of one run string in a message
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
    rules = [_rule(c, slug) for c in checks for slug in c.rules]
    index = {r["id"]: i for i, r in enumerate(rules)}
    known = {c.code for c in checks}
    files = {c.code: _artifact(c, run_dir) for c in checks}
    folders = {c["name"]: c["path"] for c in verdict.get("checkpoints") or [] if isinstance(c.get("path"), str)}
    results = [
        _result(f, index, files, folders) for f in verdict["findings"] if f["severity"] in LEVELS and f["code"] in known
    ]
    notes = [
        {
            "level": "error" if c["status"] == "error" else "note",
            "message": {"text": f"{c['code']} {c['status'].replace('_', ' ')}: {message(c['reason'])}"},
            "descriptor": {"id": c["code"]},
        }
        for c in verdict.get("checks", [])
        if c["status"] in ("not_run", "partial", "error") and c["code"] in known
    ]
    if verdict.get("cannot_judge"):
        notes.append(
            {"level": "error", "message": {"text": f"the run cannot be judged: {message(verdict['cannot_judge'])}"}}
        )
    return {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {"driver": {"name": "sftaudit", "version": __version__, "rules": rules}},
                "originalUriBaseIds": {RUN_BASE: {"uri": uri.folder(run_dir)}},
                "invocations": [
                    {"executionSuccessful": verdict["verdict"] != "unjudged", "toolExecutionNotifications": notes}
                ],
                "results": results,
                "properties": {
                    "verdict": verdict["verdict"],
                    "first_anomalous_step": verdict["first_anomalous_step"],
                    "rollback_checkpoint": _name(verdict["rollback_checkpoint"]),
                },
            }
        ],
    }


def render(r: Rendering) -> str:
    """The audit's SARIF, or a gate's: the run's verdict with the findings up to the gated checkpoint."""
    verdict = r.verdict if r.gate is None else {**r.verdict, "findings": r.gate["findings"]}
    return json.dumps(to_sarif(verdict, r.run_dir), indent=1) + "\n"


FORMAT = Format("SARIF 2.1.0 for code-scanning views: one rule per check, one result per warn or fail finding", render)


def message(value: Any) -> str:
    """Run text in a SARIF message: Markdown-escaped, braces doubled (a single one starts a placeholder)."""
    return markdown.inline(value, MESSAGE_LIMIT).replace("\\{", "{{").replace("\\}", "}}")


def _name(value: Any) -> Any:
    return shown(value) if isinstance(value, str) else value


def _rule(check, slug: str) -> dict[str, Any]:
    doc = check_doc(check)
    detects = dict(doc["sections"]).get("What it detects", doc["summary"])
    return {
        "id": f"{check.code}/{slug}",
        "name": "".join(w.title() for w in f"{check.name} {slug}".replace("-", " ").split()),
        "shortDescription": {"text": check.rules[slug]},
        "fullDescription": {"text": f"{check.rules[slug]}. {check.code} ({check.name}): {detects}"},
        "helpUri": check_page(check.code),
        "help": {"text": "\n\n".join(f"{name}: {body}" for name, body in doc["sections"])},
        "properties": {"name": check.name, "check": check.code},
    }


def _artifact(check, run_dir: str | Path) -> str:
    first = alternatives(check)[0][0]
    if first == "grad_norms":  # per-tensor norms: rank 0's part of the columnar series (schema version 2)
        return f"{ARTIFACT_DIR}/{SERIES_DIR}/{GRAD_SERIES}/rank=0/"
    kind = EVIDENCE_FILES.get(first, "steps")
    # An import writes some kinds as typed Parquet (metrics); the shim writes every kind as JSONL.
    columnar = kind in COLUMNAR_IMPORT_KINDS and (rank_dir(run_dir, 0) / f"{kind}.parquet").is_file()
    return f"{ARTIFACT_DIR}/rank-0/{kind}.{'parquet' if columnar else 'jsonl'}"


def _result(
    finding: dict[str, Any], index: dict[str, int], files: dict[str, str], folders: dict[str, str]
) -> dict[str, Any]:
    checkpoint = finding["checkpoint"]
    if finding["scope"] == "checkpoint" and checkpoint:  # the checkpoint's folder, as the verdict records it
        where = uri.relative(folders.get(checkpoint, checkpoint).rstrip("/")) + "/"
    else:
        where = files[finding["code"]]
    logical = []
    if finding["step"] is not None:
        logical.append({"name": f"step {finding['step']}", "kind": "step"})
    tensor = _tensor(finding["evidence"])
    if tensor:
        logical.append({"name": shown(tensor), "fullyQualifiedName": shown(tensor), "kind": "tensor"})
    if checkpoint:
        logical.append({"name": shown(checkpoint), "kind": "checkpoint"})
    location: dict[str, Any] = {"physicalLocation": {"artifactLocation": {"uri": where, "uriBaseId": RUN_BASE}}}
    if logical:
        location["logicalLocations"] = logical
    rule = finding.get("rule") or finding["code"]  # a verdict stored before rule ids names the check alone
    return {
        "ruleId": rule,
        **({"ruleIndex": index[rule]} if rule in index else {}),
        "level": LEVELS[finding["severity"]],
        "message": {"text": message(finding["message"])},
        "locations": [location],
        "properties": {
            "category": finding.get("category", "anomaly"),
            "step": finding["step"],
            "checkpoint": _name(checkpoint),
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
