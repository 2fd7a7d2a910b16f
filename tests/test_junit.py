"""The `junit` format: a gate's result as one testcase per check; never a plain pass for what was not seen."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from sftaudit.outputs import Rendering, rendered
from tests.outputs_data import gate_of, small_verdict


def cases(xml: str) -> tuple[ET.Element, dict[str, ET.Element]]:
    suite = ET.fromstring(xml.split("\n", 1)[1])
    return suite, {c.get("name").split()[0]: c for c in suite.iter("testcase")}


def test_one_testcase_per_check():
    v = small_verdict()
    suite, by_code = cases(rendered("junit", Rendering(v, Path("run"), gate=gate_of(v))))
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("5", "1", "3")
    assert by_code["LOOP-05"].find("failure").get("message") == "non-finite gradient in layer0.weight at step 12"
    assert by_code["LOOP-03"].find("system-out").text == "LOOP-03 warn run: padding wastes 40% of tokens"
    assert by_code["LOOP-07"].find("skipped").get("message") == "not run: no generations"
    assert by_code["LOOP-08"].find("skipped").get("message").startswith("partial evidence: 1 evaluation(s)")
    assert by_code["LOOP-11"].find("skipped").get("message") == "disabled by configuration"


def test_text_xml_cannot_hold_is_escaped():
    v = small_verdict()
    v["findings"][0]["message"] = "a\x00b\x1bc\ufffe\u202ed"
    xml = rendered("junit", Rendering(v, Path("run"), gate=gate_of(v)))
    _, by_code = cases(xml)  # parses
    assert by_code["LOOP-05"].find("failure").get("message") == "a\\x00b\\x1bc\\ufffe\\u202ed"


def test_junit_renders_a_gate_only():
    with pytest.raises(ValueError):
        rendered("junit", Rendering(small_verdict(), Path("run")))
