"""Ingest and audit time of a 100,000-step x 200-tensor run (target: under 30 s on 2 cores).

    .venv/bin/python benchmarks/audit_scale.py [--steps 100000] [--tensors 200]

Writes a synthetic run (benchmarks/synthetic_run.py) with planted anomalies, times `ingest` and
the checks + verdict separately, and checks that the planted anomalies are found at their steps.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from synthetic_run import write_synthetic_run  # noqa: E402

from sftaudit.audit import audit  # noqa: E402
from sftaudit.ingest import ingest  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--tensors", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "synthetic"
        t0 = time.perf_counter()
        planted = write_synthetic_run(run, steps=args.steps, tensors=args.tensors)
        t1 = time.perf_counter()
        ingest(run)
        t2 = time.perf_counter()
        verdict = audit(run)  # ingest again is a no-op: nothing was appended
        t3 = time.perf_counter()
        size = sum(p.stat().st_size for p in run.rglob("*.jsonl"))
        print(f"run: {args.steps:,} steps x {args.tensors} tensors, {size / 1e6:.0f} MB of JSONL (written in {t1 - t0:.1f} s)")
        print(f"ingest: {t2 - t1:.1f} s")
        print(f"audit (checks + verdict): {t3 - t2:.1f} s")
        print(f"total: {t3 - t1:.1f} s (target < 30 s)")
        found = {(f["code"], f["severity"], f["step"]) for f in verdict["findings"]}
        expected = {
            "grad_scale": ("LOOP-05", "fail", planted["grad_scale"]["step"]),
            "periodic_spike": ("LOOP-05", "warn", planted["periodic_spike"]["start"]),
            "loss_spike": ("LOOP-10", "warn", planted["loss_spike"]["step"]),
            "lr_jump": ("LOOP-10", "warn", planted["lr_jump"]["step"]),
        }
        for name, key in expected.items():
            print(f"planted {name}: {'found' if key in found else 'MISSED'} {key}")
        print(f"first anomalous step: {verdict['first_anomalous_step']}; findings: {len(verdict['findings'])}")
        for f in verdict["findings"]:
            print(f"  {f['code']} {f['severity']} step {f['step']}: {f['message'][:110]}")
        return 0 if all(key in found for key in expected.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
