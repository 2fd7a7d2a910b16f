"""LOOP-16: three samples packed per row with positions running on under plain causal attention (Z16)
fail at the first packed step; unpacked rows (one BOS each) raise nothing."""

from sftaudit.audit import audit
from sftaudit.ingest import connect

from .dynamics_runs import PACKED_STEP, of, run


def test_packed_rows_without_boundaries_fail_at_the_first_packed_step(runs):
    run_dir = run(runs, "packed")
    [finding] = of(audit(run_dir), "LOOP-16")
    assert (finding["severity"], finding["step"]) == ("fail", PACKED_STEP)
    evidence = finding["evidence"]
    assert evidence["rows_affected"] == 2 * (4 - PACKED_STEP + 1) and evidence["steps_affected"] == 4 - PACKED_STEP + 1
    first = evidence["rows"][0]
    assert first["samples"] == 3 and first["sample_id"].count("+") == 2 and not first["resets"]
    assert evidence["attn_implementation"] in ("sdpa", "eager")
    # Before the fault every row held one sample.
    con = connect(run_dir, read_only=True)
    starts = con.execute("SELECT flatten(list(bos_starts)) FROM batches WHERE step < ?", [PACKED_STEP]).fetchall()[0][0]
    assert set(starts) == {1}


def test_clean_runs_raise_nothing(clean_run, nan_run):
    for run_dir in (clean_run, nan_run):
        assert of(audit(run_dir), "LOOP-16") == []
