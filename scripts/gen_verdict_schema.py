"""Write sftaudit/schema/verdict.schema.json from the verdict's types (sftaudit/schema/verdict.py, findings.py).

    .venv/bin/python scripts/gen_verdict_schema.py          # rewrite the schema
    .venv/bin/python scripts/gen_verdict_schema.py --check  # exit 1 if the schema drifted from the types

pydantic (a test/dev dependency, never needed to audit) turns the stdlib dataclasses into JSON Schema; this script
adds what the types say beyond it: a field's description (dataclass field metadata, or a TypedDict key's
`Annotated` text), and `required` = every field the JSON always holds (all but those left out while None).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path

from pydantic import TypeAdapter

from sftaudit.schema import findings as findings_module
from sftaudit.schema import verdict as verdict_module
from sftaudit.schema.verdict import Verdict

SCHEMA = Path(__file__).resolve().parents[1] / "sftaudit" / "schema" / "verdict.schema.json"
HEADER = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://sftaudit.dev/schema/verdict.schema.json",
    "title": "sftaudit verdict",
}
VERSIONING = (
    " Generated from sftaudit/schema/verdict.py by scripts/gen_verdict_schema.py. Versioned with schema_version: "
    "fields may be added within a version, none removed or retyped."
)


def _declared() -> dict[str, type]:
    """Every record and TypedDict the verdict is made of, by name (pydantic's $defs are keyed by it)."""
    out = {}
    for module in (findings_module, verdict_module):
        for name, value in vars(module).items():
            if isinstance(value, type) and value.__module__ == module.__name__:
                if dataclasses.is_dataclass(value) or typing.is_typeddict(value):
                    out[name] = value
    return out


def _annotate(node: dict, declared: type) -> None:
    """The descriptions and `required` of one object schema, from its type."""
    props = node.get("properties", {})
    if dataclasses.is_dataclass(declared):
        fields = dataclasses.fields(declared)
        for f in fields:
            if f.name in props and f.metadata.get("description"):
                props[f.name]["description"] = f.metadata["description"]
        node["required"] = [f.name for f in fields if not f.metadata.get("omit_none")]
    else:  # a TypedDict: its keys are optional; their text is the Annotated metadata
        hints = typing.get_type_hints(declared, include_extras=True)
        for key, hint in hints.items():
            texts = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, str)]
            if key in props and texts:
                props[key]["description"] = texts[0]
        node.pop("required", None)
    doc = " ".join((declared.__doc__ or "").split())
    if doc:
        node["description"] = doc


def _strip_titles(node: typing.Any) -> typing.Any:
    if isinstance(node, dict):
        return {k: _strip_titles(v) for k, v in node.items() if k != "title" or not isinstance(v, str)}
    if isinstance(node, list):
        return [_strip_titles(v) for v in node]
    return node


def generated() -> str:
    schema = _strip_titles(TypeAdapter(Verdict).json_schema(mode="serialization"))
    declared = _declared()
    for name, node in schema.get("$defs", {}).items():
        if name in declared:
            _annotate(node, declared[name])
    _annotate(schema, Verdict)
    schema["description"] += VERSIONING
    ordered = (
        HEADER | {k: v for k, v in schema.items() if k != "$defs"} | {"$defs": dict(sorted(schema["$defs"].items()))}
    )
    return json.dumps(ordered, indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the schema drifted from the types")
    args = parser.parse_args()
    text = generated()
    if args.check:
        if SCHEMA.read_text(encoding="utf-8") != text:
            print(f"{SCHEMA} drifted from the verdict's types: run scripts/gen_verdict_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
