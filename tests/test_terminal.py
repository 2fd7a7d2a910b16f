"""The `terminal` format: what the CLI prints of a verdict or a gate's result."""

from __future__ import annotations

from pathlib import Path

from sftaudit.outputs import Rendering, rendered
from tests.outputs_data import gate_of, small_verdict


def test_an_audit_in_a_few_lines():
    v = small_verdict()
    written = {"verdict": Path("out/verdict.json"), "report": Path("out/report.html")}
    lines = rendered("terminal", Rendering(v, Path("run"), written=written)).splitlines()
    assert lines[0] == "run: FAIL; first anomalous step 12; roll back to checkpoint-10"
    assert lines[1] == "  LOOP-05 fail step 12: non-finite gradient in layer0.weight at step 12"
    assert lines[2] == "  LOOP-03 warn run: padding wastes 40% of tokens"
    assert lines[3] == "  not run: LOOP-07 (no generations); LOOP-11 (disabled)"
    assert lines[4:] == ["verdict: out/verdict.json", "report:  out/report.html"]
    only = rendered("terminal", Rendering(v, Path("run"), codes=("LOOP-03",)))
    assert "not run" not in only and "report:" not in only


def test_a_gate_says_what_blocks():
    v = small_verdict()
    out = rendered("terminal", Rendering(v, Path("run"), gate=gate_of(v)))
    assert out.splitlines() == [
        "run checkpoint-20 (step 20): FAIL",
        "  blocks: LOOP-05 fail step 12: non-finite gradient in layer0.weight at step 12",
    ]
    assert rendered("terminal", Rendering(v, Path("run"), gate=gate_of(v, "checkpoint-10"))).startswith(
        "run checkpoint-10 (step 10): PASS\n"
    )


def test_run_text_is_shown_as_escapes():
    v = small_verdict()
    v["run"], v["findings"][0]["message"] = "r\x1b]0;x\x07", "m\u202eg\nh"
    out = rendered("terminal", Rendering(v, Path("run")))
    assert "r\\x1b]0;x\\x07: FAIL" in out and "m\\u202eg\\x0ah" in out
    assert not any(c in out for c in "\x1b\x07\u202e")
