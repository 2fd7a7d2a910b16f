"""The run database: one DuckDB file per run, written and read only by this sftaudit.

**Where it lives.** A run folder is untrusted input, and a database file is more than data: its views and
macros run inside every query that names them, and a macro named ``isfinite`` or ``read_parquet`` replaces
the built-in in sftaudit's own SQL. A database kept in the run folder could be planted or swapped by
whoever writes the run, and nothing stored inside it could prove it ours (a planted file can copy any
record of provenance a genuine one holds). So the database lives outside the run, in sftaudit's cache:
``$SFTAUDIT_CACHE_DIR`` (else ``$XDG_CACHE_HOME/sftaudit``, else ``~/.cache/sftaudit``), as
``runs/<key>/audit.duckdb``, the key a hash of the run folder's resolved path, device and inode. Nothing in
a run folder is ever opened as a database; a run folder moved or made again is a new key, ingested anew.
What the database was built from (each artifact's inode, size and first block) is in ``ingest_state``:
ingest rebuilds it when the artifacts no longer match.

**How it is opened.** Every connection has DuckDB's external access off and its configuration locked:
it may read the run's own gradient-norm parts (those ingest validated: regular files inside the run folder)
and ingest's staging folder in the cache, nothing else; no extension is loaded, no file attached, copied or
written. sftaudit's views are TEMP, made on each connection. A persisted view, macro, sequence or type in
the file is foreign (sftaudit makes none): the database is rebuilt from the artifacts.

Tables mirror the record kinds of `sftaudit.core.artifacts` (one row per record, plus a ``rank`` column),
declared in `sftaudit.schema.records`; the manifest's parameter list becomes ``params``. `sftaudit.store.ingest`
fills them; the checks read them through the helpers here.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

import duckdb

from ..core.artifacts import DATABASE_FILE, SERIES_DIR, artifact_root
from ..core.safe_io import UnsafeFile
from ..core.terminal import shown
from ..errors import InputError, one_line
from ..schema.records import RECORDS

CACHE_ENV = "SFTAUDIT_CACHE_DIR"
LOCK_TIMEOUT = 600.0  # seconds one audit waits for another on the same run
# The database's own layout: a database of another format is rebuilt from the artifacts.
# 2: gradient norms read in place (views over the series), not copied into grad_pieces/grad_norms tables.
# 3: each part's steps listed at ingest (grad_part_steps).
# 4: kept in sftaudit's cache, outside the run folder; the stored verdict with what it was judged on.
# 5: checkpoints carry the guard's kept copy (kept_path).
# 6: ingest_state counts the lines kept with text mended (mended_lines: a lone surrogate, bytes not UTF-8).
DATABASE_FORMAT = 6
STAGING_DIR = "staging"  # ingest's copies of new artifact lines, read by DuckDB's JSON reader
# Characters DuckDB's file readers take for a glob pattern (a path holding them is escaped, `_literal`).
_GLOB = "*?["

# Column types of each record kind (the JSON field names), from the declaration in sftaudit/schema/records.py;
# the manifest has its own table.
RECORD_COLUMNS: dict[str, dict[str, str]] = {
    kind: {f.name: f.type for f in spec.fields} for kind, spec in RECORDS.items() if kind != "manifest"
}

_SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS ingest_state (file VARCHAR PRIMARY KEY, "offset" BIGINT, records BIGINT, bad_lines BIGINT,
    lines BIGINT, device BIGINT, inode BIGINT, head VARCHAR, mended_lines BIGINT);
CREATE TABLE IF NOT EXISTS manifest (rank INTEGER, seg INTEGER, run_id VARCHAR, schema_version INTEGER,
    profile VARCHAR, world_size INTEGER, started DOUBLE, grad_norm_source VARCHAR, manifest JSON);
CREATE TABLE IF NOT EXISTS params (rank INTEGER, seg INTEGER, idx INTEGER, name VARCHAR, shape INTEGER[],
    dtype VARCHAR, numel BIGINT, requires_grad BOOLEAN, tied_to VARCHAR, kind VARCHAR, start BIGINT, stop BIGINT,
    local_numel BIGINT, replica INTEGER);
CREATE TABLE IF NOT EXISTS grad_rows (rank INTEGER, seg INTEGER, step BIGINT, idx INTEGER, norm DOUBLE);
CREATE TABLE IF NOT EXISTS grad_journal (rank INTEGER, seg INTEGER, step BIGINT, idx INTEGER, norm DOUBLE);
CREATE TABLE IF NOT EXISTS segment_cutoffs (rank INTEGER, seg INTEGER, cutoff BIGINT);
CREATE TABLE IF NOT EXISTS grad_part_steps (rank INTEGER, seg INTEGER, step BIGINT);
CREATE TABLE IF NOT EXISTS sftaudit_meta (key VARCHAR PRIMARY KEY, value VARCHAR);
"""


# --- Where: the cache, keyed by the run's identity ---------------------------------------------------------


def cache_root() -> Path:
    """sftaudit's cache folder (databases of the runs it audited)."""
    given = os.environ.get(CACHE_ENV)
    if given:
        root = Path(given)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = (Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache") / "sftaudit"
    root = Path(os.path.abspath(root))
    # DuckDB reads a path with `?` as one with options, and one with *, ? or [ as a pattern.
    if any(c in str(root) for c in _GLOB + "\\"):
        raise InputError(
            f"sftaudit's cache folder {root} holds one of * ? [ \\, which DuckDB cannot open as a plain path; "
            f"set {CACHE_ENV} to another folder"
        )
    return root


def run_identity(run_dir: str | Path) -> tuple[str, int, int]:
    """(resolved path, device, inode) of the run folder: what its database is kept under."""
    real = os.path.realpath(run_dir)
    try:
        st = os.stat(real)
    except OSError:
        raise InputError(f"{run_dir}: no such run directory") from None
    if not os.path.isdir(real):
        raise InputError(f"{run_dir}: not a directory; give the run's output folder")
    return real, st.st_dev, st.st_ino


def database_dir(run_dir: str | Path) -> Path:
    """The run's folder in the cache: its database, ingest's staging folder, the lock."""
    real, device, inode = run_identity(run_dir)
    key = hashlib.sha256(f"{real}\0{device}\0{inode}".encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return cache_root() / "runs" / key


def database_path(run_dir: str | Path) -> Path:
    return database_dir(run_dir) / DATABASE_FILE


def _made(run_dir: str | Path) -> Path:
    """The run's cache folder, made private to this user, with a note of which run it holds. Making one
    forgets the runs deleted since (`forget_deleted_runs`), so the cache holds the runs that still exist."""
    folder = database_dir(run_dir)
    if not (folder / STAGING_DIR).is_dir():
        forget_deleted_runs()
        try:
            (folder / STAGING_DIR).mkdir(mode=0o700, parents=True, exist_ok=True)
            real, device, inode = run_identity(run_dir)
            (folder / "run.json").write_text(json.dumps({"run": real, "device": device, "inode": inode}) + "\n")
        except OSError as exc:
            raise InputError(
                f"sftaudit's cache folder {folder}: cannot write ({exc.strerror or one_line(exc)}); "
                f"set {CACHE_ENV} to a writable folder"
            ) from None
    return folder


def forget_deleted_runs() -> list[Path]:
    """Remove the cache folders of runs that no longer exist where their note says (deleted, or moved: a moved
    run is a new key anyway), each under its lock, so one in use is left alone. A folder is a cache: what it
    held is rebuilt from the run's artifacts. Without this, every run ever audited (a benchmark's temporary
    copies, a sweep's runs) would keep its database and columnar copy for good. Returns the folders removed."""
    removed = []
    for folder in (cache_root() / "runs").glob("*/run.json"):
        try:
            note = json.loads(folder.read_text(encoding="utf-8"))
            st = os.stat(note["run"])
            if (st.st_dev, st.st_ino) == (note["device"], note["inode"]):
                continue
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable or foreign: not ours to judge
        try:
            fd = os.open(folder.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(folder.parent, ignore_errors=True)
            removed.append(folder.parent)
        except BlockingIOError:
            pass  # an audit is using it
        finally:
            os.close(fd)
    return removed


def remove_database(run_dir: str | Path) -> None:
    """Delete the run's database (it is rebuilt from the artifacts by the next ingest)."""
    path = database_path(run_dir)
    for leftover in (path, Path(f"{path}.wal")):
        leftover.unlink(missing_ok=True)
    shutil.rmtree(f"{path}.tmp", ignore_errors=True)


def inside_run_folder(run_dir: str | Path) -> Path:
    """The run folder, once no link in its artifact folder (nor the folder itself) leads out of it: sftaudit
    reads and writes there (importing a Trainer output writes its artifacts), so a link out of the run is
    refused before anything is read or written. A database file left there is never opened: not looked at."""
    real, _, _ = run_identity(run_dir)
    root = artifact_root(run_dir)
    links = [root] if root.is_symlink() else []
    if root.is_dir():
        for folder, dirs, files in os.walk(root):  # links are not followed: each is checked instead
            links += [Path(folder, n) for n in dirs + files if os.path.islink(os.path.join(folder, n))]
    for link in links:
        target = os.path.realpath(link)
        if os.path.commonpath([target, real]) != real and not link.name.startswith(DATABASE_FILE):
            raise UnsafeFile(
                f"{link}: a link to {target}, outside the run folder; sftaudit reads and writes only inside it"
            )
    return Path(run_dir)


# --- Opening: external access off, configuration locked, nothing foreign -----------------------------------


def first_row(con: duckdb.DuckDBPyConnection, sql: str, params: list | None = None) -> tuple | None:
    """The first row of a query, or None (results are always drained: DuckDB refuses half-read ones)."""
    rows = con.execute(sql, params or []).fetchall()
    return rows[0] if rows else None


def has_table(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    """Whether the database (or the connection's temporary objects) has a table or view of that name."""
    return bool(first_row(con, "SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [name])[0])


def has_rows(con: duckdb.DuckDBPyConnection, table: str) -> bool:
    """Whether a table exists and holds a row (not count(*): it may be a view over every norm)."""
    return has_table(con, table) and first_row(con, f'SELECT 1 FROM "{table}" LIMIT 1') is not None


def connect(run_dir: str | Path, read_only: bool = False, views: bool = True) -> duckdb.DuckDBPyConnection:
    """The run's database, opened as every connection is (external access off, configuration locked) with
    the gradient-norm views made (`views`; a reader of the record tables alone skips them: they bind
    `read_parquet` over every part four times, 0.08 s of CPU at a thousand parts). It may read the parts ingest validated and nothing else; a writable one
    (ingest's) also its staging folder and the run's series folder (the parts it is about to validate).
    Writable: a database that is not this sftaudit's (no DuckDB file, or holding foreign objects) is replaced
    by an empty one. Read-only: InputError when there is none yet, or it is not this sftaudit's."""
    path = database_path(run_dir)
    if read_only and not path.is_file():
        raise InputError(f"{run_dir}: not ingested yet (run `sftaudit ingest {run_dir}`)")
    if not read_only:
        _made(run_dir)
    # A file DuckDB makes now (none there, nor a log it would replay) holds nothing foreign: the catalog query
    # lists every built-in function (some 25 ms of CPU, a few per cent of auditing a small log).
    made_now = not read_only and not any(os.path.lexists(p) for p in (path, f"{path}.wal"))
    con = _open(path, run_dir, read_only)
    foreign = foreign_objects(con) if con is not None and not made_now else []
    why = (
        "is no DuckDB database"
        if con is None
        else f"holds {foreign[0]}, which sftaudit never makes"
        if foreign
        else None
    )
    if why:
        if con is not None:
            con.close()
        if read_only:
            raise InputError(f"{path}: {why}; run `sftaudit ingest {run_dir}` to rebuild it from the artifacts")
        remove_database(run_dir)
        con = _open(path, run_dir, read_only)
        if con is None:
            raise InputError(f"{path}: cannot make the run's database there; set {CACHE_ENV} to a writable folder")
    try:
        ours = database_format(con) == DATABASE_FORMAT
        # A reader without the views reads no part; ingest's views are made after it validated the new ones.
        parts = validated_parts(con, run_dir) if ours and (views or not read_only) else []
        folders = [] if read_only else [str(path.parent / STAGING_DIR), *_series_folder(run_dir)]
        # Each path once (a path without glob characters is its own literal): DuckDB's lock-down costs per path.
        _lock_down(
            con,
            list(dict.fromkeys(f for p in parts for f in (p, _literal(p)))),
            list(dict.fromkeys(f for p in folders for f in (p, _literal(p)))),
        )
        if ours and views:
            gradient_views(con, parts)
    except BaseException:
        con.close()
        raise
    return con


def _open(path: Path, run_dir: str | Path, read_only: bool) -> duckdb.DuckDBPyConnection | None:
    """The database file opened (nothing in it run yet); None when it is no DuckDB database at all."""
    try:
        return duckdb.connect(str(path), read_only=read_only)
    except duckdb.ConnectionException:  # open in this process, read-only where this wants to write or back
        raise InputError(f"{path}: the run's database is open in this process already; close it first") from None
    except duckdb.Error as exc:
        if "lock" in str(exc).lower():
            raise InputError(
                f"{path}: the database is open in another program; close it (or wait for it) and run again"
            ) from None
        if not path.is_file():
            raise InputError(f"{path}: cannot open the run's database ({one_line(exc)})") from None
        return None  # a file there, but no database DuckDB can open: sftaudit's own is made again


def _lock_down(con: duckdb.DuckDBPyConnection, files: list[str], folders: list[str]) -> None:
    """External access off, but for `files` and `folders`; then no setting can change again. DuckDB shares one
    database per file within a process: a second connection while the first is open finds it locked already
    (by this function: what the first may read is what the second may)."""
    locked, external = first_row(
        con, "SELECT current_setting('lock_configuration'), current_setting('enable_external_access')"
    )
    if locked and not external:
        return
    if locked:
        raise InputError("the run's database is open in this process with its configuration unlocked: close it first")
    con.execute("SET allowed_paths = ?", [files])
    con.execute("SET allowed_directories = ?", [[f"{f}{os.sep}" for f in folders]])  # the folder, not a prefix
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def foreign_objects(con: duckdb.DuckDBPyConnection) -> list[str]:
    """What the database file holds that sftaudit never makes there: persisted views, macros, sequences,
    types. Read through the system catalog by its full name, so a planted macro cannot answer for it."""
    queries = {
        "view": "SELECT view_name FROM system.main.duckdb_views() WHERE NOT internal AND NOT temporary",
        "macro": "SELECT function_name FROM system.main.duckdb_functions() "
        "WHERE function_type IN ('macro', 'table_macro') AND NOT internal AND database_name <> 'temp'",
        "sequence": "SELECT sequence_name FROM system.main.duckdb_sequences() WHERE NOT temporary",
        "type": "SELECT type_name FROM system.main.duckdb_types() WHERE NOT internal AND database_name <> 'temp'",
    }
    return [f"a {kind} {name!r}" for kind, sql in queries.items() for (name,) in con.execute(sql).fetchall()]


def database_format(con: duckdb.DuckDBPyConnection) -> int | None:
    if not has_table(con, "sftaudit_meta"):
        return None
    row = first_row(con, "SELECT value FROM sftaudit_meta WHERE key = 'database_format'")
    return int(row[0]) if row and str(row[0]).isdigit() else None


def create_tables(con: duckdb.DuckDBPyConnection) -> None:
    """The database's tables (filled by ingest, and directly by `preflight`, which has no artifacts)."""
    con.execute(_SCHEMA_SQL)
    con.execute("INSERT OR REPLACE INTO sftaudit_meta VALUES ('database_format', ?)", [str(DATABASE_FORMAT)])
    stored = {
        kind: {k: v for k, v in columns.items() if not (kind == "steps" and k == "grad_norms")}
        for kind, columns in RECORD_COLUMNS.items()
    }
    for kind, columns in stored.items():
        cols = ", ".join(f'"{k}" {v}' for k, v in columns.items())
        con.execute(f'CREATE TABLE IF NOT EXISTS "{kind}" (rank INTEGER, {cols})')
    # A database ingested by an earlier sftaudit gains the newer fields: only the missing ones are added (one
    # statement per column of every table costs more CPU than ingesting a small log).
    present = set(
        con.execute(
            "SELECT table_name, column_name FROM information_schema.columns "
            "WHERE table_catalog = current_database() AND table_schema = 'main'"
        ).fetchall()
    )
    for kind, columns in stored.items():
        for k, v in columns.items():
            if (kind, k) not in present:
                con.execute(f'ALTER TABLE "{kind}" ADD COLUMN "{k}" {v}')


def validated_parts(con: duckdb.DuckDBPyConnection, run_dir: str | Path) -> list[str]:
    """The gradient-norm parts ingest validated that hold rows, by their resolved paths (an empty part adds
    nothing to a view, and each listed part costs every query over it a read of its footer)."""
    root = os.path.realpath(artifact_root(run_dir))
    keys = con.execute(
        "SELECT file FROM ingest_state WHERE starts_with(file, ?) AND records > 0 ORDER BY file", [f"{SERIES_DIR}/"]
    ).fetchall()
    # Each folder resolved once (a part's own name resolved only where it is a link): a thousand parts share one.
    folders: dict[str, str] = {}
    parts = []
    for (key,) in keys:
        folder, name = os.path.split(os.path.join(root, key))
        if folder not in folders:
            folders[folder] = os.path.realpath(folder)
        part = os.path.join(folders[folder], name)
        parts.append(os.path.realpath(part) if os.path.islink(part) else part)
    return parts


def _series_folder(run_dir: str | Path) -> list[str]:
    """The run's series folder, resolved, if it lies inside the run folder."""
    real, folder = os.path.realpath(run_dir), os.path.realpath(artifact_root(run_dir) / SERIES_DIR)
    return [folder] if os.path.commonpath([real, folder]) == real and folder != real else []


def _literal(path: str) -> str:
    """A path as DuckDB's file readers read it literally: their glob characters each in brackets."""
    if not any(c in path for c in _GLOB):
        return path
    if "\\" in path:
        raise InputError(
            f"{path}: a path holding both a backslash and one of * ? [ cannot be read by DuckDB; rename the run folder"
        )
    return "".join(f"[{c}]" if c in _GLOB else c for c in path)


def _sql_text(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def gradient_views(con: duckdb.DuckDBPyConnection, parts: list[str]) -> None:
    """The gradient-norm views of this connection (temporary, so a moved run folder still reads), over the
    given Parquet parts: ``grad_pieces`` (each rank's own pieces on the timeline), ``grad_norms`` (the whole
    tensors: the pieces themselves, or the reduction ingest stored for a sharded run), ``grad_cells`` and
    ``grad_piece_cells`` (grad_norms and grad_pieces without the tensor names: cheaper to scan),
    ``grad_piece_steps`` (the steps with any norm recorded, per rank and segment: the parts' steps listed at
    ingest, whatever tensor index their rows name) and, after a resume, the ``superseded_`` twins. The Parquet
    parts are read where they lie, out of core."""
    sources = [
        "SELECT rank, seg, step, idx, norm FROM grad_rows",
        "SELECT rank, seg, step, idx, norm FROM grad_journal",
    ]
    if parts:
        files = "[" + ", ".join(_sql_text(_literal(f)) for f in parts) + "]"
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
    reduced = has_table(con, "grad_norms_reduced")
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
                if has_table(con, "superseded_grad_norms_reduced")
                else "superseded_grad_pieces"
            )
        )


# --- The lock: one sftaudit at a time on a run's database ---------------------------------------------------

_held: dict[str, list] = {}  # cache folder -> [descriptor, depth]: the lock is re-entrant within a process


@contextmanager
def run_lock(run_dir: str | Path, timeout: float = LOCK_TIMEOUT):
    """Hold the run's lock while its database is used: a second audit of the same run waits for the
    first, with a message, instead of failing on DuckDB's own file lock. The lock is taken on the run's
    folder in the cache (flock on its descriptor): nothing is written into the run folder for it."""
    key = str(_made(run_dir))
    if key not in _held:
        _held[key] = [_acquire(key, run_dir, timeout), 0]
    entry = _held[key]
    entry[1] += 1
    try:
        yield
    finally:
        entry[1] -= 1
        if not entry[1]:
            os.close(_held.pop(key)[0])  # closing the descriptor releases the lock


def _acquire(key: str, run_dir: str | Path, timeout: float) -> int:
    fd = os.open(key, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
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


# --- What the checks read -----------------------------------------------------------------------------------


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
