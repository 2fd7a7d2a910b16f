"""Finding evidence and check docstrings, shaped into blocks the template knows how to draw.

The evidence keys of COMMON.md's conventions get their own block (sample ids as chips,
`tokens` as a coloured loss-mask strip, `ngrams` as a ranked list, `histogram` as bars,
`keys`/`dtypes` as what is missing or wrong); anything else becomes a table. All
strings stay strings: the template escapes them.
"""

from __future__ import annotations

import inspect
import json
import re
from typing import Any

from ...checks.base import DOC_SECTIONS
from ...dataset.layout import CATEGORY_NAMES
from ...dataset.layout import EITHER as EITHER_ID

NUMBER_KEYS = ("value", "threshold", "p_value", "effect_size")
TOKEN_CLASSES = ("trained", "masked", "padding")
EITHER = CATEGORY_NAMES[EITHER_ID]  # a position the template allows trained or masked
ROWS_SHOWN = 20
_VISIBLE = str.maketrans({"\n": "↵", "\t": "⇥", "\r": "␍"})
# Where the documentation site (mkdocs.yml: docs/checks/LOOP-NN.md is one page per check) is
# published; pyproject.toml's [project.urls] Documentation names the same place.
DOCS_URL = "https://sftaudit.github.io/sftaudit"


def check_page(code: str) -> str:
    """The address of a check's documentation page (a registered check's code: LOOP-NN)."""
    return f"{DOCS_URL}/checks/{code}/"


def check_doc(check_cls: type) -> dict[str, Any]:
    """The docstring's summary line and its fixed sections (What it detects, ..., Evidence)."""
    doc = inspect.cleandoc(check_cls.__doc__ or "")
    summary, _, rest = doc.partition("\n")
    pattern = re.compile(r"^(%s):\s*$" % "|".join(map(re.escape, DOC_SECTIONS)), re.M)
    parts = pattern.split(rest)
    sections = {name: " ".join(body.split()) for name, body in zip(parts[1::2], parts[2::2])}
    return {
        "summary": summary.strip(),
        "sections": [(name, sections[name]) for name in DOC_SECTIONS if name in sections],
    }


def blocks(evidence: Any) -> list[dict[str, Any]]:
    """Evidence (a finding's dict) as an ordered list of display blocks."""
    if not isinstance(evidence, dict):
        return [_table_or_value("evidence", evidence)]
    out: list[dict[str, Any]] = []
    numbers = [(k, evidence[k]) for k in NUMBER_KEYS if k in evidence]
    if numbers:
        out.append({"kind": "numbers", "items": numbers})
    scalars = []
    for key, value in evidence.items():
        if key in NUMBER_KEYS:
            continue
        block = _special(key, value)
        if block is not None:
            out.append(block)
        elif value is None or isinstance(value, (str, int, float, bool)):
            scalars.append((key, value))
        else:
            out.append(_table_or_value(key, value))
    if scalars:
        out.insert(1 if numbers else 0, {"kind": "scalars", "items": scalars})
    return out


def _special(key: str, value: Any) -> dict[str, Any] | None:
    if key == "sample_ids" and isinstance(value, list):
        return {"kind": "ids", "label": "sample ids", "items": [str(v) for v in value]}
    if _is_token_list(value):
        return token_block(key, value)
    if key == "ngrams" and isinstance(value, list) and all(isinstance(v, dict) for v in value):
        top = max((_number(v.get("count")) for v in value), default=0) or 1
        return {
            "kind": "ngrams",
            "rows": [
                {
                    "ngram": str(v.get("ngram", "")),
                    "count": v.get("count"),
                    "width": 100 * _number(v.get("count")) / top,
                }
                for v in value
            ],
        }
    if key == "histogram" and isinstance(value, dict) and isinstance(value.get("counts"), list):
        return _histogram(value)
    if key == "keys" and isinstance(value, dict):
        return {
            "kind": "keys",
            "missing": [str(k) for k in value.get("missing") or []],
            "unexpected": [str(k) for k in value.get("unexpected") or []],
        }
    return None


def _is_token_list(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, dict) for v in value)
        and all("token" in v and "actual" in v for v in value)
    )


def token_block(key: str, tokens: list[dict[str, Any]]) -> dict[str, Any]:
    """A loss-mask strip: each token coloured by its class, outlined where the template expects another. A
    position the template allows either way (`either`: whitespace after an end-of-turn marker) is no mismatch,
    so the count is the one the check made."""
    shown = []
    for t in tokens:
        actual, expected = str(t.get("actual")), str(t.get("expected", t.get("actual")))
        token = str(t.get("token", ""))
        shown.append(
            {
                "text": token.translate(_VISIBLE) or "∅",
                "actual": actual if actual in TOKEN_CLASSES else "unknown",
                "mismatch": actual != expected and expected != EITHER,
                "title": f"pos {t.get('pos')}: {token!r} id {t.get('input_id')} label {t.get('label')}; "
                f"{actual}" + (f", expected {expected}" if actual != expected else ""),
            }
        )
    return {"kind": "tokens", "label": key, "tokens": shown, "mismatches": sum(t["mismatch"] for t in shown)}


def _histogram(h: dict[str, Any]) -> dict[str, Any]:
    counts = [_number(c) for c in h["counts"]]
    edges = h.get("edges") or []
    top = max(counts, default=0) or 1
    bars = [
        {
            "label": f"{edges[i]:g}" if i < len(edges) and isinstance(edges[i], (int, float)) else str(i),
            "count": c,
            "height": 100 * c / top,
        }
        for i, c in enumerate(counts)
    ]
    return {"kind": "histogram", "tensor": str(h.get("tensor", "")), "step": h.get("step"), "bars": bars}


def _table_or_value(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        if any(_is_token_list(v2) for v in value for v2 in v.values()):
            return {"kind": "group", "label": key, "items": [blocks(v) for v in value]}
        columns = list(dict.fromkeys(k for v in value for k in v))
        rows = [[_cell(v.get(c)) for c in columns] for v in value]
        return {"kind": "table", "label": key, "columns": columns, "rows": rows[:ROWS_SHOWN], "more": rows[ROWS_SHOWN:]}
    if isinstance(value, list) and all(v is None or isinstance(v, (str, int, float, bool)) for v in value):
        return {"kind": "list", "label": key, "items": value}
    if isinstance(value, dict) and all(v is None or isinstance(v, (str, int, float, bool)) for v in value.values()):
        return {"kind": "scalars", "label": key, "items": list(value.items())}
    compact = json.dumps(value, ensure_ascii=False)
    return {
        "kind": "json",
        "label": key,
        "text": compact if len(compact) <= 120 else json.dumps(value, indent=1, ensure_ascii=False),
    }


def _cell(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return json.dumps(value, ensure_ascii=False)


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0
