"""A run killed with SIGKILL mid-training loses at most the step in flight; the rest audits."""

import os
import signal
import subprocess
import sys
import time

import pytest

from sftaudit.core.artifacts import rank_dir
from sftaudit.store.rundb import connect
from sftaudit.verdict.audit import audit

pytestmark = pytest.mark.slow  # trains in a subprocess until it kills it

TRAIN = """
import sys
from sftaudit.fixtures.train import train_plain
train_plain(sys.argv[1], steps=10_000, checkpoint_every=7, tokenizer_cache=sys.argv[2], grad_hist_every=3)
"""


def test_sigkill_mid_run_leaves_an_auditable_run(tmp_path, tokenizer_cache):
    run = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAIN, str(run), str(tokenizer_cache)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    steps = rank_dir(run, 0) / "steps.jsonl"
    # Progress, not the clock, ends the wait: a loaded machine only makes it longer. The bound is
    # there only so a wedged trainer cannot hang the suite.
    deadline = time.time() + 900
    try:
        while not (steps.exists() and steps.read_bytes().count(b"\n") >= 16):
            assert proc.poll() is None, f"training exited ({proc.returncode}) before 16 steps"
            assert time.time() < deadline, "training never reached 16 steps"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    verdict = audit(run)
    assert verdict["verdict"] != "fail", verdict["findings"]
    con = connect(run, read_only=True)
    recorded = [s for (s,) in con.execute("SELECT step FROM steps ORDER BY step").fetchall()]
    assert recorded == list(range(1, len(recorded) + 1)) and len(recorded) >= 16
    # Everything recorded before the kill is there: batches for every recorded step, checkpoints saved.
    batch_steps = {s for (s,) in con.execute("SELECT DISTINCT step FROM batches").fetchall()}
    assert set(recorded) <= batch_steps
    assert len(batch_steps - set(recorded)) <= 1  # at most the step in flight
    saved = [s for (s,) in con.execute("SELECT step FROM checkpoints WHERE event='saved' ORDER BY step").fetchall()]
    assert saved[:2] == [7, 14]
    assert [c["name"] for c in verdict["checkpoints"]][:2] == ["checkpoint-7", "checkpoint-14"]
