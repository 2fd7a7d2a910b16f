"""Artifacts -> DuckDB. Incremental: each file's ingested byte offset is remembered, so a
second ingest of a growing run reads only what was appended since.

The database lives at ``RUN_DIR/sftaudit/audit.duckdb``. Its tables mirror the record
kinds of `sftaudit.core.artifacts` (one row per record, plus a ``rank`` column), except the per-tensor
gradient norms and the manifest's parameter list, which becomes ``params`` (with each parameter's
layout on the rank: see `sftaudit.shim.pieces`).

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

A database made by an earlier sftaudit (its ``sftaudit_meta`` format differs or is missing) is
rebuilt from the artifacts on the next ingest.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import stat
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

import duckdb

from ..core.artifacts import (
    DATABASE_FILE,
    GRAD_SERIES,
    RECORD_KINDS,
    SCHEMA_VERSION,
    SERIES_DIR,
    artifact_root,
    part_name,
    read_journal,
)
from ..core.terminal import shown
from ..errors import InputError, one_line
from ..schema.records import RECORDS

# Bounded reads (configurable in the audit config's [ingest] section): one record (line) and one file.
DEFAULT_MAX_RECORD_BYTES = 64 * 2**20  # a full sample row of a long context is a few MB
DEFAULT_MAX_FILE_BYTES = 16 * 2**30
HEAD_BYTES = 4096  # an artifact is the file ingested before if its first block is unchanged
LOCK_TIMEOUT = 600.0  # seconds one audit waits for another on the same run
_COPY_BLOCK = 8 * 2**20
# The database's own layout: a database of another format is rebuilt from the artifacts.
# 2: gradient norms read in place (views over the series), not copied into grad_pieces/grad_norms tables.
# 3: each part's steps listed at ingest (grad_part_steps).
DATABASE_FORMAT = 3

# Column types of each record kind (the JSON field names), from the declaration in sftaudit/schema/records.py;
# the manifest has its own table.
RECORD_COLUMNS: dict[str, dict[str, str]] = {
    kind: {f.name: f.type for f in spec.fields} for kind, spec in RECORDS.items() if kind != "manifest"
}

_SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS ingest_state (file VARCHAR PRIMARY KEY, "offset" BIGINT, records BIGINT, bad_lines BIGINT);
ALTER TABLE ingest_state ADD COLUMN IF NOT EXISTS lines BIGINT;
ALTER TABLE ingest_state ADD COLUMN IF NOT EXISTS device BIGINT;
ALTER TABLE ingest_state ADD COLUMN IF NOT EXISTS inode BIGINT;
ALTER TABLE ingest_state ADD COLUMN IF NOT EXISTS head VARCHAR;
CREATE TABLE IF NOT EXISTS manifest (rank INTEGER, seg INTEGER, run_id VARCHAR, schema_version INTEGER,
    profile VARCHAR, world_size INTEGER, started DOUBLE, grad_norm_source VARCHAR, manifest JSON);
CREATE TABLE IF NOT EXISTS params (rank INTEGER, seg INTEGER, idx INTEGER, name VARCHAR, shape INTEGER[],
    dtype VARCHAR, numel BIGINT, requires_grad BOOLEAN, tied_to VARCHAR);
ALTER TABLE params ADD COLUMN IF NOT EXISTS kind VARCHAR;
ALTER TABLE params ADD COLUMN IF NOT EXISTS start BIGINT;
ALTER TABLE params ADD COLUMN IF NOT EXISTS stop BIGINT;
ALTER TABLE params ADD COLUMN IF NOT EXISTS local_numel BIGINT;
ALTER TABLE params ADD COLUMN IF NOT EXISTS replica INTEGER;
CREATE TABLE IF NOT EXISTS grad_rows (rank INTEGER, seg INTEGER, step BIGINT, idx INTEGER, norm DOUBLE);
CREATE TABLE IF NOT EXISTS grad_journal (rank INTEGER, seg INTEGER, step BIGINT, idx INTEGER, norm DOUBLE);
CREATE TABLE IF NOT EXISTS segment_cutoffs (rank INTEGER, seg INTEGER, cutoff BIGINT);
CREATE TABLE IF NOT EXISTS grad_part_steps (rank INTEGER, seg INTEGER, step BIGINT);
CREATE TABLE IF NOT EXISTS sftaudit_meta (key VARCHAR PRIMARY KEY, value VARCHAR);
"""


def first_row(con: duckdb.DuckDBPyConnection, sql: str, params: list | None = None) -> tuple | None:
    """The first row of a query, or None (results are always drained: DuckDB refuses half-read ones)."""
    rows = con.execute(sql, params or []).fetchall()
    return rows[0] if rows else None


def database_path(run_dir: str | Path) -> Path:
    return artifact_root(run_dir) / DATABASE_FILE


def connect(run_dir: str | Path, read_only: bool = False) -> duckdb.DuckDBPyConnection:
    path = database_path(run_dir)
    if read_only and not path.exists():
        raise InputError(f"{run_dir}: not ingested yet (run `sftaudit ingest {run_dir}`)")
    try:
        con = duckdb.connect(str(path), read_only=read_only)
    except duckdb.Error as exc:
        if "lock" in str(exc).lower():
            raise InputError(
                f"{path}: the database is open in another program; close it (or wait for it) and run again"
            ) from None
        raise InputError(
            f"{path}: not a readable sftaudit database ({one_line(exc)}); delete it and "
            f"run `sftaudit ingest {run_dir}` to rebuild it from the artifacts"
        ) from None
    if _format(con) == DATABASE_FORMAT:
        gradient_views(con, run_dir)
    return con


def _format(con: duckdb.DuckDBPyConnection) -> int | None:
    if not first_row(con, "SELECT count(*) FROM information_schema.tables WHERE table_name = 'sftaudit_meta'")[0]:
        return None
    row = first_row(con, "SELECT value FROM sftaudit_meta WHERE key = 'database_format'")
    return int(row[0]) if row and str(row[0]).isdigit() else None


def _sql_text(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def gradient_views(con: duckdb.DuckDBPyConnection, run_dir: str | Path) -> None:
    """The gradient-norm views of this connection (temporary, so a moved run folder still reads):
    ``grad_pieces`` (each rank's own pieces on the timeline), ``grad_norms`` (the whole tensors: the
    pieces themselves, or the reduction ingest stored for a sharded run), ``grad_cells`` and
    ``grad_piece_cells`` (grad_norms and grad_pieces without the tensor names: cheaper to scan),
    ``grad_piece_steps`` (the steps with any norm recorded, per rank and segment: the parts' steps listed at
    ingest, whatever tensor index their rows name) and, after a resume, the ``superseded_`` twins. The Parquet parts are read where they lie, out of core."""
    root = artifact_root(run_dir).resolve()
    parts = [
        root / f
        for (f,) in con.execute(
            "SELECT file FROM ingest_state WHERE file LIKE ? ORDER BY file", [f"{SERIES_DIR}/%"]
        ).fetchall()
    ]
    sources = [
        "SELECT rank, seg, step, idx, norm FROM grad_rows",
        "SELECT rank, seg, step, idx, norm FROM grad_journal",
    ]
    if parts:
        files = "[" + ", ".join(_sql_text(str(f)) for f in parts) + "]"
        sources.insert(
            0,
            f"SELECT rank, seg, step, idx, norm::DOUBLE AS norm FROM read_parquet({files}, "
            "hive_partitioning = true, hive_types = {'rank': INTEGER, 'seg': INTEGER})",
        )
    series = " UNION ALL ".join(sources)
    named = (
        f"SELECT g.rank, g.seg, g.step, g.idx, p.name AS tensor, g.norm FROM ({series}) g "
        "JOIN params p ON p.rank = g.rank AND p.seg = g.seg AND p.idx = g.idx"
    )
    resumed = bool(first_row(con, "SELECT count(*) FROM segment_cutoffs")[0])
    cut = "LEFT JOIN segment_cutoffs c ON c.rank = g.rank AND c.seg = g.seg"
    kept = " WHERE c.cutoff IS NULL OR g.step < c.cutoff"
    con.execute(f"CREATE OR REPLACE TEMP VIEW grad_pieces AS {named} {cut + kept if resumed else ''}")
    tables = {t for (t,) in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    reduced = "grad_norms_reduced" in tables
    con.execute(
        "CREATE OR REPLACE TEMP VIEW grad_norms AS SELECT * FROM "
        + ("grad_norms_reduced" if reduced else "grad_pieces")
    )
    # grad_norms without the tensor names, for the checks that scan every norm: the join with params costs
    # as much as reading the parts. The same rows: an index the manifest lists (every segment of every rank
    # lists 0..n-1, so one range test does it when they agree on n).
    counts = con.execute("SELECT DISTINCT count(*) FROM params WHERE idx IS NOT NULL GROUP BY rank, seg").fetchall()
    listed = (
        f"g.idx >= 0 AND g.idx < {int(counts[0][0])}"
        if len(counts) == 1
        else "EXISTS (SELECT 1 FROM params p WHERE p.rank = g.rank AND p.seg = g.seg AND p.idx = g.idx)"
    )

    def cells(source: str) -> str:
        return (
            f"SELECT g.rank, g.seg, g.step, g.idx, g.norm FROM ({source}) g {cut if resumed else ''} WHERE {listed}"
            + (" AND (c.cutoff IS NULL OR g.step < c.cutoff)" if resumed else "")
        )

    con.execute("CREATE OR REPLACE TEMP VIEW grad_piece_cells AS " + cells(series))
    # The steps with a norm recorded, per rank and segment: the parts' steps were listed at ingest (a
    # distinct over every norm costs seconds per 10^8 of them).
    con.execute(
        "CREATE OR REPLACE TEMP VIEW grad_piece_steps AS SELECT g.rank, g.seg, g.step FROM ("
        "SELECT rank, seg, step FROM grad_part_steps UNION ALL SELECT DISTINCT rank, seg, step FROM grad_rows "
        f"UNION ALL SELECT DISTINCT rank, seg, step FROM grad_journal) g {cut if resumed else ''}"
        + (" WHERE c.cutoff IS NULL OR g.step < c.cutoff" if resumed else "")
    )
    # The cells not in Parquet parts (journal tails, schema-1 rows): a reader of the parts themselves adds these.
    con.execute("CREATE OR REPLACE TEMP VIEW grad_tail_cells AS " + cells(" UNION ALL ".join(sources[-2:])))
    con.execute(
        "CREATE OR REPLACE TEMP VIEW grad_cells AS SELECT rank, seg, step, idx, norm FROM "
        + ("grad_norms_reduced" if reduced else "grad_piece_cells")
    )
    if resumed:
        con.execute(f"CREATE OR REPLACE TEMP VIEW superseded_grad_pieces AS {named} {cut} WHERE g.step >= c.cutoff")
        con.execute(
            "CREATE OR REPLACE TEMP VIEW superseded_grad_norms AS SELECT * FROM "
            + (
                "superseded_grad_norms_reduced"
                if "superseded_grad_norms_reduced" in tables
                else "superseded_grad_pieces"
            )
        )


_held: dict[str, list] = {}  # artifact folder -> [descriptor, depth]: the lock is re-entrant within a process


@contextmanager
def run_lock(run_dir: str | Path, timeout: float = LOCK_TIMEOUT):
    """Hold the run's lock while its database is used: a second audit of the same run waits for the
    first, with a message, instead of failing on DuckDB's own file lock. The lock is taken on the
    artifact folder itself (flock on its descriptor), so nothing is written into the run folder;
    a run without one is used unlocked (nothing there to guard)."""
    root = artifact_root(run_dir)
    key = str(root.resolve()) if root.is_dir() else None
    if key is not None and key not in _held:
        fd = _acquire(key, run_dir, timeout)
        if fd is not None:
            _held[key] = [fd, 0]
    entry = _held.get(key)
    if entry:
        entry[1] += 1
    try:
        yield
    finally:
        if entry:
            entry[1] -= 1
            if not entry[1]:
                os.close(_held.pop(key)[0])  # closing the descriptor releases the lock


def _acquire(key: str, run_dir: str | Path, timeout: float) -> int | None:
    try:
        fd = os.open(key, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    deadline, told = time.monotonic() + timeout, False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise InputError(
                    f"{run_dir}: another sftaudit has used this run's database for over {timeout:.0f} s "
                    f"(it holds a lock on {key}); wait for it to finish, or stop it, and run again"
                ) from None
            if not told:
                print(f"sftaudit: waiting for another sftaudit using {shown(str(run_dir))} to finish", file=sys.stderr)
                told = True
            time.sleep(0.2)


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


def create_tables(con: duckdb.DuckDBPyConnection) -> None:
    """The ingest schema (also filled directly by `preflight`, which has no artifacts)."""
    con.execute(_SCHEMA_SQL)
    con.execute("INSERT OR REPLACE INTO sftaudit_meta VALUES ('database_format', ?)", [str(DATABASE_FORMAT)])
    for kind, columns in RECORD_COLUMNS.items():
        stored = {k: v for k, v in columns.items() if not (kind == "steps" and k == "grad_norms")}
        cols = ", ".join(f'"{k}" {v}' for k, v in stored.items())
        con.execute(f'CREATE TABLE IF NOT EXISTS "{kind}" (rank INTEGER, {cols})')
        for k, v in stored.items():  # a database ingested by an older sftaudit gains the newer fields
            con.execute(f'ALTER TABLE "{kind}" ADD COLUMN IF NOT EXISTS "{k}" {v}')


def ingest(
    run_dir: str | Path, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
) -> dict[str, int]:
    """Load new records into the run's DuckDB file; returns the number of new records per kind.
    A database that no longer matches the artifacts (a file replaced, shortened or rewritten, rows
    deleted) is rebuilt from scratch: offsets are only trusted for the files they were taken on."""
    ranks = rank_folders(run_dir)
    limits = (max_record_bytes, max_file_bytes)
    with run_lock(run_dir):
        con = connect(run_dir)
        try:
            if _stale(con, run_dir, limits):
                con.close()
                for leftover in (database_path(run_dir), Path(f"{database_path(run_dir)}.wal")):
                    leftover.unlink(missing_ok=True)
                con = connect(run_dir)
            return _ingest_all(con, run_dir, ranks, limits)
        finally:
            con.close()


def _ingest_all(
    con: duckdb.DuckDBPyConnection, run_dir: str | Path, ranks: list[tuple[int, Path]], limits: tuple[int, int]
) -> dict[str, int]:
    con.begin()  # all or nothing: offsets only move with the rows they stand for
    create_tables(con)
    added = {kind: 0 for kind in RECORD_KINDS}
    for rank, folder in ranks:
        for kind in RECORD_KINDS:
            added[kind] += _ingest_file(con, run_dir, rank, kind, folder / f"{kind}.jsonl", limits)
    if not first_row(con, "SELECT count(*) FROM manifest")[0]:
        raise InputError(
            f"{run_dir}: artifacts have no manifest record (none in rank-<r>/manifest.jsonl could be read); "
            f"the shim writes it when recording starts: record the run again"
        )
    _ingest_series(con, run_dir, limits)
    _supersede_abandoned_steps(con)
    gradient_views(con, run_dir)
    _reduce_gradients(con, "grad_pieces", "grad_norms_reduced")
    if first_row(con, "SELECT count(*) FROM information_schema.tables WHERE table_name = 'superseded_grad_pieces'")[0]:
        _reduce_gradients(con, "superseded_grad_pieces", "superseded_grad_norms_reduced")
    gradient_views(con, run_dir)
    _reduced_step_totals(con)
    con.commit()
    return added


def _stale(con: duckdb.DuckDBPyConnection, run_dir: str | Path, limits: tuple[int, int]) -> bool:
    """Whether the database describes other files than the artifacts now on disk, or lost rows."""
    tables = {
        t
        for (t,) in con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_catalog <> 'temp'"
        ).fetchall()
    }
    if not tables:
        return False
    if _format(con) != DATABASE_FORMAT:
        return True  # made by another sftaudit (or not by sftaudit): rebuilt from the artifacts
    root = artifact_root(run_dir)
    for key, offset, records, inode, device, head in con.execute(
        'SELECT file, "offset", records, inode, device, head FROM ingest_state'
    ).fetchall():
        path = root / key
        if not os.path.lexists(path):
            return True
        fd, st = _open_artifact(path, run_dir, limits[1])
        try:
            grown = st.st_size != offset if key.startswith(f"{SERIES_DIR}/") else st.st_size < offset  # parts are final
            if (st.st_ino, st.st_dev) != (inode, device) or grown or _head(fd, offset) != head:
                return True
        finally:
            os.close(fd)
        rank, kind = _file_kind(key)
        if kind is not None and _stored_rows(con, tables, rank, kind) != records:
            return True
    return False


def _file_kind(key: str) -> tuple[int, str | None]:
    m = re.fullmatch(r"rank-(\d+)/(\w+)\.jsonl", key)
    return (int(m.group(1)), m.group(2) if m.group(2) in RECORD_KINDS else None) if m else (-1, None)


def _stored_rows(con: duckdb.DuckDBPyConnection, tables: set[str], rank: int, kind: str) -> int:
    """The rows a kind's records became (the timeline moved by a resume included)."""
    return sum(
        first_row(con, f'SELECT count(*) FROM "{t}" WHERE rank = ?', [rank])[0]
        for t in (kind, f"superseded_{kind}")
        if t in tables
    )


def _open_artifact(path: Path, run_dir: str | Path, max_file_bytes: int) -> tuple[int, os.stat_result]:
    """An artifact opened for reading: a regular file inside the run folder (a symlink may point
    within it), no larger than the limit; InputError otherwise. Never blocks (a FIFO, a device)."""
    real, inside = os.path.realpath(path), os.path.realpath(run_dir)
    if os.path.commonpath([real, inside]) != inside:
        raise InputError(f"{path}: a link to {real}, outside the run folder; artifacts must be files inside it")
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise InputError(f"{path}: cannot open ({exc.strerror}); check its permissions") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise InputError(f"{path}: not a regular file (a FIFO, device or folder); artifacts must be plain files")
    if st.st_size > max_file_bytes:
        os.close(fd)
        raise InputError(
            f"{path}: {st.st_size} bytes, over the {max_file_bytes}-byte limit per artifact file; "
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


def _series_folders(run_dir: str | Path) -> list[tuple[int, int, Path]]:
    """(rank, segment, folder) of the gradient-norm series (other names there are not ours: ignored)."""
    out = []
    for by_rank in (artifact_root(run_dir) / SERIES_DIR / GRAD_SERIES).glob("rank=*"):
        r = re.fullmatch(r"rank=(\d{1,6})", by_rank.name)
        if r and by_rank.is_dir() and not by_rank.is_symlink():
            out += [
                (int(r.group(1)), int(g.group(1)), folder)
                for folder in by_rank.glob("seg=*")
                if (g := re.fullmatch(r"seg=(\d{1,6})", folder.name)) and folder.is_dir() and not folder.is_symlink()
            ]
    return sorted(out)


def _ingest_series(con: duckdb.DuckDBPyConnection, run_dir: str | Path, limits: tuple[int, int]) -> None:
    """New Parquet parts are validated and listed (they are read in place, never copied); the journal
    tails are read again whole (small: a journal becomes a part every few thousand steps)."""
    root = artifact_root(run_dir)
    known = {
        f for (f,) in con.execute("SELECT file FROM ingest_state WHERE file LIKE ?", [f"{SERIES_DIR}/%"]).fetchall()
    }
    con.execute("DELETE FROM grad_journal")
    tables = {t for (t,) in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    recorded = " UNION ALL ".join(
        f"SELECT rank, seg, step FROM {t}" for t in ("steps", "superseded_steps") if t in tables
    )
    part_steps: list = []  # (rank, seg, steps) of each new part, inserted at once
    for rank, seg, folder in _series_folders(run_dir):
        journals = sorted(folder.glob("journal-*.bin"))  # listed first: one may turn into a part meanwhile
        parts = {q.name for q in folder.glob("part-*.parquet") if _PART.fullmatch(q.name)}
        for name in sorted(parts):
            key = str((folder / name).relative_to(root))
            if key not in known:
                _add_part(con, run_dir, folder / name, key, limits, rank, seg, part_steps)
        # A journal's last step may lack its steps record (killed between the two): it is left out.
        last = first_row(con, f"SELECT max(step) FROM ({recorded}) WHERE rank = ? AND seg = ?", [rank, seg])[0]
        for journal in journals:
            m = _JOURNAL.fullmatch(journal.name)
            if not m or part_name(int(m.group(1))) in parts or last is None:
                continue  # a part holds it (killed between the part's rename and the journal's delete)
            columns = _read_journal(journal, run_dir, limits)
            keep = columns["step"] <= last
            if keep.any():
                import pyarrow as pa  # only a run with a journal tail needs it

                con.register(
                    "journal_rows",
                    pa.table(
                        {"step": columns["step"][keep], "idx": columns["idx"][keep], "norm": columns["norm"][keep]}
                    ),
                )
                con.execute("INSERT INTO grad_journal SELECT ?, ?, step, idx, norm FROM journal_rows", [rank, seg])
                con.unregister("journal_rows")
    if part_steps:
        import numpy as np
        import pyarrow as pa

        con.register(
            "part_steps",
            pa.table(
                {
                    "rank": np.concatenate([np.full(len(st), r, np.int32) for r, _, st in part_steps]),
                    "seg": np.concatenate([np.full(len(st), g, np.int32) for _, g, st in part_steps]),
                    "step": np.concatenate([st for _, _, st in part_steps]),
                }
            ),
        )
        con.execute("INSERT INTO grad_part_steps SELECT rank, seg, step FROM part_steps")
        con.unregister("part_steps")


def _read_journal(path: Path, run_dir: str | Path, limits: tuple[int, int]) -> dict:
    try:
        fd, st = _open_artifact(path, run_dir, limits[1])
    except InputError:
        if not os.path.lexists(path):  # it became a part since it was listed: that part is read next time
            return read_journal(b"")
        raise
    try:
        return read_journal(os.pread(fd, st.st_size, 0))
    finally:
        os.close(fd)


def _add_part(
    con: duckdb.DuckDBPyConnection,
    run_dir: str | Path,
    path: Path,
    key: str,
    limits: tuple[int, int],
    rank: int,
    seg: int,
    listed: list,
) -> None:
    """A part is listed for the views once its header, footer and schema are what the shim writes; its
    (rank, seg, steps) are added to `listed`."""
    fd, st = _open_artifact(path, run_dir, limits[1])
    try:
        framed = st.st_size >= 12 and os.pread(fd, 4, 0) == b"PAR1" and os.pread(fd, 4, st.st_size - 4) == b"PAR1"
        head = _head(fd, st.st_size)
    finally:
        os.close(fd)
    again = "the shim writes these parts: delete the file to audit the rest, or record the run again"
    if not framed:
        raise InputError(f"{path}: not a Parquet file (no PAR1 header and footer); {again}")
    try:
        columns = dict(con.execute("SELECT name, type FROM parquet_schema(?)", [os.path.realpath(path)]).fetchall())
        rows = first_row(con, "SELECT sum(num_rows) FROM parquet_file_metadata(?)", [os.path.realpath(path)])[0]
    except duckdb.Error as exc:
        raise InputError(f"{path}: not a readable Parquet part ({one_line(exc)[:200]}); {again}") from None
    wrong = [f"{k} {columns.get(k, 'missing')}" for k, v in _PART_COLUMNS.items() if columns.get(k) != v]
    if wrong:
        raise InputError(
            f"{path}: not a gradient-norm part (expected step INT64, idx INT32, norm FLOAT; "
            f"found {', '.join(wrong)}); {again}"
        )
    import numpy as np  # only a run with a columnar series needs these
    import pyarrow.parquet as pq

    step = pq.read_table(os.path.realpath(path), columns=["step"], use_threads=False).column("step").to_numpy()
    # The shim writes a part in step order: its distinct steps in one pass (any order: a sort).
    ordered = not (step[1:] < step[:-1]).any()
    step = step[np.r_[True, step[1:] != step[:-1]]] if ordered and step.size else np.unique(step)
    listed.append((rank, seg, step))
    con.execute(
        'INSERT OR REPLACE INTO ingest_state (file, "offset", records, bad_lines, lines, device, inode, head) '
        "VALUES (?, ?, ?, 0, ?, ?, ?, ?)",
        [key, st.st_size, rows or 0, rows or 0, st.st_dev, st.st_ino, head],
    )


def _ingest_file(
    con: duckdb.DuckDBPyConnection, run_dir: str | Path, rank: int, kind: str, path: Path, limits: tuple[int, int]
) -> int:
    if not os.path.lexists(path):
        return 0
    key = str(path.relative_to(path.parent.parent))
    row = first_row(con, 'SELECT "offset", records, bad_lines, lines FROM ingest_state WHERE file = ?', [key])
    offset, records, bad, lines = row if row else (0, 0, 0, 0)
    fd, st = _open_artifact(path, run_dir, limits[1])
    try:
        fd_tmp, tmp = tempfile.mkstemp(suffix=".jsonl")
        try:
            with os.fdopen(fd_tmp, "wb") as out:
                end, copied, refused = _copy_complete_lines(fd, offset, st.st_size, limits[0], out)
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
        'INSERT OR REPLACE INTO ingest_state (file, "offset", records, bad_lines, lines, device, inode, head) '
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [key, end, records + new, bad + copied - new + refused, lines + copied + refused, st.st_dev, st.st_ino, head],
    )
    return new


def _copy_complete_lines(fd: int, offset: int, size: int, max_record: int, out) -> tuple[int, int, int]:
    """Copy the complete non-blank lines from `offset` to `size` into `out`, in bounded blocks.
    Returns (offset after the last complete line, lines copied, lines refused: blank or over
    `max_record` bytes). A torn last line waits for its newline, unless it is already over the
    limit: no record is that long, so it is refused too and read past."""
    pos, start, current, oversize = offset, offset, bytearray(), False
    copied = refused = 0
    while pos < size:
        block = os.pread(fd, min(_COPY_BLOCK, size - pos), pos)
        if not block:
            break
        at = 0
        while True:
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
                out.write(bytes(current) + b"\n")
                copied += 1
            current, oversize, at = bytearray(), False, nl + 1
            start = pos + at
        pos += len(block)
    if oversize:
        refused += 1
        start = size
    return start, copied, refused


_NUMBER = "('BIGINT', 'UBIGINT', 'DOUBLE')"


def _typed(name: str, dtype: str) -> str:
    """SQL turning a JSON field into its declared type; NULL where the JSON value is of another kind
    (a number written as a string, a list where a number belongs) or out of the column's range."""
    if dtype == "JSON":
        return f'"{name}"'
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
    for name, kind in (("schema_version", "an integer"), ("seg", "an integer"), ("world_size", "an integer")):
        if name in m and m[name] is not None and not _int32(m[name]):
            return f"{name} must be {kind} (32-bit), not {str(m[name])[:40]!r}"
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
        ("unjudged", dict),
        ("sources", dict),
        ("argv", list),
    ):
        if m.get(name) is not None and not isinstance(m[name], kind):
            return f"{name} must be a JSON {'object' if kind is dict else 'list'}, not {type(m[name]).__name__}"
    return None


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


def load_manifest(con: duckdb.DuckDBPyConnection, rank: int = 0) -> dict:
    """The latest manifest of a rank (the current segment's view of the run)."""
    row = first_row(con, "SELECT manifest FROM manifest WHERE rank = ? ORDER BY seg DESC LIMIT 1", [rank])
    if row is None:
        raise InputError(f"no manifest for rank {rank}")
    return json.loads(row[0])


def recorded_checkpoints(con: duckdb.DuckDBPyConnection) -> list[dict]:
    """Rank 0's checkpoints, one per path (a checkpoint's identity is its path relative to the run
    directory), in order of their last save: name (shortest unique path suffix), step of the last
    save (the one on disk), every step it was saved at, that save's segment and recorded hashes.
    A checkpoint the shim's guard kept out of the trainer's rotation (a `kept` record after its last
    save) is where the kept copy is: `path` is the copy's (its hashes rebased onto it), `kept_from` the
    path it was saved at."""
    rows = con.execute(
        """WITH saved AS (SELECT * FROM checkpoints WHERE event = 'saved' AND rank = 0),
                saves AS (SELECT path, list(step ORDER BY seg, step) AS saves FROM saved GROUP BY path),
                last AS (SELECT path, step, seg FROM saved
                         QUALIFY row_number() OVER (PARTITION BY path ORDER BY seg DESC, step DESC) = 1),
                hashed AS (SELECT path, step, seg, any_value(sha256) AS sha256 FROM checkpoints
                           WHERE event = 'hashed' AND rank = 0 GROUP BY path, step, seg),
                kept AS (SELECT path, step, seg, kept_path FROM checkpoints
                         WHERE event = 'kept' AND rank = 0 AND kept_path IS NOT NULL
                         QUALIFY row_number() OVER (PARTITION BY path ORDER BY seg DESC) = 1)
           SELECT l.path, l.step, l.seg, s.saves, h.sha256, k.kept_path FROM last l JOIN saves s USING (path)
           LEFT JOIN hashed h ON h.path = l.path AND h.step = l.step AND h.seg = l.seg
           LEFT JOIN kept k ON k.path = l.path AND k.step = l.step AND k.seg >= l.seg
           ORDER BY l.step, l.path"""
    ).fetchall()
    out = []
    for saved_at, step, seg, saves, sha, kept in rows:
        sha256 = json.loads(sha) if sha else {}
        if kept:
            sha256 = {kept + name[len(saved_at) :]: d for name, d in sha256.items() if name.startswith(saved_at)}
        out.append(
            {
                "path": kept or saved_at,
                "kept_from": saved_at if kept else None,
                "step": step,
                "seg": seg,
                "saves": saves,
                "sha256": sha256,
            }
        )
    names = checkpoint_names([c["path"] for c in out])
    return [{"name": names[c["path"]], **c} for c in out]


def checkpoint_names(paths: list[str]) -> dict[str, str]:
    """Display names: the shortest path suffix that tells the checkpoints apart, without the file
    name they all share (``checkpoints/step-20/model.safetensors`` -> ``step-20``)."""
    parts = {p: PurePosixPath(p.replace("\\", "/")).parts or (p,) for p in paths}
    shared = 0  # trailing components every checkpoint has in common (model.safetensors)
    if len(parts) > 1:
        while (
            all(len(q) > shared + 1 for q in parts.values())
            and len({q[len(q) - shared - 1] for q in parts.values()}) == 1
        ):
            shared += 1
    trimmed = {p: q[: len(q) - shared] for p, q in parts.items()}
    names = {}
    for p, q in trimmed.items():
        for k in range(1, len(q) + 1):
            suffix = q[-k:]
            if sum(1 for other in trimmed.values() if other[-k:] == suffix) == 1:
                break
        names[p] = "/".join(suffix)
    return names
