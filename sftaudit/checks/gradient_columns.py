"""Rank 0's per-tensor gradient norms as a steps x tensors matrix that never sits in memory whole.

A billion norms (10^6 steps x 1,000 tensors) are 4 GB even in float32. The checks that judge every
norm (LOOP-05, LOOP-10, LOOP-15) judge each tensor against its own history, plus a few per-step sums
across tensors, so they read the matrix a block of tensors at a time, each block over every step.
The grad_cells view is read once per audit, a range of steps at a time, and each range is written,
transposed, to a private temporary file (unlinked at creation: nothing is left behind, even by a
crash); a block of tensors is then one read per range. The file is read with plain reads, not mapped,
so the pages the system caches for it are not counted against the audit's memory.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import numpy as np

ABSENT = np.float32(-1.0)  # no norm recorded for that tensor at that step (a norm is never negative)
STEP_VALUES = 1 << 23  # norms per range of steps read from DuckDB (32 MB as float32)
BLOCK_VALUES = 1 << 24  # norms per block of tensors handed to a check (64 MB as float32)


class GradientColumns:
    """`steps` (rank 0's, ascending), `names` (the tensors, by index), `graded` (per step: any norm recorded)
    and `blocks()`, the norms a block of tensors at a time."""

    def __init__(self, con):
        self.steps = con.sql("SELECT DISTINCT step FROM steps WHERE rank = 0 ORDER BY step").fetchnumpy()["step"]
        self.names = [
            r[0]
            for r in con.execute(
                "SELECT name FROM params WHERE rank = 0 AND idx IS NOT NULL "
                "AND seg = (SELECT max(seg) FROM params WHERE rank = 0) ORDER BY idx"
            ).fetchall()
        ]
        n, k = self.steps.size, len(self.names)
        self.graded = np.zeros(n, dtype=bool)
        self._rows = max(1, STEP_VALUES // max(k, 1))  # steps per range
        self._file = tempfile.TemporaryFile(prefix="sftaudit-grad-")
        if n and k:
            self._write(con, n, k)

    def _write(self, con, n: int, k: int) -> None:
        steps, fd = self.steps, self._file.fileno()
        contiguous = steps[-1] - steps[0] == n - 1  # the usual case: a step's row is its offset
        for lo in range(0, n, self._rows):
            hi = min(n, lo + self._rows)
            cells = con.sql(
                "SELECT step, idx, norm FROM grad_cells WHERE rank = 0 AND idx < ? AND step BETWEEN ? AND ?",
                params=[k, int(steps[lo]), int(steps[hi - 1])],
            ).fetchnumpy()
            step, idx, norm = cells["step"], cells["idx"], cells["norm"]
            rows = step - steps[0] if contiguous else np.searchsorted(steps, step)
            if not contiguous:  # a norm of a step without its step record (a crash) has no row
                ok = steps[np.minimum(rows, n - 1)] == step
                rows, idx, norm = rows[ok], idx[ok], norm[ok]
            block = np.full((k, hi - lo), ABSENT, dtype=np.float32)  # tensor-major: a tensor's range is contiguous
            block[idx, rows - lo] = norm
            self.graded[np.unique(rows)] = True
            _write_all(fd, memoryview(block).cast("B"), lo * k * 4)

    def blocks(self, absent: float = np.nan, values: int = BLOCK_VALUES) -> Iterator[tuple[int, np.ndarray]]:
        """(first tensor index, tensors x steps float32 norms) for consecutive blocks of tensors of about
        `values` norms; a norm not recorded reads as `absent` (NaN by default; `ABSENT` keeps it apart
        from a recorded NaN)."""
        n, k = self.steps.size, len(self.names)
        width = max(1, min(k, values // max(n, 1)))
        fd = self._file.fileno()
        for first in range(0, k, width):
            last = min(k, first + width)
            out = np.empty((last - first, n), dtype=np.float32)
            for lo in range(0, n, self._rows):
                rows = min(n, lo + self._rows) - lo
                size = (last - first) * rows * 4
                piece = os.pread(fd, size, (lo * k + first * rows) * 4)
                if len(piece) != size:
                    raise OSError(f"the audit's temporary gradient file is short: {len(piece)} of {size} bytes read")
                out[:, lo : lo + rows] = np.frombuffer(piece, dtype=np.float32).reshape(last - first, rows)
            if absent != ABSENT:
                out[out == ABSENT] = absent
            yield first, out


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def gradient_columns(ctx) -> GradientColumns:
    """The audit's `GradientColumns`, written once and kept on the context for every check that reads it."""
    cached = ctx.__dict__.get("_gradient_columns")
    if cached is None:
        cached = ctx.__dict__["_gradient_columns"] = GradientColumns(ctx.con)
    return cached
