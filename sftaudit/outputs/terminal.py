"""What the CLI prints: the verdict in a few lines (or a gate's result), every run string shown with its
controls and bidi characters as escapes (`sftaudit.core.terminal`).

An audit's summary lists its findings, the checks that could not run, partial evidence, unreadable lines, import
notes and the checks not run among `Rendering.codes` (default: every check), then where the command wrote the
verdict and the report (`Rendering.written`). A gate's is the checkpoint's result and what blocks it.
"""

from __future__ import annotations

from typing import Any

from ..core.terminal import shown
from . import Format, Rendering


def line(f: dict[str, Any]) -> str:
    """A finding in one line: code, severity, where, message (JUnit's too)."""
    where = f"step {f['step']}" if f["step"] is not None else "run"
    return f"{f['code']} {f['severity']} {where}: {f['message']}"


def render(r: Rendering) -> str:
    return shown(_gate(r) if r.gate is not None else _summary(r), keep_newlines=True) + "\n"


def _gate(r: Rendering) -> str:
    gate = r.gate
    c = gate["checkpoint"]
    lines = [shown(f"{gate['run']} {c['name']} (step {c['step']}): {gate['result'].upper()}")]
    lines += [f"  blocks: {shown(line(f))}" for f in gate["blocking"]]
    return "\n".join(lines)


def _summary(r: Rendering) -> str:
    verdict = r.verdict
    lines = [f"{shown(verdict['run'])}: {shown(verdict['verdict']).upper()}"]
    window = (verdict.get("resolution") or {}).get("first_anomalous_window")
    if window:  # imported evidence: the step is only known to lie in a logging or checkpoint window
        lines[0] += f"; first anomalous {window['kind']}: steps {window['first_step']}-{window['last_step']}"
    elif verdict["first_anomalous_step"] is not None:
        lines[0] += f"; first anomalous step {verdict['first_anomalous_step']}"
    if verdict["rollback_checkpoint"]:
        lines[0] += f"; roll back to {shown(verdict['rollback_checkpoint'])}"
    for f in verdict["findings"]:
        where = f"step {f['step']}" if f["step"] is not None else "run"
        also = [folded["rule"] for folded in f["evidence"].get("also_flagged_by") or []]
        told_too = f" (also flagged by {', '.join(also)})" if also else ""
        lines.append(f"  {f['code']} {f['severity']:<4} {where}: {shown(f['message'] + told_too)}")
    lines += [f"  {e['code']} could not run: {shown(e['error'])}" for e in verdict["check_errors"]]
    evidence = verdict.get("evidence") or {}
    lines += [f"  partial evidence: {shown(note)}" for note in evidence.get("partial", [])]
    lines += [
        f"  unreadable lines: {b['lines']} of {b['of']} in {shown(b['file'])}" for b in evidence.get("bad_lines", [])
    ]
    lines += [
        f"  text mended: {b['lines']} of {b['of']} lines in {shown(b['file'])} kept with characters no reader can hold "
        f"escaped (a lone surrogate) or replaced (bytes not UTF-8)"
        for b in evidence.get("mended_lines", [])
    ]
    lines += [f"  note: {shown(note)}" for note in (verdict.get("resolution") or {}).get("notes") or []]
    not_run = [
        c
        for c in verdict.get("checks", [])
        if c["status"] in ("not_run", "disabled") and (not r.codes or c["code"] in r.codes)
    ]
    if not_run:
        lines.append("  not run: " + "; ".join(f"{c['code']} ({shown(c['reason'])})" for c in not_run))
    for name, label in (("verdict", "verdict: "), ("report", "report:  ")):
        if name in r.written:
            lines.append(f"{label}{shown(r.written[name])}")
    return "\n".join(lines)


FORMAT = Format("the verdict, or a gate's result, in a few lines for the terminal", render)
