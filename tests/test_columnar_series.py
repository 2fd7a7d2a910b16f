"""The columnar gradient-norm series (schema version 2): written by the shim's writer, killed with
SIGKILL at random points, resumed, and read in place by ingest (parts + the journal tail)."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import numpy as np

from sftaudit.checks.gradient_columns import ABSENT, GradientColumns
from sftaudit.core.artifacts import SCHEMA_VERSION, journal_name, rank_dir, series_dir
from sftaudit.shim.writer import JsonlWriter
from sftaudit.store.ingest import ingest
from sftaudit.store.rundb import DATABASE_FORMAT, connect, database_path

TENSORS = 6

# The shim's writer in a training-like loop; the norms name their segment and step, so the audit can
# tell which process wrote what. Tensor 1 never has a gradient (no row); tensor 2 is NaN on odd steps.
CHILD = """
import os, sys, time
from pathlib import Path
from sftaudit.shim.writer import JsonlWriter
from sftaudit.core.artifacts import SCHEMA_VERSION
run, seg, step, last, progress = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
w = JsonlWriter(run / "sftaudit" / "rank-0", roll_steps=5)
params = [{"name": f"w{i}", "shape": [4], "dtype": "torch.float32", "numel": 4, "requires_grad": True}
          for i in range(%d)]
w.write("manifest", {"seg": seg, "schema_version": SCHEMA_VERSION, "rank": 0, "world_size": 1, "params": params,
                     "tied": {}})
out = os.open(progress, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
while not last or step <= last:
    norms = [seg * 1000 + step + i / 100 for i in range(%d)]
    norms[1] = None
    norms[2] = float("nan") if step %% 2 else norms[2]
    w.write("steps", {"seg": seg, "step": step, "loss": 1.0, "grad_norm": 1.0, "grad_norms": norms})
    os.write(out, b"%%d\\n" %% step)
    step += 1
    time.sleep(0.002)  # a few hundred steps before a kill, not thousands: the same kills, fewer parts to check
w.close()
""" % (TENSORS, TENSORS)


def _expected(seg: int, step: int) -> list[float]:
    return [
        np.nan if i == 2 and step % 2 else float(np.float32(seg * 1000 + step + i / 100))
        for i in range(TENSORS)
        if i != 1
    ]


def _segment(run: Path, seg: int, first: int, last: int = 0, kill_after: float | None = None) -> int:
    """Run one segment from `first`; kill it `kill_after` s after its first step. The last step it finished."""
    progress = run.parent / f"progress-{seg}"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(run), str(seg), str(first), str(last), str(progress)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    if kill_after is None:
        assert proc.wait(timeout=300) == 0, proc.stderr.read()
    else:
        deadline = time.time() + 300
        while not (progress.exists() and progress.read_bytes().count(b"\n")):
            assert proc.poll() is None, proc.stderr.read()
            assert time.time() < deadline, "the writer never wrote a step"
            time.sleep(0.01)
        time.sleep(kill_after)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    done = [int(x) for x in progress.read_bytes().split(b"\n")[:-1]]
    return done[-1]


def _timeline(run: Path):
    ingest(run)
    con = connect(run, read_only=True)
    try:
        steps = con.execute("SELECT seg, step FROM steps ORDER BY step").fetchall()
        grads = con.execute(
            "SELECT seg, step, list(norm ORDER BY idx), list(idx ORDER BY idx) FROM grad_pieces "
            "GROUP BY seg, step ORDER BY step"
        ).fetchall()
        _columns_equal_the_view(con, run)
        superseded = (
            con.execute("SELECT DISTINCT seg, step FROM superseded_grad_pieces").fetchall()
            if con.execute(
                "SELECT count(*) FROM information_schema.tables WHERE table_name = 'superseded_grad_pieces'"
            ).fetchone()[0]
            else []
        )
    finally:
        con.close()
    return steps, grads, set(superseded)


def _columns_equal_the_view(con, run: Path) -> None:
    """The checks' reader of the parts themselves (GradientColumns) holds grad_cells' rows: the resumed
    segments' cutoffs, the journal tails, a tensor never recorded and the NaN norms included."""
    columns = GradientColumns(con, run)
    view = np.full((len(columns.names), columns.steps.size), ABSENT, dtype=np.float32)
    cells = con.sql("SELECT step, idx, norm FROM grad_cells WHERE rank = 0").fetchnumpy()
    view[cells["idx"], np.searchsorted(columns.steps, cells["step"])] = cells["norm"]
    read = np.concatenate([block for _, block in columns.blocks(absent=ABSENT)])
    np.testing.assert_array_equal(read, view)
    assert (columns.nonfinite == np.isnan(view).any(axis=0)).all()


def test_sigkill_at_random_points_loses_at_most_the_step_in_flight(tmp_path):
    """Five kills at random moments (rolls every 5 steps, so some land mid-part), each followed by a
    resume from an earlier step, then a clean end: every step with a record has all its norms, from
    the segment that wrote it, and each kill lost at most the step it interrupted."""
    rng = random.Random(23)
    run = tmp_path / "run"
    first, abandoned = 1, set()
    for seg in range(6):
        kill = rng.uniform(0.0, 0.8) if seg < 5 else None
        done = _segment(run, seg, first, last=first + 9 if kill is None else 0, kill_after=kill)
        steps, grads, superseded = _timeline(run)
        mine = [s for g, s in steps if g == seg]
        assert mine == list(range(first, mine[-1] + 1)), "a gap in the segment's steps"
        assert done <= mine[-1] <= done + 1, (done, mine[-1])  # the step in flight, at most, is lost
        assert [s for _, s in steps] == list(range(1, mine[-1] + 1)), "the timeline is not one run"
        assert [(g, s) for g, s, _, _ in grads] == steps, "a step without its norms, or norms without a step"
        for g, s, norms, idx in grads:
            assert idx == [i for i in range(TENSORS) if i != 1]
            np.testing.assert_array_equal(norms, _expected(g, s))
        assert superseded == abandoned
        # The next segment resumes from an earlier "checkpoint": the steps after it are abandoned.
        first = max(1, mine[-1] - rng.randint(0, 6))
        abandoned |= {(g, s) for g, s in steps if s >= first}
    assert not list(series_dir(run, 0).rglob("journal-*")), "a clean close leaves no journal"
    assert not list(series_dir(run, 0).rglob(".part-*")), "a resume removes half-written parts"


def _writer_run(run: Path, steps: range, roll_steps: int = 4) -> JsonlWriter:
    w = JsonlWriter(rank_dir(run, 0), roll_steps=roll_steps)
    params = [
        {"name": f"w{i}", "shape": [4], "dtype": "torch.float32", "numel": 4, "requires_grad": True}
        for i in range(TENSORS)
    ]
    w.write(
        "manifest",
        {"seg": 0, "schema_version": SCHEMA_VERSION, "rank": 0, "world_size": 1, "params": params, "tied": {}},
    )
    for s in steps:
        w.write(
            "steps",
            {
                "seg": 0,
                "step": s,
                "loss": 1.0,
                "grad_norm": 1.0,
                "grad_norms": [float(s + i) for i in range(TENSORS)],
                "grad_norms_post_clip": [float(s + i) / 2 for i in range(TENSORS)],
            },
        )
    return w


def _rows(run: Path) -> list[tuple]:
    con = connect(run, read_only=True)
    try:
        return con.execute("SELECT step, idx, norm FROM grad_pieces ORDER BY step, idx").fetchall()
    finally:
        con.close()


def test_the_journal_tail_is_read_and_a_part_is_never_read_twice(tmp_path):
    run = tmp_path / "run"
    w = _writer_run(run, range(1, 11))  # parts at steps 1 and 5; steps 9-10 only in the journal
    w.sync()  # the part of steps 5-8 is written in a background thread: wait for it
    folder = series_dir(run, 0, 0)
    tail = (folder / journal_name(9)).read_bytes()
    assert sorted(p.name for p in folder.iterdir()) == [
        "journal-000000009.bin",
        "part-000000001.parquet",
        "part-000000005.parquet",
    ]
    ingest(run)
    want = [(s, i, float(s + i)) for s in range(1, 11) for i in range(TENSORS)]
    assert _rows(run) == want
    # The last step's record never made it to steps.jsonl (killed between the two writes): it is not read.
    lines = (rank_dir(run, 0) / "steps.jsonl").read_bytes().splitlines(keepends=True)
    (rank_dir(run, 0) / "steps.jsonl").write_bytes(b"".join(lines[:-1]))
    ingest(run)
    assert _rows(run) == want[:-TENSORS]
    (rank_dir(run, 0) / "steps.jsonl").write_bytes(b"".join(lines))
    w.close()  # the tail becomes a part; then a kill between its rename and the journal's delete
    (folder / journal_name(9)).write_bytes(tail)
    ingest(run)
    assert _rows(run) == want
    # The post-clip norms travel beside them, in the same part.
    got = duckdb.sql(
        f"SELECT step, idx, norm_post_clip FROM read_parquet('{folder}/*.parquet') ORDER BY ALL"
    ).fetchall()
    assert got == [(s, i, float(s + i) / 2) for s in range(1, 11) for i in range(TENSORS)]
    JsonlWriter(rank_dir(run, 0))  # a resumed shim deletes the journal a part already holds
    assert sorted(p.name for p in folder.iterdir()) == [
        "part-000000001.parquet",
        "part-000000005.parquet",
        "part-000000009.parquet",
    ]


def test_reingest_lists_only_new_parts_and_a_replaced_part_rebuilds(tmp_path):
    run = tmp_path / "run"
    w = _writer_run(run, range(1, 9))
    w.sync()
    ingest(run)
    con = connect(run, read_only=True)
    listed = con.execute("SELECT file FROM ingest_state WHERE file LIKE 'series/%' ORDER BY file").fetchall()
    con.close()
    assert listed == [
        ("series/grad_norms/rank=0/seg=0/part-000000001.parquet",),
        ("series/grad_norms/rank=0/seg=0/part-000000005.parquet",),
    ]
    for s in range(9, 13):
        w.write("steps", {"seg": 0, "step": s, "loss": 1.0, "grad_norms": [float(s + i) for i in range(TENSORS)]})
    ingest(run)
    assert len(_rows(run)) == 12 * TENSORS
    part = series_dir(run, 0, 0) / "part-000000005.parquet"
    data = part.read_bytes()
    part.unlink()
    part.write_bytes(data)  # the same bytes under another inode: not the file that was validated
    ingest(run)
    assert len(_rows(run)) == 12 * TENSORS


def test_an_older_database_is_rebuilt_and_a_version_1_run_still_reads(tmp_path):
    """Schema version 1 (the norms inside steps.jsonl) and a database made by an earlier sftaudit
    (gradient tables copied in, no format marker): the audit rebuilds it, nothing to delete by hand."""
    run = tmp_path / "run"
    folder = rank_dir(run, 0)
    folder.mkdir(parents=True)
    params = [
        {"name": f"w{i}", "shape": [4], "dtype": "torch.float32", "numel": 4, "requires_grad": True} for i in range(3)
    ]
    (folder / "manifest.jsonl").write_text(
        '{"seg": 0, "schema_version": 1, "rank": 0, "world_size": 1, "params": %s, "tied": {}}\n'
        % str(params).replace("'", '"').replace("True", "true")
    )
    (folder / "steps.jsonl").write_text(
        "".join('{"seg": 0, "step": %d, "loss": 1.0, "grad_norms": [%d, null, 0.5]}\n' % (s, s) for s in range(1, 6))
    )
    ingest(run)
    assert _rows(run) == [(s, i, v) for s in range(1, 6) for i, v in ((0, float(s)), (2, 0.5))]
    con = duckdb.connect(str(database_path(run)))
    con.execute("DROP TABLE sftaudit_meta")
    con.execute(
        "CREATE TABLE grad_pieces (rank INTEGER, seg INTEGER, step BIGINT, idx INTEGER, tensor VARCHAR, norm DOUBLE)"
    )
    con.close()
    ingest(run)
    assert _rows(run) == [(s, i, v) for s in range(1, 6) for i, v in ((0, float(s)), (2, 0.5))]
    con = connect(run, read_only=True)
    assert con.execute("SELECT value FROM sftaudit_meta WHERE key = 'database_format'").fetchone() == (
        str(DATABASE_FORMAT),
    )
    assert con.execute(
        "SELECT table_type FROM information_schema.tables WHERE table_name = 'grad_pieces'"
    ).fetchall() == [("VIEW",)]
    con.close()


def test_the_writer_keeps_the_norms_out_of_steps_jsonl(tmp_path):
    run = tmp_path / "run"
    _writer_run(run, range(1, 3)).close()
    text = (rank_dir(run, 0) / "steps.jsonl").read_text()
    assert "grad_norms" not in text and '"grad_norm":1.0' in text
