"""Artifacts -> the run database (`sftaudit.store.rundb`). Incremental: each file's ingested byte offset is
remembered, so a second ingest of a growing run reads only what was appended since.

The gradient norms are not copied: ``grad_pieces(rank, seg, step, idx, tensor, norm)`` is a view
(made by `connect`, on every connection) over the run's Parquet parts where they lie, plus two
small tables: ``grad_journal`` (the journal tails, read again on every ingest: a journal becomes a
part while the run goes on) and ``grad_rows`` (schema version 1 runs, whose norms are the
``grad_norms`` lists of their ``steps.jsonl``). The database stores which parts it has validated
(``ingest_state``), so a re-audit reads only new records and new parts.

Distributed runs are reduced here, with no torch: ``grad_norms`` holds every rank's per-tensor
gradient norm of the *whole* tensor, as a single process records it. A ``sharded`` tensor's norm
is the root of the sum of its pieces' squares over one replica group; a ``replicated`` one takes
the lowest rank's value (LOOP-17 compares the other replicas); a tensor whose pieces do not cover
all its elements (a rank missing) gets no row at that step, never a smaller norm. For sharded runs
``steps.grad_norm`` becomes the reduced total (NULL where a tensor is incomplete).

A resumed run is one timeline: when a later segment starts at step s, the earlier
segments' records of steps >= s (the stretch the resume abandoned) move to
``superseded_<table>``, so every check reads the run the checkpoints describe. For the gradient
norms that is a filter: ``segment_cutoffs`` holds each segment's first abandoned step, and
``superseded_grad_pieces`` is the view of what it leaves out.

A database that no longer describes the artifacts on disk (a file replaced, shortened or rewritten, rows
deleted), or that another sftaudit made (its ``sftaudit_meta`` format differs or is missing), is rebuilt
from the artifacts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb

from ..core.artifacts import (
    COLUMNAR_IMPORT_KINDS,
    GRAD_SERIES,
    RECORD_KINDS,
    ROLL_VALUES,
    SCHEMA_VERSION,
    SERIES_DIR,
    artifact_root,
    part_name,
    read_journal,
)
from ..errors import InputError
from ..readers.parquet_pages import page_header_fault
from ..schema.records import RECORDS
from .rundb import (
    DATABASE_FORMAT,
    RECORD_COLUMNS,
    STAGING_DIR,
    connect,
    create_tables,
    database_format,
    database_path,
    first_row,
    gradient_views,
    has_table,
    remove_database,
    run_lock,
    validated_parts,
)

# Bounded reads (configurable in the audit config's [ingest] section): one record (line) and one file.
DEFAULT_MAX_RECORD_BYTES = 64 * 2**20  # a full sample row of a long context is a few MB
DEFAULT_MAX_FILE_BYTES = 16 * 2**30
HEAD_BYTES = 4096  # an artifact is the file ingested before if its first block is unchanged
_COPY_BLOCK = 8 * 2**20
# Rows a gradient-norm part may hold: the shim rolls a part every ROLL_VALUES norms, plus the step that crosses it
# (one norm per tensor the manifest lists; MAX_PART_ROWS where it lists none). One claiming more is no part of ours
# (a decompression bomb: its footer is read, never its rows).
MAX_PART_ROWS = 64 * ROLL_VALUES
# The bytes a part's rows take uncompressed (step, idx, norm, norm_post_clip: 20), with room for page overhead.
PART_ROW_BYTES, PART_SLACK_BYTES = 64, 2**16


def rank_folders(run_dir: str | Path) -> list[tuple[int, Path]]:
    root = artifact_root(run_dir)
    if not Path(run_dir).is_dir():
        raise InputError(
            f"{run_dir}: "
            + ("not a directory; give the run's output folder" if Path(run_dir).exists() else "no such run directory")
        )
    ranks = sorted(
        (int(m.group(1)), p)
        for p in root.glob("rank-*")
        if (m := re.fullmatch(r"rank-(\d{1,6})", p.name)) and p.is_dir()
    )
    if not ranks:
        raise InputError(f"{run_dir}: no sftaudit artifacts (expected {root}/rank-<r>/)")
    return ranks


def ingest(
    run_dir: str | Path, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
) -> dict[str, int]:
    """Load new records into the run's database; returns the number of new records per kind.
    A database that no longer matches the artifacts (a file replaced, shortened or rewritten, rows
    deleted) is rebuilt from scratch: offsets are only trusted for the files they were taken on."""
    with ingested(run_dir, max_record_bytes, max_file_bytes) as (_, added):
        return added


@contextmanager
def ingested(
    run_dir: str | Path, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
) -> Iterator[tuple[duckdb.DuckDBPyConnection, dict[str, int]]]:
    """`ingest`, yielding its connection, still open under the run's lock, and the new records per kind: an audit
    judges on it (each opening of the database costs a catalog check and the views over every part). Its gradient
    views name the parts validated, no other file."""
    ranks = rank_folders(run_dir)
    files = _RunFiles(run_dir, max_record_bytes, max_file_bytes)
    with run_lock(run_dir):
        # The views are made by `_ingest_all`, over the parts it validated: none over the parts before.
        con = connect(run_dir, views=False)
        try:
            if _stale(con, files):
                con.close()
                remove_database(run_dir)
                con = connect(run_dir, views=False)
            added = _ingest_all(con, files, ranks)
            yield con, added
        finally:
            con.close()


def _ingest_all(con: duckdb.DuckDBPyConnection, files: _RunFiles, ranks: list[tuple[int, Path]]) -> dict[str, int]:
    run_dir = files.run_dir
    con.begin()  # all or nothing: offsets only move with the rows they stand for
    create_tables(con)
    added = {kind: 0 for kind in RECORD_KINDS}
    last_row = first_row(con, "SELECT coalesce(max(rowid), -1) FROM steps")[0]  # the steps ingested before
    for rank, folder in ranks:
        for kind in RECORD_KINDS:
            added[kind] += _ingest_file(con, files, rank, kind, folder / f"{kind}.jsonl")
        for kind in COLUMNAR_IMPORT_KINDS:
            added[kind] += _ingest_columnar(con, files, rank, kind, folder / f"{kind}.parquet")
    if not first_row(con, "SELECT count(*) FROM manifest")[0]:
        raise InputError(
            f"{run_dir}: artifacts have no manifest record (none in rank-<r>/manifest.jsonl could be read); "
            f"the shim writes it when recording starts: record the run again"
        )
    if added["steps"]:
        _refuse_repeated_steps(con, last_row)
    _ingest_series(con, files)
    _supersede_abandoned_steps(con)
    parts = validated_parts(con, run_dir)
    gradient_views(con, parts)
    reduced = _reduced_tables(con)
    _reduce_gradients(con, "grad_pieces", "grad_norms_reduced")
    if has_table(con, "superseded_grad_pieces"):
        _reduce_gradients(con, "superseded_grad_pieces", "superseded_grad_norms_reduced")
    if _reduced_tables(con) != reduced:  # grad_norms reads the reduction or the pieces, whichever is there now
        gradient_views(con, parts)
    _reduced_step_totals(con)
    con.commit()
    return added


def _reduced_tables(con: duckdb.DuckDBPyConnection) -> list[bool]:
    return [has_table(con, t) for t in ("grad_norms_reduced", "superseded_grad_norms_reduced")]


def _refuse_repeated_steps(con: duckdb.DuckDBPyConnection, last_row: int) -> None:
    """The shim writes each step once per segment (a resume starts a new one): a step recorded twice in one
    segment is artifacts copied into themselves, and no check could tell which record to judge. The steps
    ingested before (rowid <= `last_row`) were refused then or found once each: only the steps from the first new
    one's on are grouped (a group-by over a million steps cost 0.1 s of CPU at each poll of a watch)."""
    if first_row(con, "SELECT bool_or(coalesce(manifest->>'$.imported' = 'true', false)) FROM manifest")[0]:
        return  # an importer writes the steps its logs hold, merged
    repeated = first_row(
        con,
        """SELECT rank, seg, min(step), count(*) FROM (SELECT rank, seg, step FROM steps
               WHERE step >= (SELECT min(step) FROM steps WHERE rowid > ?) OR step IS NULL
               GROUP BY ALL HAVING count(*) > 1) GROUP BY ALL ORDER BY rank, seg LIMIT 1""",
        [last_row],
    )
    if repeated is not None and repeated[0] is not None:
        rank, seg, step, n = repeated
        raise InputError(
            f"rank-{rank}/steps.jsonl records {n} step(s) more than once in segment {seg} (first step {step}); "
            f"the shim writes each step once per segment: repair or re-record the artifacts"
        )


def _stale(con: duckdb.DuckDBPyConnection, files: _RunFiles) -> bool:
    """Whether the database describes other files than the artifacts now on disk, or lost rows."""
    tables = {
        t
        for (t,) in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_catalog <> 'temp'"
        ).fetchall()
    }
    if not tables:
        return False
    if database_format(con) != DATABASE_FORMAT:
        return True  # made by another sftaudit (or not by sftaudit): rebuilt from the artifacts
    root = str(artifact_root(files.run_dir))
    expected: dict[tuple[int, str], int] = {}  # the rows of each rank's kind, over its files (JSONL, Parquet)
    for key, offset, records, inode, device, head in con.execute(
        'SELECT file, "offset", records, inode, device, head FROM ingest_state'
    ).fetchall():
        path = os.path.join(root, key)
        if not os.path.lexists(path):
            return True
        fd, st = files.open(path)
        try:
            final = key.startswith(f"{SERIES_DIR}/") or key.endswith(".parquet")  # parts are never appended to
            grown = st.st_size != offset if final else st.st_size < offset
            if (st.st_ino, st.st_dev) != (inode, device) or grown or _head(fd, offset) != head:
                return True
        finally:
            os.close(fd)
        rank, kind = _file_kind(key)
        if kind is not None:
            expected[rank, kind] = expected.get((rank, kind), 0) + records
    return any(_stored_rows(con, tables, rank, kind) != n for (rank, kind), n in expected.items())


def _file_kind(key: str) -> tuple[int, str | None]:
    m = re.fullmatch(r"rank-(\d+)/(\w+)\.(jsonl|parquet)", key)
    return (int(m.group(1)), m.group(2) if m.group(2) in RECORD_KINDS else None) if m else (-1, None)


def _stored_rows(con: duckdb.DuckDBPyConnection, tables: set[str], rank: int, kind: str) -> int:
    """The rows a kind's records became (the timeline moved by a resume included)."""
    return sum(
        first_row(con, f'SELECT count(*) FROM "{t}" WHERE rank = ?', [rank])[0]
        for t in (kind, f"superseded_{kind}")
        if t in tables
    )


class _RunFiles:
    """The run's artifacts, each opened as a regular file inside the run folder (a symlink may point within
    it), no larger than the limit; InputError otherwise. A folder is resolved once per ingest: thousands of
    parts in one folder cost one resolution, not thousands."""

    def __init__(self, run_dir: str | Path, max_record_bytes: int, max_file_bytes: int):
        self.run_dir, self.inside = run_dir, os.path.realpath(run_dir)
        self.max_record_bytes, self.max_file_bytes = max_record_bytes, max_file_bytes
        self._folders: dict[str, str] = {}

    def real(self, path: str | Path) -> str:
        folder, name = os.path.split(os.fspath(path))
        if folder not in self._folders:
            self._folders[folder] = os.path.realpath(folder)
        real = os.path.join(self._folders[folder], name)
        return os.path.realpath(real) if os.path.islink(real) else real

    def open(self, path: str | Path) -> tuple[int, os.stat_result]:
        """The artifact opened for reading, and its status. Never blocks (a FIFO, a device)."""
        real = self.real(path)
        if os.path.commonpath([real, self.inside]) != self.inside:
            raise InputError(f"{path}: a link to {real}, outside the run folder; artifacts must be files inside it")
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise InputError(f"{path}: cannot open ({exc.strerror}); check its permissions") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise InputError(f"{path}: not a regular file (a FIFO, device or folder); artifacts must be plain files")
        if st.st_size > self.max_file_bytes:
            os.close(fd)
            raise InputError(
                f"{path}: {st.st_size} bytes, over the {self.max_file_bytes}-byte limit per artifact file; "
                f"raise [ingest] max_file_bytes in the config if the run is really that large"
            )
        return fd, st


def _head(fd: int, offset: int) -> str:
    """A hash of the file's first block (as far as it was ingested): a file rewritten in place differs."""
    return hashlib.sha256(os.pread(fd, min(offset, HEAD_BYTES), 0)).hexdigest()


# Tables whose rows belong to a step of the timeline (events stay: they are the run's history).
TIMELINE_TABLES = (
    "steps",
    "batches",
    "samples",
    "grad_hists",
    "probes",
    "generations",
    "evals",
    "metrics",
    "checkpoints",
)


def _supersede_abandoned_steps(con: duckdb.DuckDBPyConnection) -> None:
    if first_row(con, "SELECT count(DISTINCT seg) FROM steps")[0] < 2:
        return
    # The gradient norms stay where they are; a segment's first abandoned step filters them (in the views).
    superseded = first_row(con, "SELECT count(*) FROM information_schema.tables WHERE table_name = 'superseded_steps'")[
        0
    ]
    con.execute(f"""CREATE OR REPLACE TABLE segment_cutoffs AS
        WITH starts AS (SELECT rank, seg, min(step) AS first_step
                        FROM (SELECT rank, seg, step FROM steps
                              {"UNION ALL SELECT rank, seg, step FROM superseded_steps" if superseded else ""})
                        GROUP BY rank, seg)
        SELECT a.rank, a.seg, min(b.first_step) AS cutoff FROM starts a JOIN starts b ON b.rank = a.rank AND b.seg > a.seg
        GROUP BY a.rank, a.seg""")
    con.execute(
        "CREATE OR REPLACE TEMP TABLE segment_starts AS SELECT rank, seg, min(step) AS first_step "
        "FROM steps GROUP BY rank, seg"
    )
    for table in TIMELINE_TABLES:
        abandoned = (
            f"FROM segment_starts s WHERE s.rank = {table}.rank AND s.seg > {table}.seg "
            f"AND s.first_step <= {table}.step"
        )
        con.execute(f"CREATE TABLE IF NOT EXISTS superseded_{table} AS SELECT * FROM {table} WITH NO DATA")
        # A database ingested by an older sftaudit: its superseded copy gains the newer fields too.
        for name, dtype in con.execute(
            "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = ? AND column_name "
            "NOT IN (SELECT column_name FROM information_schema.columns WHERE table_name = ?)",
            [table, f"superseded_{table}"],
        ).fetchall():
            con.execute(f'ALTER TABLE superseded_{table} ADD COLUMN "{name}" {dtype}')
        con.execute(f"INSERT INTO superseded_{table} BY NAME SELECT * FROM {table} WHERE EXISTS (SELECT 1 {abandoned})")
        con.execute(
            f"DELETE FROM {table} USING segment_starts s WHERE s.rank = {table}.rank "
            f"AND s.seg > {table}.seg AND s.first_step <= {table}.step"
        )
    con.execute("DROP TABLE segment_starts")


# Each rank's pieces with their layout; a manifest without layouts (older artifacts) is one process.
PIECES_SQL = """
    SELECT g.rank, g.seg, g.step, g.idx, g.tensor, g.norm, coalesce(l.kind, 'local') AS kind, l.numel,
           coalesce(l.local_numel, l.numel) AS local_numel, coalesce(l.replica, g.rank) AS replica
    FROM {pieces} g LEFT JOIN params l ON l.rank = g.rank AND l.seg = g.seg AND l.idx = g.idx
"""


def _reduce_gradients(con: duckdb.DuckDBPyConnection, pieces: str, reduced: str) -> None:
    """`reduced` = every rank's whole-tensor norms, rebuilt from all the ranks' pieces."""
    if not first_row(con, "SELECT count(*) FROM params WHERE coalesce(kind, 'local') <> 'local'")[0]:
        con.execute(f"DROP TABLE IF EXISTS {reduced}")  # one process per rank: grad_norms is the pieces, as is
        return
    con.execute(f"""
        CREATE OR REPLACE TABLE {reduced} AS
        WITH p AS ({PIECES_SQL.format(pieces=pieces)}),
             first_replica AS (SELECT seg, step, idx, min(replica) AS replica FROM p WHERE kind = 'sharded'
                               GROUP BY ALL),
             whole AS (
                 SELECT seg, step, idx,
                        CASE any_value(kind) WHEN 'replicated' THEN arg_min(norm, rank)
                                             WHEN 'sharded' THEN sqrt(sum(norm * norm)) END AS norm,
                        CASE any_value(kind) WHEN 'replicated' THEN true
                                             WHEN 'sharded' THEN sum(local_numel) = any_value(numel)
                                             ELSE false END AS complete  -- a Partial placement cannot be reduced
                 FROM p LEFT JOIN first_replica f USING (seg, step, idx)
                 WHERE p.kind IN ('replicated', 'partial') OR p.replica = f.replica
                 GROUP BY seg, step, idx)
        SELECT p.rank, p.seg, p.step, p.idx, p.tensor, CASE WHEN p.kind = 'local' THEN p.norm ELSE w.norm END AS norm
        FROM p LEFT JOIN whole w USING (seg, step, idx)
        WHERE p.kind = 'local' OR w.complete""")


def _reduced_step_totals(con: duckdb.DuckDBPyConnection) -> None:
    """A sharded rank recorded the norm of its own pieces: its steps' total becomes the whole
    model's, or NULL where a tensor's pieces are incomplete."""
    if not first_row(con, "SELECT count(*) FROM params WHERE kind IN ('sharded', 'partial')")[0]:
        return
    con.execute("""
        UPDATE steps SET grad_norm = t.total FROM (
            SELECT p.rank, p.seg, p.step,
                   CASE WHEN count(g.norm) = count(*) THEN sqrt(sum(g.norm * g.norm)) END AS total
            FROM grad_pieces p LEFT JOIN grad_norms g USING (rank, seg, step, idx) GROUP BY ALL) t
        WHERE steps.rank = t.rank AND steps.seg = t.seg AND steps.step = t.step""")


_PART = re.compile(r"part-(\d{9,18})\.parquet")
_JOURNAL = re.compile(r"journal-(\d{9,18})\.bin")
# What a gradient-norm part must hold (Parquet physical types).
_PART_COLUMNS = {"step": "INT64", "idx": "INT32", "norm": "FLOAT"}


def _series_listing(run_dir: str | Path) -> list[tuple[int, int, Path, list[str], list[Path]]]:
    """(rank, segment, folder, part names, journals) of the gradient-norm series, listed once per ingest
    (other names there are not ours: ignored; a folder that is a link is not followed)."""
    out = []
    for by_rank in (artifact_root(run_dir) / SERIES_DIR / GRAD_SERIES).glob("rank=*"):
        r = re.fullmatch(r"rank=(\d{1,6})", by_rank.name)
        if not (r and by_rank.is_dir() and not by_rank.is_symlink()):
            continue
        for folder in by_rank.glob("seg=*"):
            g = re.fullmatch(r"seg=(\d{1,6})", folder.name)
            if not (g and folder.is_dir() and not folder.is_symlink()):
                continue
            # The journals first: one may turn into a part meanwhile, which the parts' listing then holds.
            journals = [folder / n for n in sorted(os.listdir(folder)) if _JOURNAL.fullmatch(n)]
            parts = [n for n in sorted(os.listdir(folder)) if _PART.fullmatch(n)]
            out.append((int(r.group(1)), int(g.group(1)), folder, parts, journals))
    return sorted(out)


def _ingest_series(con: duckdb.DuckDBPyConnection, files: _RunFiles) -> None:
    """New Parquet parts are validated and listed (they are read in place, never copied); the journal
    tails are read again whole (small: a journal becomes a part every few thousand steps)."""
    import numpy as np
    import pyarrow as pa

    root = artifact_root(files.run_dir)
    known = {
        f
        for (f,) in con.execute(
            "SELECT file FROM ingest_state WHERE starts_with(file, ?)", [f"{SERIES_DIR}/"]
        ).fetchall()
    }
    con.execute("DELETE FROM grad_journal")
    recorded = " UNION ALL ".join(
        f"SELECT rank, seg, step FROM {t}" for t in ("steps", "superseded_steps") if has_table(con, t)
    )
    validated: list[tuple] = []  # (rank, seg, steps, ingest_state row) of each new part, inserted at once
    for rank, seg, folder, parts, journals in _series_listing(files.run_dir):
        prefix = folder.relative_to(root).as_posix()
        for name in parts:
            key = f"{prefix}/{name}"
            if key not in known:
                validated.append((rank, seg, *_part(files, folder / name, key, _max_part_rows(con, rank, seg))))
        # A journal's last step may lack its steps record (killed between the two): it is left out.
        last = first_row(con, f"SELECT max(step) FROM ({recorded}) WHERE rank = ? AND seg = ?", [rank, seg])[0]
        for journal in journals:
            m = _JOURNAL.fullmatch(journal.name)
            if part_name(int(m.group(1))) in parts or last is None:
                continue  # a part holds it (killed between the part's rename and the journal's delete)
            columns = _read_journal(journal, files)
            keep = columns["step"] <= last
            if keep.any():
                con.register(
                    "journal_rows",
                    pa.table(
                        {"step": columns["step"][keep], "idx": columns["idx"][keep], "norm": columns["norm"][keep]}
                    ),
                )
                con.execute("INSERT INTO grad_journal SELECT ?, ?, step, idx, norm FROM journal_rows", [rank, seg])
                con.unregister("journal_rows")
    if not validated:
        return
    steps = [v[2] for v in validated]
    con.register(
        "part_steps",
        pa.table(
            {
                "rank": np.concatenate([np.full(len(st), v[0], np.int32) for v, st in zip(validated, steps)]),
                "seg": np.concatenate([np.full(len(st), v[1], np.int32) for v, st in zip(validated, steps)]),
                "step": np.concatenate(steps),
            }
        ),
    )
    con.execute("INSERT INTO grad_part_steps SELECT rank, seg, step FROM part_steps")
    con.unregister("part_steps")
    state = list(zip(*(v[3] for v in validated)))
    con.register(
        "part_state",
        pa.table(
            {
                "file": pa.array(state[0], pa.string()),
                "offset": pa.array(state[1], pa.int64()),
                "records": pa.array(state[2], pa.int64()),
                "device": pa.array(state[3], pa.int64()),
                "inode": pa.array(state[4], pa.int64()),
                "head": pa.array(state[5], pa.string()),
            }
        ),
    )
    con.execute(
        'INSERT OR REPLACE INTO ingest_state (file, "offset", records, bad_lines, lines, device, inode, head) '
        'SELECT file, "offset", records, 0, records, device, inode, head FROM part_state'
    )
    con.unregister("part_state")


def _read_journal(path: Path, files: _RunFiles) -> dict:
    try:
        fd, st = files.open(path)
    except InputError:
        if not os.path.lexists(path):  # it became a part since it was listed: that part is read next time
            return read_journal(b"")
        raise
    try:
        return read_journal(os.pread(fd, st.st_size, 0))
    finally:
        os.close(fd)


def _max_part_rows(con: duckdb.DuckDBPyConnection, rank: int, seg: int) -> int:
    tensors = first_row(con, "SELECT count(*) FROM params WHERE rank = ? AND seg = ?", [rank, seg])[0]
    return min(ROLL_VALUES + tensors, MAX_PART_ROWS) if tensors else MAX_PART_ROWS


def _part(files: _RunFiles, path: Path, key: str, max_rows: int = MAX_PART_ROWS) -> tuple:
    """A new part, read from one descriptor: its header, footer and schema must be what the shim writes, and
    its rows no more than it writes. Returns (its distinct steps, its ingest_state row)."""
    import numpy as np  # only a run with a columnar series needs these
    import pyarrow as pa

    again = "the shim writes these parts: delete the file to audit the rest, or record the run again"
    fd, st = files.open(path)
    try:
        head = _head(fd, st.st_size)
        with _parquet_footer(path, fd, st.st_size, "Parquet part", again) as (part, columns, rows, unpacked):
            wrong = [f"{k} {columns.get(k, 'missing')}" for k, v in _PART_COLUMNS.items() if columns.get(k) != v]
            if wrong:
                raise InputError(
                    f"{path}: not a gradient-norm part (expected step INT64, idx INT32, norm FLOAT; "
                    f"found {', '.join(wrong)}); {again}"
                )
            if not 0 <= rows <= max_rows:
                raise InputError(
                    f"{path}: claims {rows} rows, more than the {max_rows} a part of the shim holds "
                    f"(a decompression bomb, or not the shim's); {again}"
                )
            if not 0 <= unpacked <= rows * PART_ROW_BYTES + PART_SLACK_BYTES:
                raise InputError(
                    f"{path}: claims {unpacked} bytes uncompressed for {rows} rows, more than a part of the shim "
                    f"holds (a decompression bomb, or not the shim's); {again}"
                )
            # A reader allocates what a page header claims before it decompresses: its headers must agree with
            # the footer just bounded (a few kilobytes read a page).
            fault = page_header_fault(lambda offset, size: os.pread(fd, size, offset), part.metadata, st.st_size)
            if fault:
                raise InputError(f"{path}: {fault}; {again}")
            try:
                step = part.read(columns=["step"], use_threads=False).column("step").to_numpy() if rows else None
            except (pa.ArrowException, OSError, ValueError) as exc:
                raise InputError(f"{path}: not a readable Parquet part ({_arrow_error(exc)}); {again}") from None
    finally:
        os.close(fd)
    if step is None:
        step = np.zeros(0, dtype=np.int64)
    elif (step[1:] >= step[:-1]).all():  # the shim writes a part in step order: its distinct steps in one pass
        step = step[np.r_[True, step[1:] != step[:-1]]]
    else:
        step = np.unique(step)
    return step, (key, st.st_size, rows, st.st_dev, st.st_ino, head)


# The bytes a columnar record may take uncompressed (a metric's name is dictionary-encoded), and the rows a file
# may claim per byte it holds (an import writes about one a byte where a metric holds one value throughout: its
# steps): one claiming more is a decompression bomb.
COLUMNAR_ROW_BYTES, COLUMNAR_ROWS_PER_BYTE = 256, 8
_COLUMNAR_BATCH_ROWS = 1 << 18
_PARQUET_TYPES = {"INTEGER": "INT32", "BIGINT": "INT64", "DOUBLE": "DOUBLE", "VARCHAR": "BYTE_ARRAY"}


def _ingest_columnar(con: duckdb.DuckDBPyConnection, files: _RunFiles, rank: int, kind: str, path: Path) -> int:
    """An import's ``<kind>.parquet`` (written whole, never appended to) into the kind's table, read from one
    descriptor a batch of rows at a time: its columns must be the declared fields of their types, and it may
    claim no more rows than its size holds. A record without a segment is counted as a bad line, as a JSONL
    line without one is. Returns the records read (none when the file was ingested before)."""
    import pyarrow as pa

    if not os.path.lexists(path):
        return 0
    key = str(path.relative_to(path.parent.parent))
    if first_row(con, "SELECT 1 FROM ingest_state WHERE file = ?", [key]):
        return 0  # unchanged (`_stale` rebuilt the database otherwise)
    again = "sftaudit import writes it: import the run again"
    columns = {f.name: f.type for f in RECORDS[kind].columnar_fields()}
    fd, st = files.open(path)
    try:
        head = _head(fd, st.st_size)
        with _parquet_footer(path, fd, st.st_size, "Parquet file", again) as (table, found, rows, unpacked):
            wrong = [f"{k} {found.get(k, 'missing')}" for k, v in columns.items() if found.get(k) != _PARQUET_TYPES[v]]
            if wrong or len(found) != len(columns):
                expected = ", ".join(f"{k} {_PARQUET_TYPES[v]}" for k, v in columns.items())
                raise InputError(
                    f"{path}: not an import's {kind} (expected {expected}; found "
                    f"{', '.join(f'{k} {v}' for k, v in found.items())}); {again}"
                )
            if not (
                0 <= rows <= COLUMNAR_ROWS_PER_BYTE * st.st_size
                and 0 <= unpacked <= rows * COLUMNAR_ROW_BYTES + PART_SLACK_BYTES
            ):
                raise InputError(
                    f"{path}: claims {rows} rows ({unpacked} bytes uncompressed) in {st.st_size} bytes "
                    f"(a decompression bomb, or not an import's); {again}"
                )
            # Its page headers agree with the footer just bounded, as a part's must (a reader allocates what a
            # page header claims before it decompresses).
            fault = page_header_fault(lambda offset, size: os.pread(fd, size, offset), table.metadata, st.st_size)
            if fault:
                raise InputError(f"{path}: {fault}; {again}")
            names = ", ".join(f'"{k}"' for k in columns)
            # One statement over a stream of batches (DuckDB pulls them a batch at a time): a statement per batch
            # costs twice the CPU of a million-row import, the log written ahead of the table once a batch.
            batches = pa.RecordBatchReader.from_batches(
                table.schema_arrow, table.iter_batches(batch_size=_COLUMNAR_BATCH_ROWS, use_threads=False)
            )
            con.register("columnar_batches", batches)
            try:
                kept = con.execute(
                    f'INSERT INTO "{kind}" (rank, {names}) SELECT ?, {names} FROM columnar_batches '
                    "WHERE seg IS NOT NULL",
                    [rank],
                ).fetchone()[0]
            except (pa.ArrowException, OSError, ValueError, duckdb.InvalidInputException) as exc:
                # (the ingest's transaction is aborted and rolled back: the stream goes with the connection)
                raise InputError(f"{path}: not a readable Parquet file ({_arrow_error(exc)}); {again}") from None
            con.unregister("columnar_batches")
    finally:
        os.close(fd)
    con.execute(
        'INSERT OR REPLACE INTO ingest_state (file, "offset", records, bad_lines, lines, device, inode, head, '
        "mended_lines) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0)",
        [key, st.st_size, kept, rows - kept, rows, st.st_dev, st.st_ino, head],
    )
    return kept


@contextmanager
def _parquet_footer(path: Path, fd: int, size: int, what: str, again: str) -> Iterator[tuple]:
    """A Parquet file on its descriptor, its PAR1 header and footer checked and its footer parsed, before any
    of its data is read: yields the file, each column's physical type, the rows and the bytes its row groups
    claim uncompressed (what a caller bounds before reading)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not (size >= 12 and os.pread(fd, 4, 0) == b"PAR1" and os.pread(fd, 4, size - 4) == b"PAR1"):
        raise InputError(f"{path}: not a Parquet file (no PAR1 header and footer); {again}")
    with os.fdopen(os.dup(fd), "rb") as f:
        try:
            file = pq.ParquetFile(f)
            meta, schema = file.metadata, file.schema
            types = {schema.column(i).name: schema.column(i).physical_type for i in range(len(schema))}
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise InputError(f"{path}: not a readable {what} ({_arrow_error(exc)}); {again}") from None
        unpacked = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        yield file, types, meta.num_rows, unpacked


def _arrow_error(exc: BaseException) -> str:
    """Arrow's reason in one line (what DuckDB says of a stream it read: Arrow's reason, not its traceback)."""
    text = str(exc)
    if isinstance(exc, duckdb.Error) and "failed: " in text:
        text = text.split("failed: ", 1)[1].split(". Detail:", 1)[0]
    return " ".join(text.split())[:200] or type(exc).__name__


def _ingest_file(con: duckdb.DuckDBPyConnection, files: _RunFiles, rank: int, kind: str, path: Path) -> int:
    if not os.path.lexists(path):
        return 0
    key = str(path.relative_to(path.parent.parent))
    row = first_row(
        con,
        'SELECT "offset", records, bad_lines, lines, coalesce(mended_lines, 0) FROM ingest_state WHERE file = ?',
        [key],
    )
    offset, records, bad, lines, mended = row if row else (0, 0, 0, 0, 0)
    fd, st = files.open(path)
    try:
        # A copy of the new lines in the cache's staging folder: the one folder DuckDB may read besides the parts.
        fd_tmp, tmp = tempfile.mkstemp(suffix=".jsonl", dir=database_path(files.run_dir).parent / STAGING_DIR)
        try:
            with os.fdopen(fd_tmp, "wb") as out:
                end, copied, refused, mended_now = _copy_complete_lines(
                    fd, offset, st.st_size, files.max_record_bytes, out
                )
            if copied:
                new = (
                    _ingest_manifests(con, rank, tmp, path, lines)
                    if kind == "manifest"
                    else _ingest_records(con, rank, kind, tmp)
                )
            else:
                new = 0
        finally:
            os.unlink(tmp)
        head = _head(fd, end)
    finally:
        os.close(fd)
    if end == offset and row:
        return 0
    con.execute(
        'INSERT OR REPLACE INTO ingest_state (file, "offset", records, bad_lines, lines, device, inode, head, '
        "mended_lines) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [
            key,
            end,
            records + new,
            bad + copied - new + refused,
            lines + copied + refused,
            st.st_dev,
            st.st_ino,
            head,
            mended + mended_now,
        ],
    )
    return new


def _copy_complete_lines(fd: int, offset: int, size: int, max_record: int, out) -> tuple[int, int, int, int]:
    """Copy the complete non-blank lines from `offset` to `size` into `out`, in bounded blocks (a lone
    surrogate escaped as text, bytes that are not UTF-8 replaced: `_readable`; a block's lines in one write
    where none needs that or a refusal: `_plain_lines`). Returns (offset after the last
    complete line, lines copied, lines refused: blank or over `max_record` bytes, lines copied mended). A torn last line waits for its newline, unless it is
    already over the limit: no record is that long, so it is refused too and read past."""
    pos, start, current, oversize = offset, offset, bytearray(), False
    copied = refused = mended = 0
    while pos < size:
        block = os.pread(fd, min(_COPY_BLOCK, size - pos), pos)
        if not block:
            break
        at, tried = 0, False
        while True:
            if not (tried or current or oversize):  # once a block, past the line the last one left torn
                tried, plain = True, _plain_lines(block, at, max_record)
                if plain > at:
                    out.write(block[at:plain])
                    copied += block.count(b"\n", at, plain)
                    at, start = plain, pos + plain
            nl = block.find(b"\n", at)
            piece = block[at:] if nl < 0 else block[at:nl]
            if not oversize:
                if len(current) + len(piece) > max_record:
                    oversize, current = True, bytearray()
                else:
                    current += piece
            if nl < 0:
                break
            if oversize or not current.strip():  # the shim writes no blank line: one is a record lost
                refused += 1
            else:
                line = _readable(bytes(current))
                out.write(line + b"\n")
                copied += 1
                mended += line != current
            current, oversize, at = bytearray(), False, nl + 1
            start = pos + at
        pos += len(block)
    if oversize:
        refused += 1
        start = size
    return start, copied, refused, mended


# A JSON escape: a surrogate pair, a lone surrogate, or any other (`\\` included, so a pair of backslashes
# is never read as the start of an escape).
_ESCAPE = re.compile(
    rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|\\(u[dD][89a-fA-F][0-9a-fA-F]{2})|\\."
)
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def _readable(line: bytes) -> bytes:
    """A line whose strings hold a lone surrogate (``\\ud800``: no character, so DuckDB refuses the whole
    record) with each such escape kept as text (the six characters ``\\ud800``), and bytes that are not UTF-8
    (a surrogate written raw) replaced by U+FFFD: the record is kept, only the text that no reader can hold is
    changed. Other lines as they are."""
    if not line.isascii():
        try:
            line.decode("utf-8")
        except UnicodeDecodeError:
            line = line.decode("utf-8", "replace").encode("utf-8")
    if not _SURROGATE.search(line):
        return line
    return _ESCAPE.sub(lambda m: b"\\\\" + m.group(1) if m.group(1) else m.group(0), line)


_LINE_STARTING_BLANK = re.compile(rb"\n[ \t\r\n\x0b\x0c]")  # what bytes.strip takes away


def _plain_lines(block: bytes, at: int, max_record: int) -> int:
    """The end of the complete lines of `block` from `at` when every one of them would be copied as it is (no blank
    line, none over `max_record`, valid UTF-8, no surrogate escape): those are copied in one write. Else `at`, and
    they are read line by line."""
    end = block.rfind(b"\n") + 1
    lines = block[at:end]
    if not lines or len(lines) > max_record or lines[:1].isspace() or _SURROGATE.search(lines):
        return at
    if _LINE_STARTING_BLANK.search(lines):  # a line that starts blank may be all blank
        return at
    if not lines.isascii():
        try:
            lines.decode("utf-8")
        except UnicodeDecodeError:
            return at
    return end


_NUMBER = "('BIGINT', 'UBIGINT', 'DOUBLE')"


def _typed(name: str, dtype: str) -> str:
    """SQL turning a JSON field into its declared type; NULL where the JSON value is of another kind
    (a number written as a string, a list where a number belongs) or out of the column's range.
    Most values are read from their JSON text (the reader writes each value back as JSON: a string starts with a
    quote, a number is its digits), which costs a fraction of parsing them again (`json_type`, a cast of JSON): a
    double is the text cast, an integer too where the text holds only digits (no fraction or exponent, which the
    JSON cast rounds its own way)."""
    text = f'"{name}"::VARCHAR'
    if dtype == "JSON":
        return f'"{name}"'
    if dtype == "VARCHAR":
        return f"""CASE WHEN starts_with({text}, '"') THEN "{name}"->>'$' END"""
    if dtype == "DOUBLE":
        return f"TRY_CAST({text} AS DOUBLE)"
    if dtype in ("BIGINT", "INTEGER"):
        digits = f"NOT (contains({text}, '.') OR contains({text}, 'e') OR contains({text}, 'E'))"
        return f"CASE WHEN {digits} THEN TRY_CAST({text} AS {dtype}) ELSE {_json_typed(name, dtype)} END"
    return _json_typed(name, dtype)


def _json_typed(name: str, dtype: str) -> str:
    """`_typed` by the JSON value's type and a cast of the JSON."""
    if dtype == "VARCHAR":
        return f"""CASE WHEN json_type("{name}") = 'VARCHAR' THEN "{name}"->>'$' END"""
    kind = (
        "'ARRAY'"
        if dtype.endswith("[]")
        else "'OBJECT'"
        if dtype.startswith("MAP")
        else "'BOOLEAN'"
        if dtype == "BOOLEAN"
        else None
    )
    allowed = f"= {kind}" if kind else f"IN {_NUMBER}"
    return f"""CASE WHEN json_type("{name}") {allowed} THEN TRY_CAST("{name}" AS {dtype}) END"""


def _ingest_records(con: duckdb.DuckDBPyConnection, rank: int, kind: str, tmp: str) -> int:
    """The records of `tmp` (complete lines) into the kind's table; returns how many were readable.
    A line that is not a JSON object, or whose field has another type than the shim writes, is not a
    record (it is counted as a bad line): a record is never half-read into NULLs."""
    columns = RECORD_COLUMNS[kind]
    spec = "{" + ", ".join(f"'{k}': 'JSON'" for k in columns) + "}"
    source = f"read_json('{tmp}', format='newline_delimited', columns={spec}, ignore_errors=true)"
    wrong = " OR ".join(f'("{k}" IS NOT NULL AND {_typed(k, v)} IS NULL)' for k, v in columns.items())
    typed = ", ".join(f'{_typed(k, v)} AS "{k}"' for k, v in columns.items())
    # A corrupt line parses to all-NULL columns (no `seg`): drop those rather than invent records.
    con.execute(
        f"CREATE OR REPLACE TEMP TABLE new_records AS SELECT {typed} FROM {source} "
        f"WHERE seg IS NOT NULL AND NOT ({wrong})"
    )
    n = first_row(con, "SELECT count(*) FROM new_records")[0]
    stored = [k for k in columns if not (kind == "steps" and k == "grad_norms")]
    names = ", ".join(f'"{k}"' for k in stored)
    con.execute(f'INSERT INTO "{kind}" (rank, {names}) SELECT {rank}, {names} FROM new_records')
    if kind == "steps":
        con.execute(  # schema version 1: the norms are in the record (version 2 leaves grad_norms out)
            """
            INSERT INTO grad_rows
            SELECT ?, seg, step, idx, norm
            FROM (SELECT seg, step, unnest(grad_norms) AS norm,
                         generate_subscripts(grad_norms, 1) - 1 AS idx FROM new_records)
            WHERE norm IS NOT NULL
            """,
            [rank],
        )
    con.execute("DROP TABLE new_records")
    return n


def _is_int(value, bits: int = 64) -> bool:
    """An integer (not a bool) that fits the database column (signed, `bits` wide)."""
    return isinstance(value, int) and not isinstance(value, bool) and -(2 ** (bits - 1)) <= value < 2 ** (bits - 1)


def _int32(value) -> bool:
    return _is_int(value, 32)


# What a manifest's parameter entry must hold (the shim writes these; ingest reads them into `params`).
_PARAM_FIELDS = {
    "name": lambda v: isinstance(v, str),
    "dtype": lambda v: isinstance(v, str),
    "shape": lambda v: isinstance(v, list) and all(_int32(d) and d >= 0 for d in v),
    "numel": lambda v: _is_int(v) and v >= 0,
    "requires_grad": lambda v: isinstance(v, bool),
}
_PARAM_OPTIONAL = {
    "kind": lambda v: isinstance(v, str),
    "start": _is_int,
    "stop": _is_int,
    "local_numel": lambda v: _is_int(v) and v >= 0,
    "replica": _int32,
}


def _manifest_problem(m) -> str | None:
    """Why a manifest record cannot be read (None: it can)."""
    if not isinstance(m, dict):
        return "a manifest record must be a JSON object"
    if "schema_version" in m and not (_int32(m["schema_version"]) and m["schema_version"] >= 1):  # null too: it
        # says which reader reads the rest
        return f"schema_version must be an integer (32-bit) >= 1, not {json.dumps(m['schema_version'])[:40]}"
    for name in ("seg", "world_size"):
        if name in m and m[name] is not None and not _int32(m[name]):
            return f"{name} must be an integer (32-bit), not {str(m[name])[:40]!r}"
    for name in ("run_id", "profile", "grad_norm_source"):
        if m.get(name) is not None and not isinstance(m[name], str):
            return f"{name} must be a string, not {str(m[name])[:40]!r}"
    started = m.get("started")
    if started is not None and (
        not isinstance(started, (int, float)) or isinstance(started, bool) or not abs(started) < 1e300
    ):
        return f"started must be a number (seconds since 1970), not {str(started)[:40]!r}"
    params, tied = m.get("params", []), m.get("tied", {})
    if not isinstance(params, list):
        return "params must be a list"
    for i, p in enumerate(params):
        if not isinstance(p, dict):
            return f"params[{i}] must be an object"
        bad = [
            k
            for k, ok in {**_PARAM_FIELDS, **_PARAM_OPTIONAL}.items()  # null: not known (an imported run)
            if (k == "name" or p.get(k) is not None) and not ok(p.get(k))
        ]
        if bad:
            return f"params[{i}].{bad[0]} is missing or of the wrong type"
    if not isinstance(tied, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
        return "tied must map parameter names to parameter names"
    for name, kind in (
        ("tokenizer", dict),
        ("config", dict),
        ("model", dict),
        ("dataset", dict),
        ("lacks", dict),
        ("sources", dict),
        ("argv", list),
    ):
        if m.get(name) is not None and not isinstance(m[name], kind):
            return f"{name} must be a JSON {'object' if kind is dict else 'list'}, not {type(m[name]).__name__}"
    special = (m.get("tokenizer") or {}).get("special_tokens")
    if special is not None and not (
        isinstance(special, dict) and all(v is None or isinstance(v, dict) for v in special.values())
    ):
        return "tokenizer.special_tokens must map each role (bos, eos, pad...) to an object"
    for name in _PLAN_FIELDS:  # the checks take the run's plan from these
        value = (m.get("config") or {}).get(name)
        if value is not None and not _plan_number(value):
            return f"config.{name} must be a finite number of steps, not {json.dumps(value)[:40]}"
    return None


# The run's plan in a manifest's config, which LOOP-14 and LOOP-24 read (the Trainer's names).
_PLAN_FIELDS = ("max_steps", "logging_steps", "save_steps", "eval_steps", "warmup_steps", "num_train_epochs")


def _plan_number(value) -> bool:
    """A number of steps (or epochs) a run can plan: finite, within a 64-bit integer; -1 is the Trainer's "none"."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 2**63


def _ingest_manifests(con: duckdb.DuckDBPyConnection, rank: int, tmp: str, path: Path, before: int) -> int:
    """Manifest records (JSON the checks read through `load_manifest`): each one validated first;
    an unreadable line is counted as a bad line, a readable one of the wrong shape refused."""
    n = 0
    with open(tmp, "rb") as f:
        for number, raw in enumerate(f):
            try:
                m = json.loads(raw)
            except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past any manifest
                continue
            problem = _manifest_problem(m)
            if problem:
                raise InputError(
                    f"{path}, line {before + number + 1}: {problem}; the shim writes this record: "
                    f"record the run again, or repair that field"
                )
            if m.get("schema_version", 0) > SCHEMA_VERSION:
                raise InputError(
                    f"artifacts use schema version {m['schema_version']}; this sftaudit reads up to "
                    f"{SCHEMA_VERSION}: upgrade sftaudit (pip install -U sftaudit)"
                )
            seg = m.get("seg", 0)
            con.execute(
                "INSERT INTO manifest VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    rank,
                    seg,
                    m.get("run_id"),
                    m.get("schema_version"),
                    m.get("profile"),
                    m.get("world_size"),
                    m.get("started"),
                    m.get("grad_norm_source"),
                    json.dumps(m),
                ],
            )
            rows = [
                (
                    rank,
                    seg,
                    i,
                    p["name"],
                    p.get("shape"),
                    p.get("dtype"),
                    p.get("numel"),
                    p.get("requires_grad"),
                    None,
                    p.get("kind", "local"),
                    p.get("start"),
                    p.get("stop"),
                    p.get("local_numel", p.get("numel")),
                    p.get("replica", rank),
                )
                for i, p in enumerate(m.get("params", []))
            ]
            rows += [
                (rank, seg, None, alias, None, None, None, None, target, None, None, None, None, None)
                for alias, target in m.get("tied", {}).items()
            ]
            if rows:
                con.executemany(
                    "INSERT INTO params (rank, seg, idx, name, shape, dtype, numel, requires_grad, tied_to, "
                    "kind, start, stop, local_numel, replica) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    rows,
                )
            n += 1
    return n
