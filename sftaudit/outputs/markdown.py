"""The verdict as GitHub-flavoured Markdown: a CI step summary, a model card's "Training audit" section.

`render(verdict, ...)` takes the verdict as verdict.json has it and presents what it says: the verdict, the first
anomalous step, the checkpoints to roll back to and to keep, the findings that matter (fail and warn first, at
most `max_findings`), the per-checkpoint verdicts, what could not be judged and why, and the library versions
the caller read from the run's manifest (the verdict does not carry them). `render_gate` puts a gate's result
(`sftaudit gate --json`'s document) above it.

Every string from the run (run and checkpoint names, messages quoting tensor names and paths, reasons) is
untrusted and passes through `text`: control, bidi and format characters and line breaks are written as their
visible escapes (``\\x1b``, ``\\u202e``, ``\\x0a``), as the CLI shows them; ``&``, ``<`` and ``>`` become
entities (no raw HTML in any renderer); the ASCII punctuation that Markdown gives a meaning
(``\\ ` * _ { } [ ] ( ) # + ! | ~ $``) is backslash-escaped (no link, image, emphasis, code, table cell or
math); ``@`` becomes the fullwidth ``＠`` (no mention, no e-mail autolink); ``://`` and ``www.`` are defanged to
``[:]//`` and ``www[.]`` (no URL autolink). Each string is cut to `TEXT_LIMIT` characters.
"""

from __future__ import annotations

import re
from typing import Any

from ..core.terminal import shown

TEXT_LIMIT = 500  # characters of one run string (a message, a name, a reason) shown
MAX_FINDINGS = 10
MAX_CHECKPOINTS = 30
MAX_NOTES = 20
SEVERITY_ORDER = {"fail": 0, "warn": 1, "info": 2}
LABELS = {
    "pass": "✅ PASS",
    "warn": "⚠️ WARN",
    "fail": "❌ FAIL",
    "info": "ℹ️ INFO",
    "unjudged": "❔ COULD NOT JUDGE",
}

_DEFANG = re.compile(r"://|(?i:www)\.")
_SPECIAL = re.compile(r"[\\`*_{}\[\]()#+!|~$&<>@]")
_REPLACED = {"&": "&amp;", "<": "&lt;", ">": "&gt;", "@": "＠"}


def text(value: Any, limit: int = TEXT_LIMIT) -> str:
    """`value` as Markdown inline text that renders as exactly what it says, on one line, in a table cell too."""
    s = shown(value)  # no control, bidi or format character and no line break is left raw
    if len(s) > limit:
        s = s[: limit - 1] + "…"
    s = _DEFANG.sub(lambda m: "[:]//" if m.group() == "://" else m.group()[:3] + "[.]", s)
    return _SPECIAL.sub(lambda m: _REPLACED.get(m.group()) or "\\" + m.group(), s)


def label(verdict: str) -> str:
    return LABELS.get(verdict) or text(str(verdict).upper())


def render(
    verdict: dict[str, Any],
    *,
    heading: str = "Training audit",
    level: int = 2,
    versions: dict[str, Any] | None = None,
    audited_with: str | None = None,
    max_findings: int = MAX_FINDINGS,
) -> str:
    """The verdict as a Markdown section titled `heading` (our own words, not escaped) at heading `level`.
    `versions`: the run manifest's library versions (None: not read, the section is left out)."""
    h = "#" * level
    out = [f"{h} {heading}", "", f"**Verdict: {label(verdict['verdict'])}** for run {text(verdict['run'])}.", ""]
    out += _facts(verdict)
    out += ["", f"{h}# Findings that matter", ""] + _findings(verdict["findings"], max_findings)
    out += ["", f"{h}# Checkpoints", ""] + _checkpoints(verdict)
    out += ["", f"{h}# What could not be judged", ""] + _unjudged(verdict)
    if versions is not None:
        out += ["", f"{h}# Library versions", ""] + _versions(versions)
    if audited_with:
        out += ["", f"*Audited by sftaudit {text(audited_with)} (verdict schema {text(verdict['schema_version'])}).*"]
    return "\n".join(out) + "\n"


def render_gate(gate: dict[str, Any], verdict: dict[str, Any], **options: Any) -> str:
    """A gate's result (the document `sftaudit gate --json` writes) above the run's verdict."""
    c = gate["checkpoint"]
    result = "pass" if gate["result"] == "pass" else "fail"
    out = [
        "## sftaudit gate",
        "",
        f"**{label(result)}**: checkpoint {text(c['name'])} (step {text(c['step'])}) of run {text(gate['run'])}.",
        "",
    ]
    policy = gate["policy"]
    rule = f"blocks {', '.join(map(text, policy['block'])) or 'nothing'}"
    if policy["codes"]:
        rule += f" from {', '.join(map(text, policy['codes']))} only"
    if policy["ignore"]:
        rule += f"; ignores {', '.join(map(text, policy['ignore']))}"
    out += [f"Policy: {rule}. The checkpoint is judged on the {len(gate['findings'])} finding(s) up to its step.", ""]
    if gate["blocking"]:
        out += ["### Blocking findings", ""] + _findings(gate["blocking"], options.get("max_findings", MAX_FINDINGS))
        out.append("")
    return "\n".join(out) + "\n" + render(verdict, heading="The run's audit", level=3, **options)


def _facts(v: dict[str, Any]) -> list[str]:
    out = []
    if v.get("cannot_judge"):
        out.append(f"- **Could not judge this run:** {text(v['cannot_judge'])}")
    first = v["first_anomalous_step"]
    window = (v.get("resolution") or {}).get("first_anomalous_window")
    if window:
        out.append(
            f"- **First anomalous {text(window.get('kind'))}:** steps {text(window.get('first_step'))}-"
            f"{text(window.get('last_step'))} (imported logs place a step only within its logging window)"
        )
    elif first is not None:
        out.append(f"- **First anomalous step:** {text(first)}")
    else:
        out.append("- **First anomalous step:** none found")
    if v["rollback_checkpoint"]:
        out.append(f"- **Roll back to:** {text(v['rollback_checkpoint'])}, the last intact checkpoint saved before it")
    elif first is not None:
        deleted = v.get("rollback_deleted")
        out.append(
            "- **Roll back to:** no intact checkpoint saved before it is on disk"
            + (f" ({text(deleted)} was, but it was rotated out or deleted)" if deleted else "")
            + ": restart from the beginning"
        )
    keep = v.get("keep") or {}
    if v.get("keep_checkpoint"):
        out.append(f"- **Keep (to ship):** {text(v['keep_checkpoint'])}: {text(keep.get('why'))}")
    else:
        out.append(f"- **Keep (to ship):** none: {text(keep.get('why') or 'the verdict names none')}")
    if keep.get("best_not_saved") is not None:
        out.append(
            f"- **Best evaluation not saved:** step {text(keep['best_not_saved'])} has no checkpoint: "
            "save on the steps you evaluate"
        )
    after = keep.get("after_best")
    if after and after.get("steps"):
        share = after.get("share")
        part = f" ({100 * share:.0f}% of the run)" if isinstance(share, int | float) else ""
        out.append(
            f"- **After the best evaluation:** {text(after['steps'])} steps{part} bought nothing on "
            f"{text(keep.get('metric'))}"
        )
    evidence = _evidence(v)
    if evidence:
        out.append(f"- **Evidence:** {evidence}")
    return out


def _evidence(v: dict[str, Any]) -> str:
    """What the verdict rests on, as it records it: steps per rank and where they came from."""
    parts = []
    ranks = (v.get("evidence") or {}).get("ranks") or []
    for r in ranks[:4]:
        span = f" ({text(r.get('first_step'))}..{text(r.get('last_step'))})" if r.get("steps") else ""
        parts.append(f"rank {text(r.get('rank'))}: {text(r.get('steps'))} steps{span}")
    if len(ranks) > 4:
        parts.append(f"and {len(ranks) - 4} more ranks")
    sources = sorted({s for c in v.get("checks") or [] for s in c.get("sources") or []})
    if sources:
        parts.append("from " + ", ".join(text(s) for s in sources))
    return "; ".join(parts)


def _findings(findings: list[dict[str, Any]], limit: int) -> list[str]:
    if not findings:
        return ["No finding."]
    counts = {s: sum(f["severity"] == s for f in findings) for s in SEVERITY_ORDER}
    ordered = sorted(findings, key=lambda f: SEVERITY_ORDER.get(f["severity"], 3))  # stable: the verdict's order
    out = [
        ", ".join(f"{n} {s}" for s, n in counts.items()) + ".",
        "",
        "| Severity | Check | Step | Checkpoint | Finding |",
        "| --- | --- | --- | --- | --- |",
    ]
    for f in ordered[:limit]:
        step = "run" if f["step"] is None else text(f["step"])
        out.append(
            f"| {label(f['severity'])} | {text(f['code'])} | {step} | {text(f['checkpoint'] or '-')} | "
            f"{text(f['message'])} |"
        )
    rest = ordered[limit:]
    if rest:
        left = ", ".join(f"{n} {s}" for s in SEVERITY_ORDER if (n := sum(f["severity"] == s for f in rest)))
        out += ["", f"…and {len(rest)} more ({left}); `sftaudit audit` writes every finding to verdict.json."]
    return out


def _checkpoints(v: dict[str, Any]) -> list[str]:
    checkpoints = v["checkpoints"]
    if not checkpoints:
        return ["No checkpoint was saved."]
    out = ["| Checkpoint | Step | Verdict | Note |", "| --- | --- | --- | --- |"]
    for c in checkpoints[:MAX_CHECKPOINTS]:
        notes = []
        if c["name"] == v["rollback_checkpoint"]:
            notes.append("roll back here")
        if c["name"] == v.get("keep_checkpoint"):
            notes.append("keep (ship)")
        if not c.get("on_disk", True):
            notes.append("no longer on disk")
        elif not c.get("intact", True):
            notes.append("not intact")
        out.append(f"| {text(c['name'])} | {text(c['step'])} | {label(c['verdict'])} | {'; '.join(notes)} |")
    rest = checkpoints[MAX_CHECKPOINTS:]
    if rest:
        left = ", ".join(f"{n} {s}" for s in ("fail", "warn", "pass") if (n := sum(c["verdict"] == s for c in rest)))
        out += ["", f"…and {len(rest)} more checkpoints ({left})."]
    return out


def _unjudged(v: dict[str, Any]) -> list[str]:
    """Checks that could not run, did not run or ran on part of the evidence, and why; what the import missed."""
    out = []
    if v.get("cannot_judge"):
        out.append(f"- **The run:** {text(v['cannot_judge'])}")
    errors = {e["code"]: e["error"] for e in v.get("check_errors") or []}
    for c in v.get("checks") or []:
        name = f"{text(c['code'])} {text(c['name'])}"
        if c["status"] == "error":
            out.append(f"- **{name} could not run:** {text(errors.get(c['code']) or c['reason'])}")
        elif c["status"] == "not_run":
            out.append(f"- **{name} not run:** {text(c['reason'])}")
        elif c["status"] == "partial":
            out.append(f"- **{name} ran on partial evidence:** {text(c['reason'])}")
        elif c["status"] == "disabled":
            out.append(f"- **{name} disabled** by the audit configuration")
    evidence = v.get("evidence") or {}
    out += _listed("Partial evidence", evidence.get("partial") or [])
    if evidence.get("too_little"):
        out.append(f"- **Too little evidence:** {text(evidence['too_little'])}")
    out += _listed("Import", (v.get("resolution") or {}).get("notes") or [])
    return out or ["Every check ran, on complete evidence."]


def _listed(what: str, notes: list[Any]) -> list[str]:
    """One item per note, at most MAX_NOTES (a run of many ranks may have a note per rank)."""
    out = [f"- **{what}:** {text(note)}" for note in notes[:MAX_NOTES]]
    if len(notes) > MAX_NOTES:
        out.append(f"- …and {len(notes) - MAX_NOTES} more ({what.lower()}).")
    return out


def _versions(versions: dict[str, Any]) -> list[str]:
    if not versions:
        return ["The run's manifest records no library versions."]
    out = ["| Library | Version |", "| --- | --- |"]
    for name, version in sorted(versions.items()):
        out.append(f"| {text(name)} | {text(version) if version else 'not recorded'} |")
    return out
