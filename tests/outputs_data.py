"""A small verdict and a gate's result over it, written in the test: for the format tests that need no run."""

from __future__ import annotations

from typing import Any


def small_verdict() -> dict[str, Any]:
    finding = {
        "code": "LOOP-05",
        "severity": "fail",
        "step": 12,
        "checkpoint": "checkpoint-20",
        "scope": "run",
        "category": "anomaly",
        "message": "non-finite gradient in layer0.weight at step 12",
        "evidence": {"tensor": "layer0.weight"},
    }
    warn = {**finding, "code": "LOOP-03", "severity": "warn", "step": None, "message": "padding wastes 40% of tokens"}
    return {
        "schema_version": 2,
        "run": "run",
        "verdict": "fail",
        "first_anomalous_step": 12,
        "rollback_checkpoint": "checkpoint-10",
        "checkpoints": [
            {"name": "checkpoint-10", "step": 10, "path": "checkpoint-10", "verdict": "pass", "findings": []},
            {"name": "checkpoint-20", "step": 20, "path": "checkpoint-20", "verdict": "fail", "findings": [finding]},
        ],
        "findings": [finding, warn],
        "check_errors": [],
        "checks": [
            {"code": "LOOP-03", "name": "batch padding strategy", "status": "ran", "reason": None},
            {"code": "LOOP-05", "name": "gradient-norm anomaly", "status": "ran", "reason": None},
            {"code": "LOOP-07", "name": "generation diversity", "status": "not_run", "reason": "no generations"},
            {"code": "LOOP-08", "name": "eval metric drift", "status": "partial", "reason": "1 evaluation(s)"},
            {"code": "LOOP-11", "name": "optimizer state", "status": "disabled", "reason": "disabled"},
        ],
        "evidence": {"partial": [], "bad_lines": []},
    }


def gate_of(verdict: dict[str, Any], checkpoint: str = "checkpoint-20") -> dict[str, Any]:
    """A gate's result over the verdict's findings up to `checkpoint`, blocking on fail."""
    c = next(c for c in verdict["checkpoints"] if c["name"] == checkpoint)
    findings = [f for f in verdict["findings"] if f["step"] is None or f["step"] <= c["step"]]
    blocking = [f for f in findings if f["severity"] == "fail"]
    return {
        "run": verdict["run"],
        "checkpoint": {k: c[k] for k in ("name", "step", "path")},
        "result": "fail" if blocking else "pass",
        "policy": {"block": ["fail"], "codes": [], "ignore": []},
        "blocking": blocking,
        "findings": findings,
    }
