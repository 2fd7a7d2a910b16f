"""Re-audit time with and without LOOP-09's cache of unchanged checkpoints.

Trains a real plain-loop run (the "bench" model, a checkpoint every 2 steps), audits it once,
then times a re-audit with LOOP-09's cache emptied (every checkpoint rehashed and rescanned, as
before the cache) and with it kept (unchanged files are not read again).

    .venv/bin/python benchmarks/checkpoint_reaudit.py [--steps 20]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from sftaudit.fixtures.train import train_plain

from sftaudit.store.rundb import connect
from sftaudit.verdict.audit import audit


def timed_audit(run: Path, keep_cache: bool) -> float:
    if not keep_cache:
        con = connect(run)
        con.execute("DROP TABLE IF EXISTS checkpoint_inspections")
        con.close()
    t0 = time.perf_counter()
    audit(run)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = train_plain(Path(tmp) / "run", steps=args.steps, checkpoint_every=2, size="bench", profile="prod")
        size = sum(f.stat().st_size for f in run.glob("checkpoint-*/*"))
        audit(run)
        without = min(timed_audit(run, keep_cache=False) for _ in range(3))
        with_cache = min(timed_audit(run, keep_cache=True) for _ in range(3))
    print(f"{args.steps // 2} checkpoints, {size / 2**20:.0f} MiB")
    print(f"re-audit, every checkpoint rescanned: {without:.2f} s")
    print(f"re-audit, unchanged checkpoints from the cache: {with_cache:.2f} s")


if __name__ == "__main__":
    main()
