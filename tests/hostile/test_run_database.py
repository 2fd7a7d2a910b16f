"""A run folder is untrusted, and so is a database found in it: the run database is sftaudit's own (in its cache,
outside the run), opened with external access off, and rebuilt when it holds anything sftaudit never makes.

Every case runs `sftaudit` (or `sftaudit.open`) in a subprocess under a time bound, and checks that nothing
outside the run, the cache and the reports was read or written: a sentinel file beside the run, whose access
time is older than its change time (so a read moves it, on a file system that records reads: relatime, Linux's
default), and a listing of every other file there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sftaudit.core.artifacts import ARTIFACT_DIR, DATABASE_FILE, rank_dir, series_dir
from sftaudit.store.rundb import CACHE_ENV, database_path

from .builders import AUDIT_BOUND_S, recorded_run, trainer_run

SECRET = "sentinel-content-outside-the-run"


class Box:
    """A test's folder: runs, the cache, the reports, and beside them a sentinel nothing may read."""

    def __init__(self, root: Path):
        self.root = root
        self.cache = root / "cache #1 %41"  # the cache path is used by DuckDB too: specials included
        self.reports = root / "reports"
        self.outside = root / "outside"
        self.outside.mkdir()
        self.sentinel = self.outside / "secret.txt"
        self.sentinel.write_text(SECRET)
        self._age(self.sentinel)
        self.runs: list[Path] = []

    @staticmethod
    def _age(path: Path) -> None:
        st = path.stat()
        os.utime(path, ns=(st.st_mtime_ns - 3600 * 10**9, st.st_mtime_ns))

    def listing(self) -> dict[str, tuple[int, int]]:
        """Every file outside the runs, the cache and the reports: (size, change time)."""
        kept = [self.cache, self.reports, *self.runs]
        return {
            str(p): (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in self.root.rglob("*")
            if not any(p == k or k in p.parents for k in kept)
        }

    def cli(self, *args, timeout: int = AUDIT_BOUND_S) -> subprocess.CompletedProcess:
        done = self._run(["-m", "sftaudit.cli", *map(str, args)], timeout)
        assert "Traceback" not in done.stderr and "bug in sftaudit" not in done.stderr, done.stderr
        return done

    def python(self, code: str, timeout: int = AUDIT_BOUND_S) -> subprocess.CompletedProcess:
        """`code` in a fresh interpreter (an error raised ends it with a traceback, its last line the error)."""
        return self._run(["-c", code], timeout)

    def _run(self, args: list[str], timeout: int) -> subprocess.CompletedProcess:
        before = self.listing()
        atime = self.sentinel.stat().st_atime_ns
        done = subprocess.run(
            [sys.executable, *args],
            cwd=self.root,
            env={**os.environ, CACHE_ENV: str(self.cache)},
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        assert self.listing() == before, "a file outside the run, the cache and the reports was written"
        assert self.sentinel.stat().st_atime_ns == atime, "the sentinel outside the run was read"
        return done


@pytest.fixture
def box(tmp_path, monkeypatch) -> Box:
    made = Box(tmp_path)
    monkeypatch.setenv(CACHE_ENV, str(made.cache))  # `database_path` here names the subprocesses' cache
    return made


def _run(box: Box, name: str = "run", **options) -> Path:
    run = recorded_run(box.root, name, **options)
    box.runs.append(run)
    return run


def _audit(box: Box, run: Path, *args) -> subprocess.CompletedProcess:
    return box.cli("audit", run, "--out", box.reports / run.name, *args)


def _verdict(box: Box, run: Path) -> dict:
    return json.loads((box.reports / run.name / "verdict.json").read_text())


def _one_line(done: subprocess.CompletedProcess, *words: str) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), done.stderr
    return lines[0]


def _plant(box: Box, run: Path, source: Path, *sql: str) -> Path:
    """A genuine database (a copy of `source`, one sftaudit made) as RUN/sftaudit/audit.duckdb, with `sql` run
    in it: what someone who writes the run folder can leave there."""
    planted = run / ARTIFACT_DIR / DATABASE_FILE
    shutil.copy(source, planted)
    con = duckdb.connect(str(planted))
    for statement in sql:
        con.execute(statement.replace("SENTINEL", str(box.sentinel)))
    con.close()
    return planted


READS_SENTINEL = "(SELECT length(content) > 0 FROM read_text('SENTINEL'))"
REPLACED_BUILTINS = (
    f"CREATE MACRO isfinite(x) AS {READS_SENTINEL}",
    "CREATE MACRO isnan(x) AS false",
    "CREATE MACRO read_parquet(f, hive_partitioning := true, hive_types := NULL) AS TABLE "
    "SELECT 0 AS rank, 0 AS seg, 1::BIGINT AS step, 0 AS idx, 1.0::FLOAT AS norm",
)


def test_a_database_planted_in_the_run_is_never_opened(box):
    """Macros that replace isfinite (reading a file outside the run), isnan and read_parquet, in a copy of the
    run's own database left in the run folder: the NaN run still fails at step 13, nothing outside is read."""
    run = _run(box, nan_step=13)
    assert _audit(box, run, "--no-report").returncode == 1
    _plant(box, run, database_path(run), *REPLACED_BUILTINS)
    database_path(run).unlink()  # the next audit builds its own database again, the planted one beside it
    done = _audit(box, run, "--no-report")
    assert done.returncode == 1, done.stdout + done.stderr
    assert _verdict(box, run)["first_anomalous_step"] == 13


def test_macros_planted_in_the_cache_database_are_foreign_and_it_is_rebuilt(box):
    """The same macros in the cache's own database (someone wrote there): foreign, so the database is rebuilt
    before a query runs; the notebook API's queries see the real built-ins too."""
    run = _run(box, nan_step=13)
    assert _audit(box, run, "--no-report").returncode == 1
    con = duckdb.connect(str(database_path(run)))
    for statement in (*REPLACED_BUILTINS, f"CREATE VIEW planted AS SELECT * FROM read_text('{box.sentinel}')"):
        con.execute(statement)
    con.close()
    assert _audit(box, run, "--no-report").returncode == 1
    assert _verdict(box, run)["first_anomalous_step"] == 13
    con = duckdb.connect(str(database_path(run)), read_only=True)
    assert con.execute(
        "SELECT count(*) FROM duckdb_functions() WHERE function_type = 'macro' AND NOT internal"
    ).fetchone() == (0,)
    con.close()
    done = box.python(
        "import sftaudit\n"
        f"print(sftaudit.open({str(run)!r}).sql('SELECT count(*) AS n FROM grad_norms WHERE NOT isfinite(norm)')['n'][0])"
    )
    assert done.returncode == 0 and done.stdout.split() == [str(18 * 4)], done.stdout + done.stderr


def test_the_notebook_api_reads_no_file_outside_the_run(box):
    run = _run(box)
    done = box.python(
        f"import sftaudit\nsftaudit.open({str(run)!r}).sql(\"SELECT * FROM read_text('{box.sentinel}')\")"
    )
    assert done.returncode == 1 and "disabled by configuration" in done.stderr.splitlines()[-1], done.stderr


def test_a_planted_verdict_view_does_not_name_the_run(box):
    """A persisted `audit_verdict` view that reads a file outside the run: `sftaudit report` shows the verdict
    this sftaudit judged, under the run's own name."""
    run = _run(box, nan_step=13)
    assert box.cli("ingest", run).returncode == 0
    _plant(
        box,
        run,
        database_path(run),
        "DROP TABLE IF EXISTS audit_verdict",
        "CREATE VIEW audit_verdict AS SELECT json_object('run', content, 'verdict', 'pass') AS verdict "
        "FROM read_text('SENTINEL')",
    )
    done = box.cli("report", run, "--out", box.reports / "run")
    assert done.returncode == 0, done.stdout + done.stderr
    page = (box.reports / "run" / "report.html").read_text()
    assert SECRET not in page and "<title>sftaudit FAIL: recorded</title>" in page


def test_report_on_a_nan_run_holding_a_clean_runs_database_says_fail(box):
    clean, broken = _run(box, "clean"), _run(box, "broken", nan_step=13)
    assert _audit(box, clean, "--no-report").returncode == 0
    _plant(box, broken, database_path(clean))
    done = box.cli("report", broken, "--out", box.reports / "broken")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "<title>sftaudit FAIL: recorded</title>" in (box.reports / "broken" / "report.html").read_text()
    replayed = box.cli("replay", broken, "--json")
    assert replayed.returncode == 1 and json.loads(replayed.stdout)["first_anomalous_step"] == 13


def test_a_dangling_database_link_out_of_the_run_is_not_followed(box):
    run = _run(box)
    target = box.outside / "made-here.duckdb"
    os.symlink(target, run / ARTIFACT_DIR / DATABASE_FILE)
    assert _audit(box, run).returncode == 0
    assert not os.path.lexists(target) and os.listdir(box.outside) == ["secret.txt"]


@pytest.mark.parametrize("entry", ["artifacts", "rank"])
def test_an_artifact_folder_linked_out_of_the_run_is_refused_before_anything_is_written(box, entry):
    """A Trainer output whose sftaudit/ (or sftaudit/rank-0/) is a link to a folder outside: importing it would
    write there. The audit and `sftaudit.open` refuse it in one line, and the folder outside stays empty."""
    run = trainer_run(box.root)
    box.runs.append(run)
    elsewhere = box.outside / "elsewhere"
    elsewhere.mkdir()
    if entry == "artifacts":
        os.symlink(elsewhere, run / ARTIFACT_DIR)
    else:
        (run / ARTIFACT_DIR).mkdir()
        os.symlink(elsewhere, rank_dir(run, 0))
    _one_line(_audit(box, run), "outside the run folder")
    done = box.python(f"import sftaudit\nsftaudit.open({str(run)!r})")
    assert done.returncode == 1 and "outside the run folder" in done.stderr.splitlines()[-1], done.stderr
    assert not any(elsewhere.iterdir())


def test_a_run_folder_named_with_url_and_glob_characters_is_read_as_named(box):
    """`run #1 %41?`: DuckDB takes `?` in a database path for options and in a file path for a pattern (which
    would also match the sibling `run #1 %41X`, a NaN run). Audit, report, replay and the notebook API read the
    run as named, and only it."""
    run = _run(box, "run #1 %41?")
    _run(box, "run #1 %41X", nan_step=5)
    assert _audit(box, run).returncode == 0
    assert _verdict(box, run)["verdict"] == "pass"
    assert box.cli("report", run, "--out", box.reports / "again").returncode == 0
    replayed = box.cli("replay", run, "--json")
    assert replayed.returncode == 0 and json.loads(replayed.stdout)["verdict"] == "pass"
    done = box.python(
        f"import sftaudit\nprint(sftaudit.open({str(run)!r}).sql('SELECT max(norm) AS m FROM grad_norms')['m'][0])"
    )
    assert done.returncode == 0 and float(done.stdout) < 2, done.stdout + done.stderr


def test_a_cache_folder_duckdb_cannot_open_is_named_in_one_line(box):
    run = _run(box)
    box.cache = box.root / "cache?"  # DuckDB reads what follows a `?` in a database path as options
    _one_line(_audit(box, run, "--no-report"), CACHE_ENV)


@pytest.mark.slow  # writes 10,000 files
def test_ten_thousand_empty_parts_beside_the_real_ones_are_listed_once(box):
    run = _run(box, nan_step=13)
    folder = series_dir(run, 0, 0)
    empty = pa.table(
        {"step": pa.array([], pa.int64()), "idx": pa.array([], pa.int32()), "norm": pa.array([], pa.float32())}
    )
    pq.write_table(empty, folder / "part-100000000.parquet")
    for i in range(1, 10_000):
        shutil.copy(folder / "part-100000000.parquet", folder / f"part-{100000000 + i:09d}.parquet")
    for _ in range(2):  # the first audit validates them, the second reads them all back from the database
        done = _audit(box, run, "--no-report")
        assert done.returncode == 1 and _verdict(box, run)["first_anomalous_step"] == 13, done.stdout + done.stderr


def test_lone_surrogates_in_sample_ids_keep_their_records(box):
    """Twelve batch records whose sample ids hold a lone surrogate (`\\ud800`, no character: DuckDB's JSON
    reader refuses the whole line) are kept, the escape kept as text; a real pair and an escaped backslash
    stay what they are."""
    run = _run(box)
    batches = rank_dir(run, 0) / "batches.jsonl"
    lines = batches.read_text().splitlines()
    for i in range(12):
        lines[i] = lines[i].replace('"sample_ids":["', '"sample_ids":["lone \\ud800 \\uDC00 ', 1)
    lines[12] = lines[12].replace('"sample_ids":["', '"sample_ids":["pair \\ud83d\\ude00 ', 1)
    lines[13] = lines[13].replace('"sample_ids":["', '"sample_ids":["text \\\\ud800 ', 1)
    batches.write_text("\n".join(lines) + "\n")
    assert _audit(box, run, "--no-report").returncode == 0
    assert _verdict(box, run)["evidence"]["bad_lines"] == []
    done = box.python(
        "import json, sftaudit\n"
        f"rows = sftaudit.open({str(run)!r}).sql('SELECT step, sample_ids[1] AS id FROM batches ORDER BY step')\n"
        "print(json.dumps(rows['id'].to_list()[:14]))"
    )
    ids = json.loads(done.stdout)
    assert ids[:12] == [f"lone \\ud800 \\uDC00 s{s}-0" for s in range(1, 13)], ids
    assert ids[12] == "pair \U0001f600 s13-0" and ids[13] == "text \\ud800 s14-0", ids


def test_a_parquet_decompression_bomb_is_one_line(box):
    """A part of 68 million rows in 0.8 MB (its rows all alike): refused from its footer, never decoded."""
    run = _run(box)
    rows = 1 << 20
    table = pa.table(
        {
            "step": pa.array([31] * rows, pa.int64()),
            "idx": pa.array([0] * rows, pa.int32()),
            "norm": pa.array([1.0] * rows, pa.float32()),
        }
    )
    with pq.ParquetWriter(series_dir(run, 0, 0) / "part-000000031.parquet", table.schema, compression="zstd") as w:
        for _ in range(65):
            w.write_table(table, row_group_size=rows)
    _one_line(_audit(box, run, "--no-report"), "part-000000031.parquet", "decompression bomb")


@pytest.mark.parametrize("value", ["null", '"2"', "2.0", "true"])
def test_a_manifest_whose_schema_version_is_not_an_integer_is_one_line(box, value):
    run = _run(box)
    manifest = rank_dir(run, 0) / "manifest.jsonl"
    manifest.write_text(manifest.read_text().replace('"schema_version":2', f'"schema_version":{value}', 1))
    _one_line(_audit(box, run, "--no-report"), "manifest.jsonl, line 1: schema_version must be an integer")
