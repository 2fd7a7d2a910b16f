"""Resuming from the rollback checkpoint replaces the abandoned stretch: the audit judges the new timeline."""

import shutil

from sftaudit.fixtures.train import train_plain

from sftaudit.store.rundb import connect
from sftaudit.verdict.audit import audit

from .conftest import NAN_STEP


def test_resuming_a_failed_run_from_its_rollback_checkpoint_clears_the_verdict(nan_run, tmp_path, tokenizer_cache):
    run = tmp_path / "nan"
    shutil.copytree(nan_run, run, ignore=shutil.ignore_patterns("audit.duckdb*"))
    before = audit(run)
    assert before["verdict"] == "fail" and before["rollback_checkpoint"] == "checkpoint-10"

    # What `sftaudit replay` advises: resume from the rollback checkpoint, without the bad step.
    train_plain(run, steps=20, resume_from=run / before["rollback_checkpoint"], tokenizer_cache=tokenizer_cache)
    after = audit(run)
    assert not [f for f in after["findings"] if f["severity"] == "fail"], after["findings"]
    assert after["first_anomalous_step"] is None

    con = connect(run, read_only=True)
    live = con.execute("SELECT seg, min(step), max(step), count(*) FROM steps GROUP BY seg ORDER BY seg").fetchall()
    assert live == [(0, 1, 10, 10), (1, 11, 20, 10)]
    abandoned = con.execute("SELECT min(step), max(step) FROM superseded_steps").fetchall()
    assert abandoned == [(11, 20)]  # the NaN at step 13 is history, kept but not judged
    nan_steps = con.execute(
        "SELECT count(*) FROM superseded_grad_norms WHERE step = ? AND NOT isfinite(norm)", [NAN_STEP]
    ).fetchall()[0][0]
    assert nan_steps > 0
    saved = con.execute("SELECT step, seg FROM checkpoints WHERE event = 'saved' ORDER BY step").fetchall()
    assert saved == [(10, 0), (20, 1)]  # the poisoned checkpoint-20 of the first segment was replaced
