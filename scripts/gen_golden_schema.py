"""Write sftaudit/schema/golden.schema.json from the golden file's declaration (`sftaudit/schema/golden.py`).

    .venv/bin/python scripts/gen_golden_schema.py          # rewrite the schema
    .venv/bin/python scripts/gen_golden_schema.py --check  # exit 1 if the schema drifted from the declaration

The schema is generated, never edited by hand (tests/test_docs_and_schema.py fails when they drift). pydantic
generates it here, at development time; sftaudit validates golden files with jsonschema and never needs pydantic.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import TypeAdapter
from pydantic.json_schema import GenerateJsonSchema

from sftaudit.schema.golden import INT64_MAX, Golden

SCHEMA = Path(__file__).resolve().parents[1] / "sftaudit" / "schema" / "golden.schema.json"


class Int64(GenerateJsonSchema):
    """Every integer of a golden file is a step or an index: 0 up to the largest signed 64-bit integer."""

    def int_schema(self, schema):
        return {**super().int_schema(schema), "minimum": 0, "maximum": INT64_MAX}


def schema() -> dict:
    body = TypeAdapter(Golden).json_schema(schema_generator=Int64)
    # data_order is keyed by step, written as a decimal string
    body["properties"]["data_order"]["propertyNames"] = {"pattern": "^[0-9]{1,18}$"}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://sftaudit.dev/schema/golden.schema.json",
        **body,
    }


def text() -> str:
    return json.dumps(schema(), indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the schema drifted from the declaration")
    args = parser.parse_args()
    if args.check:
        if not SCHEMA.is_file() or SCHEMA.read_text(encoding="utf-8") != text():
            print(f"{SCHEMA} drifted from sftaudit/schema/golden.py: run scripts/gen_golden_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(text(), encoding="utf-8")
    print(SCHEMA)
    return 0


if __name__ == "__main__":
    sys.exit(main())
