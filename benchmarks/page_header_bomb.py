"""What a Parquet part whose page header lies about its size costs the readers of a run folder, and what walking
the page headers costs the ingest of an honest part.

Records a live run of 20,000 steps x 16 tensors (`sftaudit.fixtures.live_run`: the shim's own writer, a part every
10,000 steps) and crafts copies of its first part (tests/page_bombs.py: the first page of `norm` rewritten at its
own length, the footer untouched): `lie` claims 2^31-1 bytes uncompressed over the honest zstd payload; `bomb-N`
claims N MiB and its payload is a zstd frame of that many zero bytes. Each is read, in a fresh subprocess whose
peak RSS and CPU seconds os.wait4 reports, by `pq.read_table`, by DuckDB's `read_parquet` (the sum of `norm`), and
by `sftaudit audit` of the run folder holding it. First `_part` (the ingest's validation of a new part) is timed on
the honest part with and without the page-header walk, interleaved with the walk alone, and so is the ingest of a
poll that finds a new part (with the 10,000 steps it holds).

    .venv/bin/python benchmarks/page_header_bomb.py [--bombs 256 1024] [--reps 200] [--poll-reps 10]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sftaudit.fixtures.live_run import write_live_run  # noqa: E402

from sftaudit.core.artifacts import series_dir  # noqa: E402
from sftaudit.readers.parquet_pages import page_header_fault  # noqa: E402
from sftaudit.store import ingest  # noqa: E402
from sftaudit.store.rundb import CACHE_ENV  # noqa: E402
from tests.page_bombs import lie_in_page_header, peak_rss  # noqa: E402

READERS = {
    "pq.read_table": "import pyarrow.parquet as pq, sys\npq.read_table(sys.argv[1])",
    "duckdb read_parquet": "import duckdb, sys\n"
    "duckdb.sql('SELECT count(*), sum(norm) FROM read_parquet($f)', params={'f': sys.argv[1]}).fetchall()",
}


def time_part(part: Path, run: Path, reps: int) -> None:
    """CPU seconds of `_part` on `part` with the page-header walk, without it (as before the walk: the walk
    swapped for one that finds nothing) and of the walk alone, alternated."""
    files = ingest._RunFiles(run, 1 << 20, 1 << 40)
    meta, size = pq.read_metadata(part), part.stat().st_size
    fd = os.open(part, os.O_RDONLY)
    arms: dict[str, list[float]] = {"_part with the walk": [], "_part without it": [], "the walk alone": []}
    for _ in range(reps):
        for arm, times in arms.items():
            t0 = time.process_time()
            if arm == "the walk alone":
                assert page_header_fault(lambda offset, n: os.pread(fd, n, offset), meta, size) is None
            else:
                ingest.page_header_fault = page_header_fault if arm == "_part with the walk" else _no_fault
                ingest._part(files, part, "key")
            times.append(time.process_time() - t0)
    ingest.page_header_fault = page_header_fault
    os.close(fd)
    print(f"a {meta.num_rows:,}-row part ({size:,} bytes), {reps} repetitions, CPU ms (median, quartiles):")
    for arm, times in arms.items():
        q = np.percentile(times, [25, 50, 75]) * 1e3
        print(f"  {arm:<20} {q[1]:.3f} ({q[0]:.3f}-{q[2]:.3f})")


def time_poll(tmp: Path, reps: int) -> None:
    """CPU seconds of the ingest that finds a new part: a run of 10,000 steps ingested, then 10,000 more steps
    written (their records and the part that holds them), then ingested with and without the walk, alternated,
    the database put back between ingests (the run's files are appended to in place: the database still
    describes them, so each ingest reads only what is new)."""
    os.environ[CACHE_ENV] = str(tmp / "poll-cache")
    run, saved = tmp / "poll", tmp / "poll-saved"
    write_live_run(run, steps=10_000, close=False)
    ingest.ingest(run)
    shutil.copytree(tmp / "poll-cache", saved)
    write_live_run(run, steps=10_000, first_step=10_001, header=False)
    arms: dict[str, list[float]] = {"with the walk": [], "without it": []}
    for _ in range(reps):
        for arm, times in arms.items():
            ingest.page_header_fault = page_header_fault if arm == "with the walk" else _no_fault
            t0 = time.process_time()
            added = ingest.ingest(run)
            times.append(time.process_time() - t0)
            shutil.rmtree(tmp / "poll-cache")
            shutil.copytree(saved, tmp / "poll-cache")
    ingest.page_header_fault = page_header_fault
    print(f"the ingest that finds a new part and {added['steps']:,} new steps, {reps} repetitions, CPU ms:")
    for arm, times in arms.items():
        q = np.percentile(times, [25, 50, 75]) * 1e3
        print(f"  {arm:<20} {q[1]:.1f} ({q[0]:.1f}-{q[2]:.1f})")


def _no_fault(*_) -> None:
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bombs", type=int, nargs="*", default=[256, 1024], help="MiB a bomb page claims")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--poll-reps", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, CACHE_ENV: str(Path(tmp) / "cache"), "PYTHONPATH": str(ROOT)}
        clean = Path(tmp) / "clean"
        write_live_run(clean, steps=20_000)
        honest = series_dir(clean, 0, 0) / "part-000000001.parquet"
        time_part(honest, clean, args.reps)
        time_poll(Path(tmp), args.poll_reps)
        variants = {"honest": None, "lie 2^31-1": (2**31 - 1, False)}
        variants |= {f"bomb {mib} MiB": (mib << 20, True) for mib in args.bombs}
        print(f"{'part':<14} {'reader':<20} {'exit':>4} {'peak RSS MB':>11} {'CPU s':>6}  last line of stderr")
        for name, craft in variants.items():
            run = Path(tmp) / name.replace(" ", "-")
            shutil.copytree(clean, run)
            part = series_dir(run, 0, 0) / honest.name
            if craft:
                lie_in_page_header(part, craft[0], bomb=craft[1])
            commands = {reader: [sys.executable, "-c", code, str(part)] for reader, code in READERS.items()}
            commands["sftaudit audit"] = [sys.executable, "-m", "sftaudit.cli", "audit", str(run), "--no-report"]
            for reader, command in commands.items():
                code, rss, cpu, said = peak_rss(command, env)
                said = (said.splitlines() or [""])[-1]
                print(f"{name:<14} {reader:<20} {code:>4} {rss:>11.0f} {cpu:>6.2f}  {said.replace(tmp, 'TMP')[:120]}")


if __name__ == "__main__":
    main()
