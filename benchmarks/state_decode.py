"""Decoding one chunk of a per-step trainer_state.json's log: the import's way (the standard library's decoder, then
`logs.all_normalised`) against pyarrow's JSON reader into typed columns (the entries made lines at each ``},``), and
against that reader with the dicts the import's later steps take built from its columns. What the columns would
save if those later steps took them, and what the dicts cost.

    .venv/bin/python benchmarks/state_decode.py [--entries 31604] [--repeats 5]

The chunk is TRL's eight keys per entry, indented as the Trainer writes the state (31,604 entries: the 8 MB the
import reads at a time). Prints the median CPU seconds of each way over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from itertools import repeat

from import_scale import trl_history  # this folder's: run as a script, the folder is on the path

from sftaudit.imports.logs import all_normalised


def chunk(n: int) -> str:
    """The log entries of a TRL SFT state, as the text between its ``[`` and ``]``."""
    history = trl_history(n)
    return json.dumps(history, indent=2, sort_keys=True)[1:-1]


def decoded(text: str) -> list[dict]:
    entries = json.loads("[" + text + "]")
    assert all_normalised(entries)
    return entries


def columns(text: str):
    import pyarrow as pa
    import pyarrow.json as pj

    lines = text.replace("},", "}\n").encode()
    return pj.read_json(
        pa.BufferReader(lines),
        read_options=pj.ReadOptions(use_threads=False, block_size=len(lines) + 1),
        parse_options=pj.ParseOptions(newlines_in_values=True),
    )


def dicts(text: str) -> list[dict]:
    table = columns(text)
    values = [column.to_numpy().tolist() for column in table.columns]
    return list(map(dict, map(zip, repeat(table.column_names), zip(*values))))


def timed(way, text: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        way(text)
        times.append(time.process_time() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=31_604)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    text = chunk(args.entries)
    assert dicts(text) == decoded(text)  # the same entries either way
    print(f"{args.entries:,} entries, {len(text) / 2**20:.1f} MB; median CPU s of {args.repeats}")
    for name, way in [
        ("json + all_normalised", decoded),
        ("pyarrow columns", columns),
        ("pyarrow + dicts", dicts),
    ]:
        print(f"{name:<26} {timed(way, text, args.repeats):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
