"""How long `sftaudit preflight` takes on a large dataset (default 100k samples).

Builds a JSONL of N chat samples by cycling the fixture dataset (fresh ids), then runs the
whole preflight (render, tokenize, collate with the standard completion-only collator,
store, checks LOOP-01..04) and prints wall time and throughput.

    .venv/bin/python benchmarks/preflight_scale.py [--samples 100000] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from sftaudit.fixtures import build_tokenizer, load_dataset
from sftaudit.preflight import preflight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build_tokenizer(tmp / "tokenizer")
        rows = load_dataset()
        with open(tmp / "data.jsonl", "w", encoding="utf-8") as f:
            for i in range(args.samples):
                f.write(json.dumps({"id": f"b{i:07d}", "messages": rows[i % len(rows)]["messages"]}, ensure_ascii=False))
                f.write("\n")
        size_mb = (tmp / "data.jsonl").stat().st_size / 1e6
        start = time.perf_counter()
        verdict = preflight(tmp / "data.jsonl", tmp / "tokenizer", tmp / "out", batch_size=args.batch_size,
                            progress=False)
        wall = time.perf_counter() - start
    print(f"preflight: {args.samples} samples ({size_mb:.0f} MB JSONL), batch size {args.batch_size}, "
          f"{os.cpu_count()} CPUs visible")
    print(f"  wall time {wall:.1f} s, {args.samples / wall:,.0f} samples/s, verdict {verdict['verdict']}, "
          f"{len(verdict['findings'])} finding(s), check errors {len(verdict['check_errors'])}")


if __name__ == "__main__":
    main()
