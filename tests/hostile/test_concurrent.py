"""Several sftaudit processes on one run: the later ones wait for the run's lock, none fails on DuckDB's."""

import json
import shutil
import subprocess
import sys
import time

import pytest

from sftaudit.errors import InputError
from sftaudit.store.rundb import database_dir, run_lock


def start(*args):
    return subprocess.Popen(
        [sys.executable, "-m", "sftaudit.cli", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_concurrent_audits_gate_and_replay_of_one_run_all_finish(nan_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(nan_run, run, ignore=shutil.ignore_patterns("audit.duckdb*"))
    procs = [start("audit", run, "--no-report", "--out", tmp_path / f"out{i}") for i in range(2)]
    procs += [start("gate", run, "--checkpoint", "checkpoint-20"), start("replay", run, "--json"), start("ingest", run)]
    results = [(p.wait(timeout=600), *p.communicate()) for p in procs]
    for _code, _out, err in results:
        assert "lock" not in err.lower() or "waiting for another sftaudit" in err, err
        assert "Traceback" not in err and "error" not in err, err
    assert [code for code, _, _ in results] == [1, 1, 1, 1, 0]
    verdicts = [json.loads((tmp_path / f"out{i}" / "verdict.json").read_text()) for i in range(2)]
    assert verdicts[0]["findings"] == verdicts[1]["findings"] and verdicts[0]["first_anomalous_step"] == 13
    assert json.loads(results[3][1])["first_anomalous_step"] == 13


def test_a_lock_held_too_long_is_one_clear_line(clean_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(clean_run, run, ignore=shutil.ignore_patterns("audit.duckdb*", "checkpoint-*"))
    database_dir(run).mkdir(parents=True)  # the run's folder in sftaudit's cache: the lock is taken on it
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); "
                "print('held', flush=True); time.sleep(60)"
            ),
            str(database_dir(run)),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        start_time = time.monotonic()
        with pytest.raises(InputError, match="another sftaudit has used this run's database for over 1 s"):
            with run_lock(run, timeout=1.0):
                pass
        assert (
            time.monotonic() - start_time < 30
        )  # gave up, never waited out the holder's 60 s (load only adds seconds)
    finally:
        holder.kill()
        holder.wait()
    with run_lock(run, timeout=5.0):  # released with its holder
        with run_lock(run):  # and re-entrant within a process
            pass
    assert not any(p.name.endswith(".lock") for p in run.rglob("*"))  # nothing written into the run folder
