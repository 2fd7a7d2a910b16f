"""A gate's result as JUnit XML: one testcase per check.

A blocking finding is a failure; a check turned off, one that had too little evidence to judge (`not_run`), or
one that judged only part of the run's evidence (`partial`) and found nothing blocking, is skipped with the
reason: never a plain pass for what was not seen. All run text goes through `escape.xml`: XML cannot hold
control characters, and CI pages should not show bidi controls raw.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from . import Format, Rendering
from .escape import xml
from .terminal import line


def render(r: Rendering) -> str:
    if r.gate is None:
        raise ValueError("JUnit renders a gate's result")
    gate = r.gate
    name = gate["checkpoint"]["name"]
    suite = ET.Element("testsuite", {"name": xml.text(f"sftaudit gate {gate['run']} {name}")})
    counts = {"tests": 0, "failures": 0, "skipped": 0}
    for check in r.verdict.get("checks") or []:
        code, status, reason = check["code"], check["status"], check.get("reason")
        case = ET.SubElement(
            suite, "testcase", {"classname": xml.text(f"sftaudit.{name}"), "name": xml.text(f"{code} {check['name']}")}
        )
        counts["tests"] += 1
        mine = [f for f in gate["findings"] if f["code"] == code]
        if status in ("disabled", "not_run"):
            why = "disabled by configuration" if status == "disabled" else f"not run: {reason}"
            ET.SubElement(case, "skipped", {"message": xml.text(why)})
            counts["skipped"] += 1
            continue
        blocking = [f for f in mine if f in gate["blocking"]]
        partial = f"partial evidence: {reason}" if status == "partial" else None
        if blocking:
            counts["failures"] += 1
            failure = ET.SubElement(
                case, "failure", {"type": blocking[0]["severity"], "message": xml.text(blocking[0]["message"])}
            )
            failure.text = xml.text("\n".join(line(f) for f in blocking))
        elif partial:
            ET.SubElement(case, "skipped", {"message": xml.text(f"{partial}; nothing blocking in what was judged")})
            counts["skipped"] += 1
        others = [line(f) for f in mine if f not in gate["blocking"]] + ([partial] if partial and blocking else [])
        if others:
            ET.SubElement(case, "system-out").text = xml.text("\n".join(others))
    for key in ("tests", "failures", "skipped"):
        suite.set(key, str(counts[key]))
    suite.set("errors", "0")
    ET.indent(suite)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suite, encoding="unicode") + "\n"


FORMAT = Format("a gate's result as JUnit XML, one testcase per check", render)
