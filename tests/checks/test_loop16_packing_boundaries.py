"""LOOP-16: three samples packed per row with positions running on under plain causal attention (Z16)
fail at the first packed step; unpacked rows (one BOS each) raise nothing."""

from sftaudit.audit import audit
from sftaudit.ingest import connect

from .dynamics_runs import PACKED_STEP, of, recorded_loop, run


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


def flattened(data, **options):
    """Each micro-batch's rows packed into one row by transformers' DataCollatorWithFlattening (padding-free)."""
    from transformers import DataCollatorWithFlattening

    keep = data["attention_mask"].bool()
    features = [{"input_ids": ids[m].tolist(), "labels": labels[m].tolist()}
                for ids, labels, m in zip(data["input_ids"], data["labels"], keep)]
    return DataCollatorWithFlattening(**options)(features)


def test_packing_with_per_sample_boundaries_raises_nothing_and_without_them_fails(tmp_path, tokenizer_cache):
    # The collator's cu_seq_lens (flash-attention varlen) and per-sample position_ids: samples are kept apart.
    varlen = recorded_loop(tmp_path / "varlen", tokenizer_cache,
                           batch=lambda data: flattened(data, return_flash_attn_kwargs=True))
    assert of(audit(varlen), "LOOP-16") == []
    rows = connect(varlen, read_only=True).execute("SELECT bos_starts, position_resets, varlen FROM batches").fetchall()
    assert all(starts == [4] and resets == [3] and given for starts, resets, given in rows)
    # The same packed rows with neither: positions run on and attention crosses the samples.
    crossing = recorded_loop(tmp_path / "crossing", tokenizer_cache,
                             batch=lambda data: {k: v for k, v in flattened(data).items() if k != "position_ids"})
    [finding] = of(audit(crossing), "LOOP-16")
    assert (finding["severity"], finding["step"]) == ("fail", 1) and finding["evidence"]["rows"][0]["samples"] == 4
