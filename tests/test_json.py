"""The `json` format: verdict.json's bytes (sorted, indented, ASCII) and a gate's result (readable text, controls
as JSON escapes)."""

from __future__ import annotations

import json
from pathlib import Path

from sftaudit.outputs import Rendering, rendered
from tests.outputs_data import gate_of, small_verdict


def test_verdict_json_is_sorted_indented_ascii():
    v = small_verdict()
    v["run"] = "rün\x1b\u202e"
    out = rendered("json", Rendering(v, Path("run")))
    assert out == json.dumps(v, indent=2, sort_keys=True) + "\n" and out.isascii()
    assert json.loads(out) == v


def test_a_gates_result_keeps_text_readable_and_escapes_controls():
    v = small_verdict()
    v["findings"][0]["message"] = "tensor ü\x1b[2J\u202e"
    gate = gate_of(v)
    out = rendered("json", Rendering(v, Path("run"), gate=gate))
    assert json.loads(out) == gate
    assert "ü" in out and "\\u001b" in out and "\\u202e" in out and "\x1b" not in out and "\u202e" not in out
