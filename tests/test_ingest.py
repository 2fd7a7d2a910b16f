"""Incremental ingest, torn and corrupt lines; the run database: where it lives and how it is opened."""

import json
import math
import os
import re
import shutil

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sftaudit.core.artifacts import DATABASE_FILE, artifact_root, rank_dir, series_dir
from sftaudit.errors import InputError
from sftaudit.store.ingest import _COPY_BLOCK, _copy_complete_lines, _readable, ingest, ingested
from sftaudit.store.rundb import (
    cache_root,
    connect,
    database_dir,
    database_path,
    foreign_objects,
    has_table,
    run_lock,
    validated_parts,
)
from tests.hostile.builders import recorded_run


def copy_run(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("audit.duckdb*", "checkpoint-*"))
    return dst


def test_second_ingest_adds_only_new_records(clean_run, tmp_path):
    run = copy_run(clean_run, tmp_path / "run")
    steps = rank_dir(run, 0) / "steps.jsonl"
    lines = steps.read_bytes().splitlines(keepends=True)
    steps.write_bytes(b"".join(lines[:10]) + lines[10][:25])  # ten steps and a torn eleventh
    added = ingest(run)
    assert added["steps"] == 10
    steps.write_bytes(b"".join(lines))  # the run went on: the torn line completed, more appended
    added = ingest(run)
    assert added["steps"] == 20 and added["batches"] == 0
    assert ingest(run)["steps"] == 0
    con = connect(run, read_only=True)
    assert con.execute("SELECT count(*), count(DISTINCT step) FROM steps").fetchall() == [(30, 30)]
    assert con.execute("SELECT count(DISTINCT step) FROM grad_norms").fetchall() == [(30,)]


def test_corrupt_line_is_skipped_and_counted(clean_run, tmp_path):
    run = copy_run(clean_run, tmp_path / "run")
    steps = rank_dir(run, 0) / "steps.jsonl"
    lines = steps.read_bytes().splitlines(keepends=True)
    lines[5] = b'{"seg": 0, "step": 6, "loss": \x00garbage\n'
    steps.write_bytes(b"".join(lines))
    assert ingest(run)["steps"] == 29
    con = connect(run, read_only=True)
    assert con.execute("SELECT bad_lines FROM ingest_state WHERE file LIKE '%steps.jsonl'").fetchall() == [(1,)]


def test_a_database_ingested_by_an_older_sftaudit_gains_the_newer_fields(resumed_run, tmp_path):
    """Re-auditing a resumed run whose audit.duckdb predates a new record field (here LOOP-16's mask and
    cache fields): the superseded copies of the timeline tables gain it too, instead of a binder error."""
    run = tmp_path / "run"
    shutil.copytree(resumed_run, run, ignore=shutil.ignore_patterns("checkpoint-*"))
    ingest(run)
    con = connect(run)
    for table in ("batches", "superseded_batches"):
        con.execute(f"ALTER TABLE {table} DROP COLUMN cache_built")
    con.close()
    ingest(run)
    con = connect(run, read_only=True)
    assert con.execute("SELECT count(*) FROM superseded_batches WHERE cache_built IS NOT NULL").fetchone()[0] == 0
    assert "cache_built" in {
        c
        for (c,) in con.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'superseded_batches'"
        ).fetchall()
    }


# The run database itself (`sftaudit.store.rundb`): sftaudit's own, in its cache, opened locked down.


def test_the_database_lives_in_the_cache_keyed_by_the_run_folder(tmp_path):
    run = recorded_run(tmp_path, "run")
    ingest(run)
    path = database_path(run)
    assert path.is_file() and path.is_relative_to(cache_root()) and not (artifact_root(run) / DATABASE_FILE).exists()
    assert json.loads((path.parent / "run.json").read_text())["run"] == os.path.realpath(run)
    moved = run.rename(tmp_path / "moved")  # same inode, another path: another run to the cache
    assert database_path(moved) != path and not database_path(moved).exists()
    assert ingest(moved)["steps"] == 30


def test_the_cache_forgets_runs_deleted_since_but_not_one_in_use(tmp_path):
    """A run audited once and deleted leaves nothing in the cache after the next new run is audited; a run that
    still exists keeps its database, and so does a deleted one another audit still holds the lock of."""
    kept, deleted, in_use = (recorded_run(tmp_path, name) for name in ("kept", "deleted", "in-use"))
    folders = {}
    for run in (kept, deleted, in_use):
        ingest(run)
        folders[run.name] = database_dir(run)
    shutil.rmtree(deleted)
    with run_lock(in_use):
        shutil.rmtree(in_use)
        ingest(recorded_run(tmp_path, "new"))
        assert folders["in-use"].is_dir()
    assert not folders["deleted"].exists() and database_path(kept).is_file()


def test_every_connection_is_locked_down(tmp_path):
    run = recorded_run(tmp_path, "run")
    ingest(run)
    outside = tmp_path / "outside.txt"
    outside.write_text("not the run's")
    con = connect(run, read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM grad_norms").fetchone() == (30 * 4,)  # the parts: readable
        for sql in (
            f"SELECT * FROM read_text('{outside}')",
            f"ATTACH '{tmp_path / 'other.duckdb'}' AS other",
            f"COPY (SELECT 1) TO '{tmp_path / 'out.csv'}'",
            "INSTALL httpfs",
        ):
            with pytest.raises(duckdb.PermissionException):
                con.execute(sql)
        with pytest.raises(duckdb.InvalidInputException, match="locked"):
            con.execute("SET enable_external_access = true")
    finally:
        con.close()
    assert not (tmp_path / "other.duckdb").exists() and not (tmp_path / "out.csv").exists()


def test_an_audit_judges_on_ingests_connection_whose_views_name_only_the_validated_parts(tmp_path):
    """`audited` judges on the connection `ingested` yields (one opening of the database an audit): its gradient
    views read the parts ingest validated, named one by one, never the series folder as a pattern. A reader that
    asks for no views gets none, and may read no part."""
    run = recorded_run(tmp_path, "run")
    with ingested(run) as (con, added):
        assert added["steps"] == 30
        parts = validated_parts(con, run)
        assert parts and con.execute("SELECT count(*) FROM grad_norms").fetchone() == (30 * 4,)
        named = set()
        for (sql,) in con.execute(
            "SELECT sql FROM duckdb_views() WHERE temporary AND sql LIKE '%read_parquet%'"
        ).fetchall():
            named |= set(re.findall(r"'([^']*\.parquet)'", sql))
        assert named == set(parts)
    con = connect(run, read_only=True, views=False)
    try:
        assert not has_table(con, "grad_norms")
        with pytest.raises(duckdb.PermissionException):
            con.execute(f"SELECT count(*) FROM read_parquet('{parts[0]}')")
    finally:
        con.close()


@pytest.mark.parametrize(
    "planted",
    [
        "CREATE MACRO isfinite(x) AS true",
        "CREATE MACRO read_parquet(f) AS TABLE SELECT 1",
        "CREATE VIEW steps_view AS SELECT * FROM steps",
        "CREATE SEQUENCE counter",
        "CREATE TYPE mood AS ENUM ('calm')",
    ],
)
def test_a_database_holding_what_sftaudit_never_persists_is_rebuilt(tmp_path, planted):
    run = recorded_run(tmp_path, "run", nan_step=13)
    ingest(run)
    con = duckdb.connect(str(database_path(run)))
    con.execute(planted)
    con.close()
    with pytest.raises(InputError, match="which sftaudit never makes"):
        connect(run, read_only=True)
    assert ingest(run)["steps"] == 30  # rebuilt from the artifacts
    con = connect(run, read_only=True)
    try:
        assert foreign_objects(con) == []
        assert con.execute("SELECT count(*) FROM grad_norms WHERE NOT isfinite(norm)").fetchone() == (18 * 4,)
    finally:
        con.close()


def test_empty_parts_are_validated_once_and_left_out_of_the_views(tmp_path):
    run = recorded_run(tmp_path, "run")
    empty = pa.table(
        {"step": pa.array([], pa.int64()), "idx": pa.array([], pa.int32()), "norm": pa.array([], pa.float32())}
    )
    for i in range(3):
        pq.write_table(empty, series_dir(run, 0, 0) / f"part-{900000000 + i:09d}.parquet")
    ingest(run)
    con = connect(run, read_only=True)
    try:
        listed = con.execute("SELECT count(*) FROM ingest_state WHERE records = 0 AND file LIKE '%part-9%'").fetchone()
        assert listed == (3,) and validated_parts(con, run) == sorted(validated_parts(con, run))
        assert len(validated_parts(con, run)) == 3  # the three real parts only
    finally:
        con.close()


# Text rich in surrogates (Hypothesis leaves them out unless told), backslashes, quotes and `u`: whatever else.
_TEXT = st.text(
    alphabet=st.one_of(
        st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, codec=None, exclude_categories=()),
        st.sampled_from(["\\", '"', "u", "d", "8", "\U0001f600"]),
        st.characters(),
    ),
    max_size=12,
)


@given(st.lists(_TEXT, max_size=4))
@settings(max_examples=300, deadline=None)
def test_a_lone_surrogate_is_kept_as_its_escape_and_nothing_else_changes(ids):
    """Any strings, as JSON escapes them: read back they are what JSON says (a surrogate pair is its
    character), each lone surrogate as the six characters of its escape; a line without one is unchanged."""
    line = json.dumps({"sample_ids": ids}).encode()
    decoded = json.loads(line)["sample_ids"]  # pairs joined; what is left of the surrogates is lone
    lone = re.compile("[\ud800-\udfff]")
    assert json.loads(_readable(line))["sample_ids"] == [
        lone.sub(lambda m: f"\\u{ord(m.group()):04x}", s) for s in decoded
    ]
    if not any(lone.search(s) for s in decoded):
        assert _readable(line) == line


@pytest.mark.parametrize(
    "odd",
    [b"", b" \t\r", b'{"x": "\\ud800"}', b'{"x": "\xed\xa0\x80"}', b'{"x": "caf\xc3\xa9"}', b"  {}"],
    ids=["blank", "whitespace", "lone-surrogate", "not-utf8", "utf8", "indented"],
)
def test_lines_copied_a_block_at_a_time_are_those_read_one_by_one(tmp_path, odd):
    """Plain lines over several copy blocks, one torn across each block's end, and a line that needs a change or
    a refusal in the second block: what is copied and counted is what reading line by line gives."""
    plain = [b'{"seg": 0, "step": %d, "name": "%s"}' % (i, b"x" * (i % 2000)) for i in range(25_000)]
    lines = plain[:10_000] + [odd] + plain[10_000:]  # about 10 MiB in: in the second block
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n" + b'{"torn":')
    assert path.stat().st_size > 3 * _COPY_BLOCK
    kept = [_readable(line) for line in lines if line.strip()]
    fd = os.open(path, os.O_RDONLY)
    with open(tmp_path / "copy.jsonl", "wb") as out:
        end, copied, refused, mended = _copy_complete_lines(fd, 0, path.stat().st_size, 2**26, out)
    os.close(fd)
    assert (tmp_path / "copy.jsonl").read_bytes() == b"".join(line + b"\n" for line in kept)
    assert (end, copied, refused, mended) == (
        path.stat().st_size - len(b'{"torn":'),
        len(kept),
        len(lines) - len(kept),
        sum(line != _readable(line) for line in lines),
    )


# JSON values of every kind a field may hold: integers at and past each column's range, fractions and exponents
# (which the JSON cast rounds its own way), non-finite numbers, text, and the other JSON kinds.
_ODD_VALUES = [
    "1", "-1", "-0", "1.5", "2.5", "-2.5", "1e3", "1E+3", "1e-7", "1e20", "1e999", "-1e999", "NaN", "Infinity",
    "-Infinity", '"1"', '"NaN"', '"a\\u00e9\\"b"', "true", "false", "null", "[1]", '{"a": 1}', "2147483647",
    "2147483648", "-2147483649", "9223372036854775807", "9223372036854775808", "-9223372036854775809",
    "18446744073709551616", "123456789012345678901234567890", "4.9e-324", "2147483646.5", "9007199254740993",
]  # fmt: skip


@pytest.mark.parametrize("dtype", ["INTEGER", "BIGINT", "DOUBLE", "VARCHAR"])
def test_typed_from_the_json_text_is_the_json_cast(tmp_path, dtype):
    """A field read from its JSON text (`_typed`) holds what the JSON value's type and cast give (`_json_typed`),
    value for value: the cheaper reading changes no record."""
    from sftaudit.store.ingest import _json_typed, _typed

    path = tmp_path / "values.jsonl"
    path.write_text("".join(f'{{"x": {v}}}\n' for v in _ODD_VALUES))
    con = duckdb.connect()
    rows = con.execute(
        f"SELECT x::VARCHAR, {_typed('x', dtype)}, {_json_typed('x', dtype)} "
        f"FROM read_json('{path}', format='newline_delimited', columns={{'x': 'JSON'}})"
    ).fetchall()
    assert len(rows) == len(_ODD_VALUES)
    differ = [(text, a, b) for text, a, b in rows if a != b and not (a != a and b != b)]  # NaN == NaN
    assert differ == []


def _metrics_parquet(run, seg, step, name, value):
    """An import's metrics.parquet (as `sftaudit.imports.writer` writes it) in the run's rank-0 folder."""
    table = pa.table(
        {
            "seg": pa.array(seg, pa.int32()),
            "step": pa.array(step, pa.int64()),
            "name": pa.array(name, pa.string()),
            "value": pa.array(value, pa.float64()),
        }
    )
    path = rank_dir(run, 0) / "metrics.parquet"
    pq.write_table(table, path, compression="zstd")
    return path


def test_an_imports_columnar_metrics_are_ingested_typed_once_and_again_when_replaced(tmp_path):
    run = recorded_run(tmp_path)
    _metrics_parquet(run, [0, 0, None], [1, 2, 3], ["entropy", "entropy", "entropy"], [1.5, float("nan"), 2.0])
    assert ingest(run)["metrics"] == 2
    con = connect(run, read_only=True)
    rows = con.execute("SELECT rank, seg, step, name, value FROM metrics ORDER BY step").fetchall()
    state = con.execute("SELECT records, bad_lines, lines FROM ingest_state WHERE file LIKE '%metrics.parquet'")
    assert rows[0] == (0, 0, 1, "entropy", 1.5) and math.isnan(rows[1][4]) and state.fetchall() == [(2, 1, 3)]
    con.close()
    assert ingest(run)["metrics"] == 0  # read once
    _metrics_parquet(run, [0], [1], ["entropy"], [9.0])  # imported again: the database is rebuilt from it
    assert ingest(run)["metrics"] == 1
    con = connect(run, read_only=True)
    assert con.execute("SELECT step, value FROM metrics").fetchall() == [(1, 9.0)]
    con.close()


def test_an_imports_columnar_steps_hold_the_fields_an_import_writes_and_no_other(tmp_path):
    run = recorded_run(tmp_path)
    (rank_dir(run, 0) / "steps.jsonl").unlink()
    path = rank_dir(run, 0) / "steps.parquet"
    columns = {
        "seg": pa.array([0, 0], pa.int32()),
        "step": pa.array([1, 2], pa.int64()),
        "loss": pa.array([2.0, float("nan")]),
        "lr": pa.array([1e-4, None], pa.float64()),
        "grad_norm": pa.array([0.5, 0.6]),
    }
    pq.write_table(pa.table(columns), path)
    assert ingest(run)["steps"] == 2
    con = connect(run, read_only=True)
    rows = con.execute("SELECT seg, step, loss, lr, grad_norm, time FROM steps ORDER BY step").fetchall()
    con.close()
    assert rows[0] == (0, 1, 2.0, 1e-4, 0.5, None) and math.isnan(rows[1][2]) and rows[1][3] is None
    pq.write_table(pa.table({**columns, "time": pa.array([1.0, 2.0])}), path)  # a field only the shim writes
    with pytest.raises(InputError, match=r"steps.parquet: not an import's steps \(expected seg INT32, step INT64"):
        ingest(run)


def test_a_columnar_file_of_other_columns_or_claiming_more_rows_than_it_holds_is_refused(tmp_path):
    run = recorded_run(tmp_path)
    path = rank_dir(run, 0) / "metrics.parquet"
    pq.write_table(pa.table({"seg": pa.array([0], pa.int64()), "step": [1], "name": ["x"], "value": [1.0]}), path)
    with pytest.raises(InputError, match=r"metrics.parquet: not an import's metrics \(expected seg INT32"):
        ingest(run)
    path.write_bytes(b"PAR1 a footer that is no footer PAR1")
    with pytest.raises(InputError, match="not a readable Parquet file"):
        ingest(run)
    good = pa.table(
        {"seg": pa.array([0] * 4096, pa.int32()), "step": range(4096), "name": ["x"] * 4096, "value": [1.0] * 4096}
    )
    pq.write_table(good, path, compression="snappy", use_dictionary=False)
    data = bytearray(path.read_bytes())
    data[100:4000] = bytes(3900)  # the pages garbled, the footer sound: refused from its page headers, unread
    path.write_bytes(bytes(data))
    with pytest.raises(
        InputError, match=r"metrics.parquet: [^\n]*the page header at byte [^\n]*; sftaudit import"
    ) as exc:
        ingest(run)
    assert "Traceback" not in str(exc.value)
    n = 1 << 22  # four million identical rows: a few KB compressed
    table = pa.table(
        {
            "seg": pa.array(np.zeros(n, np.int32)),
            "step": pa.array(np.ones(n, np.int64)),
            "name": pa.array(["x"] * n, pa.string()),
            "value": pa.array(np.ones(n)),
        }
    )
    pq.write_table(table, path, compression="zstd")
    with pytest.raises(InputError, match=f"claims {n} rows .* decompression bomb"):
        ingest(run)
