"""Attribution and verdict: findings -> checkpoint windows -> per-checkpoint and run verdicts.

A finding at step s falls in the window of the first checkpoint saved at a step >= s
(after checkpoint A, up to and including checkpoint B). A checkpoint's verdict is the
worst severity of everything that happened up to it: findings in its window or an
earlier one, run-level findings (no step), and findings about the checkpoint itself.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import PurePosixPath
from typing import Any

from .artifacts import SCHEMA_VERSION
from .checks.base import SEVERITY_RANK, Finding

# Findings within this many steps of the first anomalous step form its chain (what fired around it).
CHAIN_WINDOW = 50


def checkpoint_name(path: str) -> str:
    return PurePosixPath(path.replace("\\", "/")).name


def attribute(findings: list[Finding], checkpoints: list[dict[str, Any]]) -> list[Finding]:
    """Set each stepped finding's checkpoint to the window it falls in (None: after the last save)."""
    ordered = sorted(checkpoints, key=lambda c: c["step"])
    out = []
    for f in findings:
        if f.checkpoint is None and f.step is not None:
            window = next((c["name"] for c in ordered if c["step"] >= f.step), None)
            f = replace(f, checkpoint=window)
        out.append(f)
    return out


def worst(findings: list[Finding]) -> str:
    rank = max((SEVERITY_RANK[f.severity] for f in findings), default=0)
    return "pass" if rank == 0 else ("warn", "fail")[rank - 1]


def build_verdict(run: str, findings: list[Finding], checkpoints: list[dict[str, Any]],
                  check_errors: list[dict[str, str]] | None = None) -> dict[str, Any]:
    # Findings a check already tied to a checkpoint (LOOP-09) are about that checkpoint alone;
    # the rest are about the run, up to the step they happened.
    about_checkpoint = [f for f in findings if f.checkpoint is not None]
    about_run = attribute([f for f in findings if f.checkpoint is None], checkpoints)
    findings = sorted(about_checkpoint + about_run,
                      key=lambda f: (f.step is None, f.step or 0, f.code, -SEVERITY_RANK[f.severity], f.message))
    anomalous = [f.step for f in findings if f.step is not None and f.severity != "info"]
    first = min(anomalous) if anomalous else None
    chain = [{"code": f.code, "severity": f.severity, "step": f.step, "message": f.message}
             for f in findings if first is not None and f.step is not None and abs(f.step - first) <= CHAIN_WINDOW]

    per_checkpoint = []
    for c in sorted(checkpoints, key=lambda c: c["step"]):
        upto = [f for f in about_run if f.step is None or f.step <= c["step"]]
        upto += [f for f in about_checkpoint if f.checkpoint == c["name"]]
        own = [f for f in findings if f.checkpoint == c["name"]]
        per_checkpoint.append({"name": c["name"], "step": c["step"], "path": c["path"],
                               "verdict": worst(upto), "findings": [f.to_dict() for f in own]})

    rollback = None
    if first is not None:
        intact = [c for c in per_checkpoint if c["step"] < first
                  and not any(f["severity"] == "fail" for f in c["findings"] if f["checkpoint"] == c["name"]
                              and Finding.from_dict(f) in about_checkpoint)]
        rollback = intact[-1]["name"] if intact else None
    return {
        "schema_version": SCHEMA_VERSION,
        "run": run,
        "verdict": worst(findings),
        "first_anomalous_step": first,
        "first_anomaly_chain": chain,
        "rollback_checkpoint": rollback,
        "checkpoints": per_checkpoint,
        "findings": [f.to_dict() for f in findings],
        "check_errors": check_errors or [],
    }
