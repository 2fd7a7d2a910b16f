"""The verdict as JSON (verdict.json), or a gate's result (`sftaudit gate --json`): sorted keys, two-space
indent, the same bytes for the same input. verdict.json is ASCII (every other character a JSON escape); a
gate's result keeps readable text but writes control, bidi and format characters as JSON escapes."""

from __future__ import annotations

import json

from ..core.terminal import json_safe
from . import Format, Rendering


def render(r: Rendering) -> str:
    if r.gate is not None:
        return json_safe(json.dumps(r.gate, indent=2, sort_keys=True, ensure_ascii=False)) + "\n"
    return json.dumps(r.verdict, indent=2, sort_keys=True) + "\n"


FORMAT = Format("the verdict, or a gate's result, as JSON", render)
