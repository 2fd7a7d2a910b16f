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
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from ..core.artifacts import GRAD_SERIES, SERIES_DIR, artifact_root
from ..store.rundb import first_row, has_table

ABSENT = np.float32(-1.0)  # no norm recorded for that tensor at that step (a norm is never negative)
STEP_VALUES = 1 << 23  # norms per range of steps read from DuckDB (32 MB as float32)
BLOCK_VALUES = 1 << 24  # norms per block of tensors handed to a check (64 MB as float32)
T = TypeVar("T")


class GradientColumns:
    """`steps` (rank 0's, ascending), `names` (the tensors, by index), per step `graded` (any norm recorded)
    and `nonfinite` (a NaN or inf one), and `blocks()`, the norms a block of tensors at a time."""

    def __init__(self, con, run_dir):
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
        self.nonfinite = np.zeros(n, dtype=bool)  # per step: a recorded norm is NaN or inf
        self._rows = max(1, STEP_VALUES // max(k, 1))  # steps per range
        self._file = tempfile.TemporaryFile(prefix="sftaudit-grad-")
        if n and k:
            try:
                self._write(con, artifact_root(run_dir).resolve(), n, k)
            except BaseException as exc:
                self._file.close()
                if not isinstance(exc, OSError) or exc.errno is None:
                    raise
                raise OSError(
                    f"the audit's temporary copy of the gradient norms ({n * k * 4 / 2**30:.1f} GiB in "
                    f"{tempfile.gettempdir()}) could not be written ({exc.strerror}); point TMPDIR at a folder with room"
                ) from None

    def _write(self, con, root, n: int, k: int) -> None:
        """Every range of steps, in order, tensor-major: [tensors x steps of the range] one after another."""
        reduced = has_table(con, "grad_norms_reduced")
        ranges = _Ranges(self, n, k)
        # A sharded run (the whole tensors' norms are the reduction ingest stored) or a schema-1 run (the norms
        # are rows of a table): through the view, a range of steps at a time.
        if reduced or first_row(con, "SELECT 1 FROM grad_rows WHERE rank = 0 LIMIT 1"):
            for lo in range(0, n, self._rows):
                hi = min(n, lo + self._rows)
                ranges.add(
                    *_fetch(
                        con, "grad_cells", "AND step BETWEEN ? AND ?", [k, int(self.steps[lo]), int(self.steps[hi - 1])]
                    )
                )
                ranges.flush(hi)
        else:
            # The Parquet parts are read directly (pyarrow, two at a time), not through the view: DuckDB's
            # hand-over of a billion rows to Python costs several times their decoding. The same rows as
            # grad_cells: rank 0, the tensors its segment lists, the steps before the segment's cutoff.
            ranges.add(*_fetch(con, "grad_tail_cells", "", [k]))
            for next_row, part in _parts(con, root, self.steps, k):
                ranges.add(*part)
                ranges.flush(next_row)
        ranges.flush(n)

    def close(self) -> None:
        self._file.close()

    def _read(self, lo: int, first: int, last: int) -> np.ndarray:
        """Tensors `first`..`last` - 1 of the range of steps starting at row `lo`, tensors x steps."""
        n, k = self.steps.size, len(self.names)
        rows = min(n, lo + self._rows) - lo
        size = (last - first) * rows * 4
        piece = os.pread(self._file.fileno(), size, (lo * k + first * rows) * 4)
        if len(piece) != size:
            raise OSError(f"the audit's temporary gradient file is short: {len(piece)} of {size} bytes read")
        return np.frombuffer(piece, dtype=np.float32).reshape(last - first, rows)

    def blocks(self, absent: float = np.nan) -> Iterator[tuple[int, np.ndarray]]:
        """(first tensor index, tensors x steps float32 norms) for consecutive blocks of tensors of about
        `BLOCK_VALUES` norms; a norm not recorded reads as `absent` (NaN by default; `ABSENT` keeps it apart
        from a recorded NaN)."""
        n, k = self.steps.size, len(self.names)
        width = max(1, min(k, BLOCK_VALUES // max(n, 1)))
        for first in range(0, k, width):
            last = min(k, first + width)
            out = np.empty((last - first, n), dtype=np.float32)
            for lo in range(0, n, self._rows):
                out[:, lo : lo + self._rows] = self._read(lo, first, last)
            if absent != ABSENT:
                out[out == ABSENT] = absent
            yield first, out

    def map(self, judge: Callable[[int, np.ndarray], T], absent: float = np.nan) -> Iterator[T]:
        """`judge(first tensor index, block)` of every block, in order, two blocks at a time (numpy's sorts
        and ufuncs release the GIL: one block per core), at most three blocks read at once."""
        with ThreadPoolExecutor(max_workers=2) as pool:
            pending = []
            for first, block in self.blocks(absent):
                pending.append(pool.submit(judge, first, block))
                if len(pending) == 2:
                    yield pending.pop(0).result()
            for done in pending:
                yield done.result()


def _fetch(con, view: str, where: str, params: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    cells = con.sql(
        f"SELECT step, idx, norm::FLOAT AS norm FROM {view} WHERE rank = 0 AND idx < ? {where}", params=params
    ).fetchnumpy()
    return cells["step"], cells["idx"], cells["norm"]


def _parts(con, root, steps: np.ndarray, k: int) -> Iterator[tuple[int, tuple]]:
    """Rank 0's parts in step order, each as (the step row no later part starts before, (its step, idx and
    norm columns, the tensors its segment lists, the segment's cutoff or None))."""
    import pyarrow.parquet as pq  # only an audit with a columnar series reads parts

    listed = [
        (int(seg), int(first), root / file)
        for file, seg, first in con.execute(
            "SELECT file, regexp_extract(file, '/seg=(\\d+)/', 1), regexp_extract(file, 'part-(\\d+)\\.parquet$', 1) "
            "FROM ingest_state WHERE file LIKE ? AND records > 0 ORDER BY file",  # an empty part adds nothing
            [f"{SERIES_DIR}/{GRAD_SERIES}/rank=0/seg=%/part-%.parquet"],
        ).fetchall()
    ]
    cutoff = dict(con.execute("SELECT seg, cutoff FROM segment_cutoffs WHERE rank = 0").fetchall())
    tensors = dict(
        con.execute("SELECT seg, count(*) FROM params WHERE rank = 0 AND idx IS NOT NULL GROUP BY seg").fetchall()
    )
    # A part starting at or after its segment's cutoff was abandoned whole (the run went back to a checkpoint).
    listed = sorted(p for p in listed if p[1] < cutoff.get(p[0], np.inf))
    starts = np.searchsorted(steps, [first for _, first, _ in listed] + [np.iinfo(np.int64).max])

    def read(part):
        seg, _, path = part
        table = pq.read_table(path, columns=["step", "idx", "norm"], use_threads=False)
        return (*(table.column(c).to_numpy() for c in ("step", "idx", "norm")), tensors.get(seg, 0), cutoff.get(seg))

    with ThreadPoolExecutor(max_workers=2) as pool:  # pyarrow decodes without the GIL: one part per core
        ahead = [pool.submit(read, p) for p in listed[:2]]
        for i in range(len(listed)):
            if i + 2 < len(listed):
                ahead.append(pool.submit(read, listed[i + 2]))
            yield int(starts[i + 1]), ahead.pop(0).result()


class _Ranges:
    """The ranges of steps being filled, written out in order once no later cell can fall in them."""

    def __init__(self, columns: GradientColumns, n: int, k: int):
        self.columns, self.n, self.k = columns, n, k
        self.contiguous = columns.steps[-1] - columns.steps[0] == n - 1  # the usual case: a step's row is its offset
        self.open: dict[int, np.ndarray] = {}
        self.written = 0  # ranges written so far

    def add(
        self, step: np.ndarray, idx: np.ndarray, norm: np.ndarray, listed: int | None = None, cutoff: int | None = None
    ) -> None:
        """Cells of the tensors below `listed` (default: all) at steps before `cutoff` (default: any)."""
        k = self.k
        listed = k if listed is None else min(k, listed)
        if listed == k and step.size and step.size % k == 0:
            # The shim's parts are dense: each step's tensors 0..k-1 in order. Then the part is a steps x
            # tensors matrix already, checked in two passes and copied transposed (a scatter costs 3-4 times that).
            by_step = step.reshape(-1, k)
            if (idx.reshape(-1, k) == np.arange(k, dtype=idx.dtype)).all() and (by_step == by_step[:, :1]).all():
                return self._add_steps(by_step[:, 0], norm.reshape(-1, k), cutoff)
        keep = (idx >= 0) & (idx < listed)
        if cutoff is not None:
            keep &= step < cutoff
        rows, ok = self._rows_of(step)
        keep &= ok
        if not keep.all():
            rows, idx, norm = rows[keep], idx[keep], norm[keep]
        size = self.columns._rows
        which = rows // size
        for r in np.unique(which):
            sel = which == r
            width = min(self.n, (r + 1) * size) - r * size
            cells = np.full((width, k), ABSENT, dtype=np.float32)
            cells[rows[sel] - r * size, idx[sel]] = norm[sel]
            self._copy(int(r * size), cells, merge=True)

    def _rows_of(self, step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each step's row, and whether it has one (a norm of a step without its step record, a crash, has not)."""
        steps = self.columns.steps
        rows = step - steps[0] if self.contiguous else np.searchsorted(steps, step)
        ok = (rows >= 0) & (rows < self.n)
        ok[ok] = steps[rows[ok]] == step[ok]
        return rows, ok

    def _add_steps(self, step: np.ndarray, norms: np.ndarray, cutoff: int | None) -> None:
        rows, keep = self._rows_of(step)
        if cutoff is not None:
            keep &= step < cutoff
        if not keep.all():
            rows, norms = rows[keep], norms[keep]
        if rows.size and rows[-1] - rows[0] == rows.size - 1 and (np.diff(rows) == 1).all():
            self._copy(int(rows[0]), norms, merge=False)
        elif rows.size:  # steps missing in the middle: row by row
            cells = np.full((int(rows[-1] - rows[0]) + 1, self.k), ABSENT, dtype=np.float32)
            cells[rows - rows[0]] = norms
            self._copy(int(rows[0]), cells, merge=True)

    def _copy(self, first: int, cells: np.ndarray, merge: bool) -> None:
        """Steps x tensors `cells` from step row `first` on into their ranges; `merge`: where not ABSENT."""
        size, end = self.columns._rows, first + len(cells)
        self.columns.graded[first:end] |= (cells != ABSENT).any(axis=1) if merge else True
        self.columns.nonfinite[first:end] |= ~np.isfinite(cells).all(axis=1)
        for r in range(first // size, (end - 1) // size + 1):
            a, b = max(first, r * size), min(end, (r + 1) * size)
            block = self._range(r)[:, a - r * size : b - r * size]
            src = cells[a - first : b - first].T
            if merge:
                np.copyto(block, src, where=src != ABSENT)
            else:
                block[...] = src
            if r < self.written:  # a part out of step order (renamed by hand): its range is written again
                _write_all(self.columns._file.fileno(), memoryview(self.open.pop(r)).cast("B"), r * size * self.k * 4)

    def _range(self, r: int) -> np.ndarray:
        if r < self.written and r not in self.open:
            self.open[r] = self.columns._read(r * self.columns._rows, 0, self.k).copy()
        if r not in self.open:
            width = min(self.n, (r + 1) * self.columns._rows) - r * self.columns._rows
            self.open[r] = np.full((self.k, width), ABSENT, dtype=np.float32)  # tensor-major
        return self.open[r]

    def flush(self, before_row: int) -> None:
        """Write every range wholly before step row `before_row` (a range nothing fell in: all ABSENT)."""
        size, fd = self.columns._rows, self.columns._file.fileno()
        while (self.written + 1) * size <= before_row or (before_row >= self.n and self.written * size < self.n):
            block = self._range(self.written)
            _write_all(fd, memoryview(block).cast("B"), self.written * size * self.k * 4)
            del self.open[self.written]
            self.written += 1


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def gradient_columns(ctx) -> GradientColumns:
    """The audit's `GradientColumns`, written once and kept on the context for every check that reads it."""
    cached = ctx.__dict__.get("_gradient_columns")
    if cached is None:
        cached = ctx.__dict__["_gradient_columns"] = GradientColumns(ctx.con, ctx.run_dir)
        ctx.resources.append(cached)
    return cached
