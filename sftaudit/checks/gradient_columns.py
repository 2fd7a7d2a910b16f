"""Rank 0's per-tensor gradient norms as a steps x tensors matrix that never sits in memory whole.

A billion norms (10^6 steps x 1,000 tensors) are 4 GB even in float32. The checks that judge every
norm (LOOP-05, LOOP-10, LOOP-15) judge each tensor against its own history, plus a few per-step sums
across tensors, so they read the matrix a block of tensors at a time, each block over every step.
The norms are read a range of steps at a time, and each range is written, transposed, to a file; a block
of tensors is then one read per range. The file is read with plain reads, not mapped, so the pages the system
caches for it are not counted against the audit's memory.

**Carried from one audit to the next.** For the shim's columnar series (Parquet parts, journal tails) the file
is the run's columnar copy, kept in sftaudit's cache beside the run database (`CarriedCopy`), never in the run
folder. A range of steps is closed once every step in it is recorded and none of its norms comes from a
journal: the parts it was filled from are immutable, so the next audit keeps the closed ranges as they are,
reads only the parts that reach past them (and the tails), and writes only the open ranges at the end. What a
closed range was built from is written down with it: the steps it covers, the tensors, each part's identity
(inode, size, first block, as ingest recorded it), the segment cutoffs before its end. When any of that differs
(a resume that abandoned a closed step, a part rewritten or gone, other tensors), or a part read anew has a norm
in a closed range, the copy is built again from the start. Any other gradient source (a sharded run's reduced
norms, a schema-1 run's rows) is copied into a private temporary file, unlinked at creation, at each audit.

**What the checks carry.** A check's statistics of the closed step rows never change once later rows exist, so
LOOP-05, LOOP-10 and LOOP-15 keep them beside the copy (`GradientColumns.carried` / `carry`, one file a check)
and judge again only the rows past them, plus the history those rows are judged against (`map(first_row=...)`).
What a check carries is tied to the copy's generation (a new one each time the copy is built from the start: a
resume that abandoned a closed step, a rewritten part) and to a key of everything else it depends on (its options,
its window, the end of warmup): either changing, the check judges every row again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np

from ..core.artifacts import GRAD_SERIES, SERIES_DIR, artifact_root
from ..store.rundb import database_dir, first_row, has_table
from .carried_arrays import load_arrays, save_arrays

ABSENT = np.float32(-1.0)  # no norm recorded for that tensor at that step (a norm is never negative)
STEP_VALUES = 1 << 23  # norms per range of steps read from DuckDB (32 MB as float32)
# Steps per range at most: a range is carried once closed, so a re-audit judges again the open range (half of it on
# average) plus the steps since: at 2,048 about 1,000 steps, close to the 1,000 a shim's part of 1,000 tensors holds
# (whose journal tail is never carried), where 8,192 made it 4,000 (a re-audit of 10^6 x 1,000 cost twice the time).
RANGE_STEPS = 1 << 11
BLOCK_VALUES = 1 << 24  # norms per block of tensors handed to a check (64 MB as float32)
# Per-step sums across tensors are added a group of this many tensors at a time, in tensor order: the same sums
# whatever the blocks (they are as wide as the run is short), so carried sums equal a fresh audit's.
SUM_GROUP = 8
T = TypeVar("T")


class GradientColumns:
    """`steps` (rank 0's, ascending), `names` (the tensors, by index), per step `graded` (any norm recorded)
    and `nonfinite` (a NaN or inf one), and `blocks()`, the norms a block of tensors at a time."""

    def __init__(self, con, run_dir):
        # Rank 0 logs a step once (ingest sets an abandoned resumed step aside): sorted, the steps are distinct but
        # where a log repeats one; a DISTINCT in SQL costs five times the read.
        steps = con.sql("SELECT step FROM steps WHERE rank = 0 ORDER BY step").fetchnumpy()["step"]
        self.steps = np.unique(steps) if steps.size > 1 and not (np.diff(steps) > 0).all() else steps
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
        self._rows = max(1, min(RANGE_STEPS, STEP_VALUES // max(k, 1)))  # steps per range
        # A sharded run (the whole tensors' norms are the reduction ingest stored) or a schema-1 run (the norms
        # are rows of a table) is read through the view; the shim's series from its parts, into the carried copy.
        viewed = has_table(con, "grad_norms_reduced") or first_row(
            con, "SELECT 1 FROM grad_rows WHERE rank = 0 LIMIT 1"
        )
        carried = CarriedCopy(run_dir) if n and k and not viewed else None
        self._carried = carried
        self.generation: str | None = None  # the carried copy's, None when nothing is carried
        self.carried_rows = 0  # step rows unchanged since the audit before (what the checks carried may cover)
        self.closing_rows = 0  # step rows the next audit will find unchanged (what the checks may carry)
        where = carried.folder if carried else Path(tempfile.gettempdir())
        try:
            self._file = carried.open() if carried else tempfile.TemporaryFile(prefix="sftaudit-grad-")
            if carried:
                self._write_parts(con, artifact_root(run_dir).resolve(), n, k, carried)
            elif n and k:
                self._write_viewed(con, n, k)
        except BaseException as exc:
            if getattr(self, "_file", None) is not None:
                self._file.close()
            if not isinstance(exc, OSError) or exc.errno is None:
                raise
            raise OSError(
                f"the audit's copy of the gradient norms ({n * k * 4 / 2**30:.1f} GiB in {where}) could not be "
                f"written ({exc.strerror}); "
                + ("point SFTAUDIT_CACHE_DIR" if carried else "point TMPDIR")
                + " at a folder with room"
            ) from None

    def _write_viewed(self, con, n: int, k: int) -> None:
        """Every range of steps, in order, tensor-major: [tensors x steps of the range] one after another."""
        ranges = _Ranges(self, n, k)
        for lo in range(0, n, self._rows):
            hi = min(n, lo + self._rows)
            ranges.add(
                *_fetch(
                    con, "grad_cells", "AND step BETWEEN ? AND ?", [k, int(self.steps[lo]), int(self.steps[hi - 1])]
                )
            )
            ranges.flush(hi)
        ranges.flush(n)

    def _write_parts(self, con, root, n: int, k: int, carried: CarriedCopy) -> None:
        """The open ranges of the carried copy (every range when nothing can be carried). The Parquet parts are
        read directly (pyarrow, two at a time), not through the view: DuckDB's hand-over of a billion rows to
        Python costs several times their decoding. The same rows as grad_cells: rank 0, the tensors its segment
        lists, the steps before the segment's cutoff."""
        evidence = _Evidence(con, self)
        kept = carried.load(evidence)
        try:
            self._fill(con, root, n, k, evidence, kept)
        except _Stale:  # a part read anew reaches into a closed range: built again from the start
            kept = carried.load(evidence, reset=True)
            self._fill(con, root, n, k, evidence, kept)
        boundary = kept.boundary(self, evidence)
        carried.save(evidence, self, boundary, kept.generation)
        self.generation, self.carried_rows, self.closing_rows = kept.generation, kept.rows, boundary["rows"]

    def _fill(self, con, root, n: int, k: int, evidence: _Evidence, kept: _Kept) -> None:
        self.graded[:] = False
        self.nonfinite[:] = False
        self.graded[: kept.rows] = kept.graded
        self.nonfinite[: kept.rows] = kept.nonfinite
        ranges = _Ranges(self, n, k, closed=kept.rows)
        tail = _fetch(con, "grad_tail_cells", "", [k])
        evidence.tail_first = int(tail[0].min()) if tail[0].size else None
        ranges.add(*tail)
        for next_row, file, part in _parts(con, root, self.steps, k, skip=kept.closed_parts):
            ranges.add(*part, known=file in kept.straddling)
            if part[0].size:
                evidence.read[file] = (int(part[0].min()), int(part[0].max()))
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

    def blocks(self, absent: float = np.nan, first_row: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """(first tensor index, tensors x steps float32 norms) for consecutive blocks of tensors of about
        `BLOCK_VALUES` norms, a whole number of `SUM_GROUP`s, over the step rows from `first_row` on; a norm not
        recorded reads as `absent` (NaN by default; `ABSENT` keeps it apart from a recorded NaN)."""
        n, k = self.steps.size, len(self.names)
        width = max(1, min(k, max(SUM_GROUP, BLOCK_VALUES // max(n - first_row, 1) // SUM_GROUP * SUM_GROUP)))
        start = first_row // self._rows * self._rows
        for first in range(0, k, width):
            last = min(k, first + width)
            out = np.empty((last - first, n - first_row), dtype=np.float32)
            for lo in range(start, n, self._rows):
                piece = self._read(lo, first, last)
                skip = max(0, first_row - lo)
                out[:, lo + skip - first_row : lo + piece.shape[1] - first_row] = piece[:, skip:]
            if absent != ABSENT:
                out[out == ABSENT] = absent
            yield first, out

    def map(self, judge: Callable[[int, np.ndarray], T], absent: float = np.nan, first_row: int = 0) -> Iterator[T]:
        """`judge(first tensor index, block)` of every block (step rows from `first_row` on), in order, two blocks
        at a time (numpy's sorts and ufuncs release the GIL: one block per core), at most three blocks read at
        once."""
        with ThreadPoolExecutor(max_workers=2) as pool:
            pending = []
            for first, block in self.blocks(absent, first_row):
                pending.append(pool.submit(judge, first, block))
                if len(pending) == 2:
                    yield pending.pop(0).result()
            for done in pending:
                yield done.result()

    def carried(self, name: str, key: dict) -> dict[str, np.ndarray] | None:
        """What check `name` carried from the audit before (its arrays, ``rows`` the step rows they cover), when
        the copy is the same generation, those rows are unchanged and `key` (what else the check's statistics
        depend on) is the same; else None."""
        if self.generation is None:
            return None
        arrays = load_arrays(self._carried.folder / f"carried-{name}.arrays")
        if arrays is None or "meta" not in arrays:
            return None
        try:
            meta = json.loads(str(arrays.pop("meta")))
        except ValueError:  # not what `carry` writes
            return None
        rows = meta.get("rows") if isinstance(meta, dict) else None
        if meta != {"generation": self.generation, "key": key, "rows": rows}:
            return None
        if not isinstance(rows, int) or not 0 < rows <= self.carried_rows:
            return None
        return {**arrays, "rows": rows}

    def carry(self, name: str, key: dict, rows: int, arrays: dict[str, np.ndarray]) -> None:
        """Keep check `name`'s `arrays`, its statistics of the first `rows` step rows, for the next audit."""
        if self.generation is None or rows <= 0:
            return
        meta = json.dumps({"generation": self.generation, "key": key, "rows": rows})
        save_arrays(self._carried.folder / f"carried-{name}.arrays", {"meta": np.array(meta), **arrays})


def sum_by_group(values: np.ndarray) -> np.ndarray:
    """Per-step float64 sums of tensors x steps `values` (a block of tensors), one row per
    `SUM_GROUP` of tensors: added in order with `add_groups`, the same sums whatever the blocks were."""
    groups = -(-len(values) // SUM_GROUP)  # blocks start at a whole group (`blocks`)
    sums = np.zeros((groups, values.shape[1]))
    for row, values_row in enumerate(values):  # one tensor after another (numpy's sum may add pairwise)
        sums[row // SUM_GROUP] += values_row
    return sums


def add_groups(total: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """`total` plus each row of `groups` in turn (a row per group of tensors, not pairwise)."""
    for row in groups:
        total = total + row
    return total


def _fetch(con, view: str, where: str, params: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    cells = con.sql(
        f"SELECT step, idx, norm::FLOAT AS norm FROM {view} WHERE rank = 0 AND idx < ? {where}", params=params
    ).fetchnumpy()
    return cells["step"], cells["idx"], cells["norm"]


def _parts(con, root, steps: np.ndarray, k: int, skip=frozenset()) -> Iterator[tuple[int, str, tuple]]:
    """Rank 0's parts in step order but those in `skip` (files), each as (the step row no later part starts
    before, its file, (its step, idx and norm columns, the tensors its segment lists, the segment's cutoff or
    None))."""
    import pyarrow.parquet as pq  # only an audit with a columnar series reads parts

    listed = [
        (int(seg), int(first), file)
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
    todo = [(i, p) for i, p in enumerate(listed) if p[2] not in skip]

    def read(part):
        seg, _, file = part
        table = pq.read_table(root / file, columns=["step", "idx", "norm"], use_threads=False)
        return (*(table.column(c).to_numpy() for c in ("step", "idx", "norm")), tensors.get(seg, 0), cutoff.get(seg))

    with ThreadPoolExecutor(max_workers=2) as pool:  # pyarrow decodes without the GIL: one part per core
        ahead = [pool.submit(read, p) for _, p in todo[:2]]
        for j, (i, part) in enumerate(todo):
            if j + 2 < len(todo):
                ahead.append(pool.submit(read, todo[j + 2][1]))
            yield int(starts[i + 1]), part[2], ahead.pop(0).result()


class _Ranges:
    """The ranges of steps being filled, written out in order once no later cell can fall in them."""

    def __init__(self, columns: GradientColumns, n: int, k: int, closed: int = 0):
        self.columns, self.n, self.k = columns, n, k
        self.contiguous = columns.steps[-1] - columns.steps[0] == n - 1  # the usual case: a step's row is its offset
        self.open: dict[int, np.ndarray] = {}
        self.closed = closed  # step rows carried from the audit before, whole ranges: never written again
        self.written = closed // columns._rows  # ranges written so far

    def add(
        self,
        step: np.ndarray,
        idx: np.ndarray,
        norm: np.ndarray,
        listed: int | None = None,
        cutoff: int | None = None,
        known: bool = False,
    ) -> None:
        """Cells of the tensors below `listed` (default: all) at steps before `cutoff` (default: any). A cell in a
        closed range is left out when it comes from a part that filled that range before (`known`), and means
        the closed ranges must be built again (`_Stale`) otherwise."""
        k = self.k
        if self.closed:
            rows, ok = self._rows_of(step)
            inside = ok & (rows < self.closed) & (idx >= 0) & (idx < (k if listed is None else min(k, listed)))
            if cutoff is not None:
                inside &= step < cutoff
            if inside.any():
                if not known:
                    raise _Stale
                keep = ~inside
                step, idx, norm = step[keep], idx[keep], norm[keep]
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

    def written() -> GradientColumns:
        columns = GradientColumns(ctx.con, ctx.run_dir)
        ctx.resources.append(columns)
        return columns

    return ctx.shared("gradient_columns", written)


class _Stale(Exception):
    """A norm read anew falls in a closed range of the carried copy: the copy is built again."""


class _Evidence:
    """What the copy's closed ranges are built from, as the database says now: rank 0's tensors, steps, segment
    cutoffs and tensors listed per segment, and each part's identity; filled in as the audit reads: each part
    read (its first and last step) and the first step of the journal tails."""

    def __init__(self, con, columns: GradientColumns):
        self.steps = columns.steps
        self.shape = [len(columns.names), columns._rows]
        self.names = hashlib.sha256("\n".join(columns.names).encode("utf-8", "surrogateescape")).hexdigest()
        self.parts = {
            file: [int(offset), int(device), int(inode), head]
            for file, offset, device, inode, head in con.execute(
                'SELECT file, "offset", device, inode, head FROM ingest_state WHERE file LIKE ?',
                [f"{SERIES_DIR}/{GRAD_SERIES}/rank=0/seg=%/part-%.parquet"],
            ).fetchall()
        }
        self.cutoffs = {
            str(seg): int(c)
            for seg, c in con.execute("SELECT seg, cutoff FROM segment_cutoffs WHERE rank = 0").fetchall()
        }
        self.listed = {
            str(seg): int(n)
            for seg, n in con.execute(
                "SELECT seg, count(*) FROM params WHERE rank = 0 AND idx IS NOT NULL GROUP BY seg"
            ).fetchall()
        }
        self.read: dict[str, tuple[int, int]] = {}
        self.tail_first: int | None = None

    def steps_digest(self, rows: int) -> str:
        return hashlib.sha256(np.ascontiguousarray(self.steps[:rows], dtype=np.int64).tobytes()).hexdigest()

    def cutoffs_before(self, last_step: int | None) -> dict[str, int]:
        """The cutoffs that abandon a step up to `last_step` (None: no step)."""
        return {} if last_step is None else {seg: c for seg, c in self.cutoffs.items() if c <= last_step}


class _Kept:
    """The closed ranges carried from the audit before: `rows` step rows, their per-step flags, the parts they
    were filled from (`closed_parts`: wholly inside them; `straddling`: reaching past their end)."""

    def __init__(self, rows: int = 0, graded=None, nonfinite=None, closed=None, straddling=None, generation=None):
        self.rows = rows
        self.generation = generation or uuid.uuid4().hex  # a copy built from the start is a new generation
        self.graded = np.zeros(0, dtype=bool) if graded is None else graded
        self.nonfinite = np.zeros(0, dtype=bool) if nonfinite is None else nonfinite
        self.closed_parts: dict[str, list] = closed or {}
        self.straddling: dict[str, list] = straddling or {}

    def boundary(self, columns: GradientColumns, evidence: _Evidence) -> dict:
        """What the copy carries to the next audit: the whole ranges before the first step a journal holds (its
        norms will move into a part) and before the last range (still filling), and the parts in them."""
        size, n = columns._rows, columns.steps.size
        rows = n // size * size
        if evidence.tail_first is not None:
            rows = min(rows, int(np.searchsorted(columns.steps, evidence.tail_first)) // size * size)
        rows = max(rows, self.rows)  # never less than was carried: a closed range never reopens
        last = int(columns.steps[rows - 1]) if rows else None
        closed = dict(self.closed_parts)
        straddling = {}
        for file, (first, final) in evidence.read.items():
            if last is not None and final <= last:
                closed[file] = evidence.parts[file]
            elif last is not None and first <= last:
                straddling[file] = evidence.parts[file]
        return {"rows": rows, "last_step": last, "closed": closed, "straddling": straddling}


class CarriedCopy:
    """The run's columnar copy of rank 0's norms in sftaudit's cache (``grad-columns.f32``), with what its
    closed ranges were built from (``grad-columns.json``, written last and whole) and their per-step flags
    (``grad-columns.flags``). The run's lock is held while it is read or written (the audit's)."""

    FORMAT = 3  # 2: ranges of at most 8,192 steps; 3: of 2,048 (RANGE_STEPS)
    DATA, STATE, FLAGS = "grad-columns.f32", "grad-columns.json", "grad-columns.flags"

    def __init__(self, run_dir):
        self.folder = database_dir(run_dir)

    def open(self):
        fd = os.open(self.folder / self.DATA, os.O_RDWR | os.O_CREAT, 0o600)
        self.file = os.fdopen(fd, "r+b")
        return self.file

    def load(self, evidence: _Evidence, reset: bool = False) -> _Kept:
        """The closed ranges if everything they were built from is as it was; else none (the state is removed
        first, so a copy half rebuilt is never taken for a closed one)."""
        kept = None if reset else self._kept(evidence)
        if kept is None:
            (self.folder / self.STATE).unlink(missing_ok=True)
            return _Kept()
        return kept

    def _kept(self, evidence: _Evidence) -> _Kept | None:
        try:
            state = json.loads((self.folder / self.STATE).read_text(encoding="utf-8"))
            rows = state["rows"]
            same = (
                state["format"] == self.FORMAT
                and state["shape"] == evidence.shape
                and state["names"] == evidence.names
                and isinstance(rows, int)
                and 0 < rows <= evidence.steps.size
                and state["steps"] == evidence.steps_digest(rows)
                and state["cutoffs"] == evidence.cutoffs_before(int(evidence.steps[rows - 1]))
                and all(evidence.listed.get(seg) == n for seg, n in state["listed"].items())
                and all(
                    evidence.parts.get(file) == identity
                    for file, identity in {**state["closed"], **state["straddling"]}.items()
                )
                and os.fstat(self.file.fileno()).st_size >= rows * evidence.shape[0] * 4
            )
            if not same:
                return None
            flags = load_arrays(self.folder / self.FLAGS)
            if flags is None:
                return None
            graded, nonfinite = flags["graded"], flags["nonfinite"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        if graded.shape != (rows,) or nonfinite.shape != (rows,) or graded.dtype != bool or nonfinite.dtype != bool:
            return None
        if not isinstance(state.get("generation"), str):
            return None
        return _Kept(rows, graded, nonfinite, state["closed"], state["straddling"], state["generation"])

    def save(self, evidence: _Evidence, columns: GradientColumns, carried: dict, generation: str) -> None:
        rows = carried["rows"]
        if not rows:
            return
        self.file.flush()
        save_arrays(self.folder / self.FLAGS, {"graded": columns.graded[:rows], "nonfinite": columns.nonfinite[:rows]})
        state = {
            "format": self.FORMAT,
            "generation": generation,
            "shape": evidence.shape,
            "names": evidence.names,
            "rows": rows,
            "steps": evidence.steps_digest(rows),
            "cutoffs": evidence.cutoffs_before(carried["last_step"]),
            "listed": evidence.listed,
            "closed": carried["closed"],
            "straddling": carried["straddling"],
        }
        tmp = self.folder / f".{self.STATE}.tmp"
        tmp.write_text(json.dumps(state), encoding="utf-8")
        os.replace(tmp, self.folder / self.STATE)
