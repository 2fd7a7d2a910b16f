"""Artifacts -> DuckDB. Incremental: each file's ingested byte offset is remembered, so a
second ingest of a growing run reads only what was appended since.

The database lives at ``RUN_DIR/sftaudit/audit.duckdb``. Its tables mirror the record
kinds of `sftaudit.artifacts` (one row per record, plus a ``rank`` column), except:
``steps.grad_norms`` is unnested into the long table ``grad_pieces(step, idx, tensor,
norm)``, and the manifest's parameter list becomes ``params`` (with each parameter's layout on
the rank: see `sftaudit.shim.pieces`).

Distributed runs are reduced here, with no torch: ``grad_norms`` holds every rank's per-tensor
gradient norm of the *whole* tensor, as a single process records it. A ``sharded`` tensor's norm
is the root of the sum of its pieces' squares over one replica group; a ``replicated`` one takes
the lowest rank's value (LOOP-17 compares the other replicas); a tensor whose pieces do not cover
all its elements (a rank missing) gets no row at that step, never a smaller norm. For sharded runs
``steps.grad_norm`` becomes the reduced total (NULL where a tensor is incomplete).

A resumed run is one timeline: when a later segment starts at step s, the earlier
segments' records of steps >= s (the stretch the resume abandoned) move to
``superseded_<table>``, so every check reads the run the checkpoints describe.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path, PurePosixPath

import duckdb

from .artifacts import DATABASE_FILE, RECORD_KINDS, SCHEMA_VERSION, artifact_root
from .errors import InputError

# Column types of each record kind as written by the shim (the JSON field names).
RECORD_COLUMNS: dict[str, dict[str, str]] = {
    "steps": {"seg": "INTEGER", "step": "BIGINT", "time": "DOUBLE", "dt": "DOUBLE", "loss": "DOUBLE",
              "lr": "DOUBLE", "grad_norm": "DOUBLE", "grad_norms": "DOUBLE[]",
              "nonfinite_grads": "MAP(VARCHAR, BIGINT)", "micro_batches": "INTEGER", "tokens": "BIGINT",
              # under the Trainer: the norms after its clipping (grad_norms holds the pre-clip ones), and a step
              # whose norms could only be read after the clip
              "grad_norm_post_clip": "DOUBLE", "grad_norms_post_clip": "DOUBLE[]", "grad_norm_source": "VARCHAR"},
    "batches": {"seg": "INTEGER", "step": "BIGINT", "micro": "INTEGER", "rows": "INTEGER", "seq_len": "INTEGER",
                "sample_ids": "VARCHAR[]", "lengths": "INTEGER[]", "label_tokens": "INTEGER[]",
                "padding_trained": "INTEGER[]", "left_padded_rows": "INTEGER",
                "tokenizer_length": "INTEGER", "template_fingerprint": "VARCHAR",
                # loss normalisation (LOOP-13): shifted target tokens per row, the model's loss, its weight in
                # the backpropagated objective, the HF num_items_in_batch, the scalar given to on_backward
                "target_tokens": "INTEGER[]", "model_loss": "DOUBLE", "loss_weight": "DOUBLE", "num_items": "DOUBLE",
                "backprop": "DOUBLE",
                # packing (LOOP-16): attended BOS tokens and position_ids restarts per row, varlen attention given,
                # the attention mask the model got ("none" / "padding" / "custom") and whether it built a KV cache
                "bos_starts": "INTEGER[]", "position_resets": "INTEGER[]", "varlen": "BOOLEAN",
                "attention_mask_kind": "VARCHAR", "cache_built": "BOOLEAN"},
    "samples": {"seg": "INTEGER", "step": "BIGINT", "micro": "INTEGER", "row": "INTEGER", "sample_id": "VARCHAR",
                "input_ids": "INTEGER[]", "labels": "INTEGER[]", "attention_mask": "INTEGER[]"},
    "grad_hists": {"seg": "INTEGER", "step": "BIGINT", "tensor": "VARCHAR", "reason": "VARCHAR",
                   "zeros": "BIGINT", "nonfinite": "BIGINT", "counts": "BIGINT[]"},
    "probes": {"seg": "INTEGER", "step": "BIGINT", "prompt": "INTEGER", "entropy": "DOUBLE",
               "top_ids": "INTEGER[]", "top_probs": "DOUBLE[]"},
    "generations": {"seg": "INTEGER", "step": "BIGINT", "prompt": "INTEGER", "sample": "INTEGER", "text": "VARCHAR",
                    "new_tokens": "INTEGER", "stopped": "BOOLEAN"},
    "evals": {"seg": "INTEGER", "step": "BIGINT", "item": "INTEGER", "id": "VARCHAR", "prediction": "VARCHAR",
              "reference": "VARCHAR", "new_tokens": "INTEGER", "stopped": "BOOLEAN"},
    "metrics": {"seg": "INTEGER", "step": "BIGINT", "name": "VARCHAR", "value": "DOUBLE"},
    "checkpoints": {"seg": "INTEGER", "event": "VARCHAR", "step": "BIGINT", "path": "VARCHAR", "files": "JSON",
                    "training_state": "JSON", "tokenizer_fingerprint": "VARCHAR", "param_norms": "DOUBLE[]",
                    "param_fingerprints": "BIGINT[]", "time": "DOUBLE", "sha256": "JSON"},
    "events": {"seg": "INTEGER", "kind": "VARCHAR", "probe": "VARCHAR", "step": "BIGINT", "time": "DOUBLE",
               "error": "VARCHAR", "traceback": "VARCHAR", "sample_id": "VARCHAR", "param_norms": "DOUBLE[]",
               "optimizer_step": "BIGINT"},
}

_SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS ingest_state (file VARCHAR PRIMARY KEY, "offset" BIGINT, records BIGINT, bad_lines BIGINT);
CREATE TABLE IF NOT EXISTS manifest (rank INTEGER, seg INTEGER, run_id VARCHAR, schema_version INTEGER,
    profile VARCHAR, world_size INTEGER, started DOUBLE, grad_norm_source VARCHAR, manifest JSON);
CREATE TABLE IF NOT EXISTS params (rank INTEGER, seg INTEGER, idx INTEGER, name VARCHAR, shape INTEGER[],
    dtype VARCHAR, numel BIGINT, requires_grad BOOLEAN, tied_to VARCHAR);
ALTER TABLE params ADD COLUMN IF NOT EXISTS kind VARCHAR;
ALTER TABLE params ADD COLUMN IF NOT EXISTS start BIGINT;
ALTER TABLE params ADD COLUMN IF NOT EXISTS stop BIGINT;
ALTER TABLE params ADD COLUMN IF NOT EXISTS local_numel BIGINT;
ALTER TABLE params ADD COLUMN IF NOT EXISTS replica INTEGER;
CREATE TABLE IF NOT EXISTS grad_pieces (rank INTEGER, seg INTEGER, step BIGINT, idx INTEGER, tensor VARCHAR, norm DOUBLE);
CREATE TABLE IF NOT EXISTS grad_norms (rank INTEGER, seg INTEGER, step BIGINT, idx INTEGER, tensor VARCHAR, norm DOUBLE);
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
    return duckdb.connect(str(path), read_only=read_only)


def rank_folders(run_dir: str | Path) -> list[tuple[int, Path]]:
    root = artifact_root(run_dir)
    if not Path(run_dir).is_dir():
        raise InputError(f"{run_dir}: no such run directory")
    ranks = sorted((int(m.group(1)), p) for p in root.glob("rank-*") if (m := re.fullmatch(r"rank-(\d+)", p.name)))
    if not ranks:
        raise InputError(f"{run_dir}: no sftaudit artifacts (expected {root}/rank-<r>/)")
    return ranks


def create_tables(con: duckdb.DuckDBPyConnection) -> None:
    """The ingest schema (also filled directly by `preflight`, which has no artifacts)."""
    con.execute(_SCHEMA_SQL)
    for kind, columns in RECORD_COLUMNS.items():
        stored = {k: v for k, v in columns.items() if not (kind == "steps" and k == "grad_norms")}
        cols = ", ".join(f'"{k}" {v}' for k, v in stored.items())
        con.execute(f'CREATE TABLE IF NOT EXISTS "{kind}" (rank INTEGER, {cols})')
        for k, v in stored.items():  # a database ingested by an older sftaudit gains the newer fields
            con.execute(f'ALTER TABLE "{kind}" ADD COLUMN IF NOT EXISTS "{k}" {v}')


def ingest(run_dir: str | Path) -> dict[str, int]:
    """Load new records into the run's DuckDB file; returns the number of new records per kind."""
    ranks = rank_folders(run_dir)
    con = connect(run_dir)
    try:
        con.begin()  # all or nothing: offsets only move with the rows they stand for
        create_tables(con)
        added = {kind: 0 for kind in RECORD_KINDS}
        for rank, folder in ranks:
            for kind in RECORD_KINDS:
                added[kind] += _ingest_file(con, rank, kind, folder / f"{kind}.jsonl")
        if not first_row(con, "SELECT count(*) FROM manifest")[0]:
            raise InputError(f"{run_dir}: artifacts have no manifest record")
        _supersede_abandoned_steps(con)
        _reduce_gradients(con, "grad_pieces", "grad_norms")
        if first_row(con, "SELECT count(*) FROM information_schema.tables WHERE table_name = 'superseded_grad_pieces'")[0]:
            _reduce_gradients(con, "superseded_grad_pieces", "superseded_grad_norms")
        _reduced_step_totals(con)
        con.commit()
        return added
    finally:
        con.close()


# Tables whose rows belong to a step of the timeline (events stay: they are the run's history).
TIMELINE_TABLES = ("steps", "grad_pieces", "batches", "samples", "grad_hists", "probes", "generations", "evals",
                   "metrics", "checkpoints")


def _supersede_abandoned_steps(con: duckdb.DuckDBPyConnection) -> None:
    if first_row(con, "SELECT count(DISTINCT seg) FROM steps")[0] < 2:
        return
    con.execute("CREATE OR REPLACE TEMP TABLE segment_starts AS SELECT rank, seg, min(step) AS first_step "
                "FROM steps GROUP BY rank, seg")
    for table in TIMELINE_TABLES:
        abandoned = (f"FROM segment_starts s WHERE s.rank = {table}.rank AND s.seg > {table}.seg "
                     f"AND s.first_step <= {table}.step")
        con.execute(f"CREATE TABLE IF NOT EXISTS superseded_{table} AS SELECT * FROM {table} WITH NO DATA")
        # A database ingested by an older sftaudit: its superseded copy gains the newer fields too.
        for name, dtype in con.execute(
                "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = ? AND column_name "
                "NOT IN (SELECT column_name FROM information_schema.columns WHERE table_name = ?)",
                [table, f"superseded_{table}"]).fetchall():
            con.execute(f'ALTER TABLE superseded_{table} ADD COLUMN "{name}" {dtype}')
        con.execute(f"INSERT INTO superseded_{table} BY NAME SELECT * FROM {table} WHERE EXISTS (SELECT 1 {abandoned})")
        con.execute(f"DELETE FROM {table} USING segment_starts s WHERE s.rank = {table}.rank "
                    f"AND s.seg > {table}.seg AND s.first_step <= {table}.step")
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
        con.execute(f"CREATE OR REPLACE TABLE {reduced} AS SELECT * FROM {pieces}")  # one process per rank: as is
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


def _ingest_file(con: duckdb.DuckDBPyConnection, rank: int, kind: str, path: Path) -> int:
    if not path.exists():
        return 0
    key = str(path.relative_to(path.parent.parent))
    row = first_row(con, 'SELECT "offset" FROM ingest_state WHERE file = ?', [key])
    offset = row[0] if row else 0
    with open(path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    end = chunk.rfind(b"\n") + 1  # a torn last line (process killed mid-write) waits for its newline
    if end == 0:
        return 0
    chunk = chunk[:end]
    lines = chunk.count(b"\n") - chunk.count(b"\n\n")
    if kind == "manifest":
        records = _ingest_manifests(con, rank, chunk)
    else:
        records = _ingest_records(con, rank, kind, chunk)
    con.execute(
        "INSERT OR REPLACE INTO ingest_state VALUES (?, ?, ?, ?)",
        [key, offset + end, records, max(lines - records, 0)],
    )
    return records


def _ingest_records(con: duckdb.DuckDBPyConnection, rank: int, kind: str, chunk: bytes) -> int:
    columns = RECORD_COLUMNS[kind]
    fd, tmp = tempfile.mkstemp(suffix=".jsonl")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(chunk)
        spec = "{" + ", ".join(f"'{k}': '{v}'" for k, v in columns.items()) + "}"
        source = f"read_json('{tmp}', format='newline_delimited', columns={spec}, ignore_errors=true)"
        # A corrupt line parses to all-NULL columns: drop those rather than invent records.
        con.execute(f"CREATE OR REPLACE TEMP TABLE new_records AS SELECT * FROM {source} WHERE seg IS NOT NULL")
        n = first_row(con, "SELECT count(*) FROM new_records")[0]
        stored = [k for k in columns if not (kind == "steps" and k == "grad_norms")]
        names = ", ".join(f'"{k}"' for k in stored)
        con.execute(f'INSERT INTO "{kind}" (rank, {names}) SELECT {rank}, {names} FROM new_records')
        if kind == "steps":
            con.execute(
                """
                INSERT INTO grad_pieces
                SELECT ?, s.seg, s.step, s.idx, p.name, s.norm
                FROM (SELECT seg, step, unnest(grad_norms) AS norm,
                             generate_subscripts(grad_norms, 1) - 1 AS idx FROM new_records) s
                JOIN params p ON p.rank = ? AND p.seg = s.seg AND p.idx = s.idx
                WHERE s.norm IS NOT NULL
                """,
                [rank, rank],
            )
        con.execute("DROP TABLE new_records")
        return n
    finally:
        os.unlink(tmp)


def _ingest_manifests(con: duckdb.DuckDBPyConnection, rank: int, chunk: bytes) -> int:
    n = 0
    for line in chunk.decode("utf-8", errors="replace").splitlines():
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            continue
        if m.get("schema_version", 0) > SCHEMA_VERSION:
            raise InputError(
                f"artifacts use schema version {m['schema_version']}; this sftaudit reads up to {SCHEMA_VERSION}"
            )
        seg = m.get("seg", 0)
        con.execute(
            "INSERT INTO manifest VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [rank, seg, m.get("run_id"), m.get("schema_version"), m.get("profile"), m.get("world_size"),
             m.get("started"), m.get("grad_norm_source"), json.dumps(m)],
        )
        rows = [(rank, seg, i, p["name"], p["shape"], p["dtype"], p["numel"], p["requires_grad"], None,
                 p.get("kind", "local"), p.get("start"), p.get("stop"), p.get("local_numel", p["numel"]),
                 p.get("replica", rank))
                for i, p in enumerate(m.get("params", []))]
        rows += [(rank, seg, None, alias, None, None, None, None, target, None, None, None, None, None)
                 for alias, target in m.get("tied", {}).items()]
        if rows:
            con.executemany("INSERT INTO params (rank, seg, idx, name, shape, dtype, numel, requires_grad, tied_to, "
                            "kind, start, stop, local_numel, replica) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            rows)
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
    save (the one on disk), every step it was saved at, that save's segment and recorded hashes."""
    rows = con.execute(
        """WITH saved AS (SELECT * FROM checkpoints WHERE event = 'saved' AND rank = 0),
                saves AS (SELECT path, list(step ORDER BY seg, step) AS saves FROM saved GROUP BY path),
                last AS (SELECT path, step, seg FROM saved
                         QUALIFY row_number() OVER (PARTITION BY path ORDER BY seg DESC, step DESC) = 1),
                hashed AS (SELECT path, step, seg, any_value(sha256) AS sha256 FROM checkpoints
                           WHERE event = 'hashed' AND rank = 0 GROUP BY path, step, seg)
           SELECT l.path, l.step, l.seg, s.saves, h.sha256 FROM last l JOIN saves s USING (path)
           LEFT JOIN hashed h ON h.path = l.path AND h.step = l.step AND h.seg = l.seg
           ORDER BY l.step, l.path""").fetchall()
    names = checkpoint_names([r[0] for r in rows])
    return [{"name": names[path], "path": path, "step": step, "seg": seg, "saves": saves,
             "sha256": json.loads(sha) if sha else {}} for path, step, seg, saves, sha in rows]


def checkpoint_names(paths: list[str]) -> dict[str, str]:
    """Display names: the shortest path suffix that tells the checkpoints apart, without the file
    name they all share (``checkpoints/step-20/model.safetensors`` -> ``step-20``)."""
    parts = {p: PurePosixPath(p.replace("\\", "/")).parts or (p,) for p in paths}
    shared = 0  # trailing components every checkpoint has in common (model.safetensors)
    if len(parts) > 1:
        while all(len(q) > shared + 1 for q in parts.values()) and \
                len({q[len(q) - shared - 1] for q in parts.values()}) == 1:
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
