"""A recorded run and its own logs audited without the recording (a Trainer's trainer_state.json holding the
recorded loss, learning rate and gradient norm of every step) must agree on what the loss curve shows: the codes,
severities and steps of LOOP-19 to LOOP-25 and LOOP-27, at the logging resolution (every step)."""

import json

from sftaudit.store.ingest import connect
from sftaudit.verdict.audit import audit

from ..shared import cached_audit
from .logged_runs import audited

CURVE_CODES = {f"LOOP-{n}" for n in (19, 20, 21, 22, 23, 24, 25, 27)}


def logs_of(run_dir, out_dir):
    """The recording's steps as a Trainer logging every step writes them, beside the model's config.json."""
    con = connect(run_dir, read_only=True)
    try:
        rows = con.execute("SELECT step, loss, lr, grad_norm FROM steps WHERE rank = 0 ORDER BY step").fetchall()
        manifest = json.loads(con.execute("SELECT manifest FROM manifest WHERE rank = 0 ORDER BY seg").fetchone()[0])
    finally:
        con.close()
    last = rows[-1][0]
    history = [
        {"epoch": s / last, "grad_norm": g, "learning_rate": lr, "loss": loss, "step": s} for s, loss, lr, g in rows
    ]
    out_dir.mkdir()
    state = {"global_step": last, "max_steps": manifest["config"]["max_steps"], "logging_steps": 1}
    (out_dir / "trainer_state.json").write_text(json.dumps(state | {"num_train_epochs": 1, "log_history": history}))
    (out_dir / "config.json").write_text(json.dumps(manifest["model"]["config"]))
    return out_dir


def curve_findings(verdict):
    assert verdict["check_errors"] == []
    return sorted((f["code"], f["severity"], f["step"]) for f in verdict["findings"] if f["code"] in CURVE_CODES)


def test_a_run_at_learning_rate_0_3_recorded_and_read_from_its_logs_gets_the_same_findings(runs, tmp_path):
    run_dir = runs("lr_0.3", steps=40, lr=0.3, checkpoint_every=0, probe_every=0)
    recorded = curve_findings(audit(run_dir))
    assert ("LOOP-20", "fail", 3) in recorded  # above chance from step 3: the run it must agree on is no clean one
    assert curve_findings(audited(logs_of(run_dir, tmp_path / "logs"))) == recorded


def test_a_clean_recorded_run_and_its_logs_agree_on_nothing_to_report(clean_run, tmp_path):
    recorded = curve_findings(cached_audit(clean_run))
    assert [f for f in recorded if f[1] != "info"] == []
    assert curve_findings(audited(logs_of(clean_run, tmp_path / "logs"))) == recorded
