"""LOOP-15's carried work in a re-audit of a 10^6-step x 1,000-tensor run: CPU seconds of its stale-cell pass
over the steps a re-audit judges again, taking each tensor's carried smallest changes (the smallest 1.25% + 16 of a
million, sorted), and of saving and loading them.

    PYTHONPATH=$PWD python benchmarks/loop15_carried.py [--module FILE] [--repeats 5]

Two re-audits: one where the columnar copy closed 2,048 more steps (their changes merged into the carried
smallest, saved again) and one where it closed none (3,000 open steps judged, nothing new to carry). `--module`
times another version of `sftaudit/checks/loop15_trainable_set.py` (e.g. `git show REV:that/path > FILE`), with the
same inputs, for a before/after.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from sftaudit.checks import loop15_trainable_set

RUN_STEPS, TENSORS, JUDGED_STEPS, CLOSED = 1_000_000, 1_000, 3_001, 2_048


def _module(path: Path | None):
    if path is None:
        return loop15_trainable_set
    spec = importlib.util.spec_from_file_location("sftaudit.checks._loop15_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inputs(rng: np.random.Generator):
    """Norms varying ~15% a step over the steps judged again, and what a million steps before carried: the count
    of each tensor's changes and their smallest (the k-th smallest of |N(0, 0.15)| ~ 0.15 x 1.25 x 0.01 x sqrt(pi/2))."""
    norms = np.exp(0.15 * rng.standard_normal((TENSORS, JUDGED_STEPS))).astype(np.float32)
    k = RUN_STEPS // 100
    width = k + k // 4 + 16
    smallest = np.sort(rng.uniform(0, 0.15 * 1.25 * width / RUN_STEPS * 1.2533, (TENSORS, width)), axis=1)
    return norms, (np.full(TENSORS, RUN_STEPS - 1, dtype=np.int64), smallest.astype(np.float32))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", type=Path, help="another version of loop15_trainable_set.py to time")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    module = _module(args.module)
    norms, carried = _inputs(np.random.default_rng(35))
    consecutive = np.ones(JUDGED_STEPS - 1, dtype=bool)
    print(
        f"{args.module or 'this tree'}: {TENSORS} tensors, {JUDGED_STEPS - 1} pairs judged again, carried smallest "
        f"{carried[1].shape[1]:,} a tensor ({carried[1].nbytes / 1e6:.0f} MB)"
    )
    with tempfile.TemporaryDirectory(prefix="loop15-carried-") as folder:
        path = Path(folder) / "carried.npz"
        for what, close_pair in (("2,048 steps closed", CLOSED), ("none closed", 0)):
            judge, save, load = [], [], []
            for _ in range(args.repeats):
                t = time.process_time()
                part = module._stale_cells(0, norms, consecutive, 0, close_pair, carried)
                judge.append(time.process_time() - t)
                t = time.process_time()
                np.savez(path, count=part[2], smallest=part[3])
                save.append(time.process_time() - t)
                t = time.process_time()
                with np.load(path) as state:
                    state["count"], state["smallest"]
                load.append(time.process_time() - t)
            print(
                f"  {what}: judged {statistics.median(judge):.3f} s CPU (min {min(judge):.3f}), saved "
                f"{statistics.median(save):.3f} s, loaded {statistics.median(load):.3f} s (medians of {args.repeats})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
