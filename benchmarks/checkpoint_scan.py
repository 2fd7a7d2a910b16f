"""How fast LOOP-09 reads a checkpoint, and that it never holds it in memory.

Writes a safetensors file of SIZE_MB (default 512) float32 tensors, then times header
validation and the streaming scan (non-finite count + digest per tensor), and prints the
throughput and the peak memory the scan added (tracemalloc: Python/numpy allocations).

    python benchmarks/checkpoint_scan.py [SIZE_MB]
"""

from __future__ import annotations

import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from sftaudit.readers.checkpoints import read_safetensors_header, scan_safetensors


def main(size_mb: int = 512) -> None:
    rows = 4096
    n_tensors = max(1, size_mb * 2**20 // (rows * 1024 * 4))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        rng = np.random.default_rng(0)
        tensors = {f"layer.{i}.weight": rng.standard_normal((rows, 1024), dtype=np.float32) for i in range(n_tensors)}
        tensors["layer.0.weight"][0, 0] = np.nan
        save_file(tensors, str(path))
        del tensors
        size = path.stat().st_size
        tracemalloc.start()
        t0 = time.perf_counter()
        entries, _ = read_safetensors_header(path)
        t1 = time.perf_counter()
        nonfinite = sum(scan.nonfinite for _, scan in scan_safetensors(path, entries))
        t2 = time.perf_counter()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    print(f"checkpoint: {size / 2**20:.0f} MiB in {len(entries)} tensors; non-finite found: {nonfinite}")
    print(f"header validation: {(t1 - t0) * 1e3:.2f} ms")
    print(f"streaming scan: {t2 - t1:.2f} s, {size / 2**20 / (t2 - t1):.0f} MiB/s")
    print(f"peak memory allocated during the scan: {peak / 2**20:.1f} MiB ({peak / size:.1%} of the file)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 512)
