"""LOOP-02: split markers, pad == eos with masked pads, a tokenizer swapped mid-run; clean is silent."""

from sftaudit.fixtures.faults.data import SPLIT_MARKER

from .data_runs import audited, batch_ids, clean_data_findings, findings


def test_marker_that_splits_is_named_with_its_pieces(runs):
    _, verdict = audited(runs, "data_tokens")
    f = next(f for f in findings(verdict, "LOOP-02") if "split_markers" in f["evidence"])
    assert f["severity"] == "fail"
    split = {m["marker"]: m for m in f["evidence"]["split_markers"]}
    assert set(split) == {SPLIT_MARKER}
    assert len(split[SPLIT_MARKER]["pieces"]) > 1 and "".join(split[SPLIT_MARKER]["pieces"]) == SPLIT_MARKER


def test_pad_equal_to_eos_with_pads_masked_fails(runs):
    run_dir, verdict = audited(runs, "data_tokens")
    f = next(f for f in findings(verdict, "LOOP-02") if "eos_trained" in f["evidence"])
    assert (f["severity"], f["step"]) == ("fail", 1)
    assert f["evidence"]["pad_id"] == f["evidence"]["eos_id"] and f["evidence"]["eos_trained"] == 0
    assert f["evidence"]["sample_ids"][0] in batch_ids(run_dir, 1)


def test_generation_eos_other_than_the_turn_end_warns(runs):
    from sftaudit.core.artifacts import TOKENIZER_DIR, artifact_root
    from sftaudit.core.tokenizer import load_tokenizer

    run_dir, verdict = audited(runs, "data_tokens")
    (f,) = [f for f in findings(verdict, "LOOP-02") if f["evidence"].get("kind") == "eos_differs_from_turn_end"]
    tokenizer = load_tokenizer(artifact_root(run_dir) / TOKENIZER_DIR)
    assert f["severity"] == "warn" and f["evidence"]["turn_end"] == "<|eot_id|>"
    assert f["evidence"]["generation_eos"] == [tokenizer.bos_token_id]


def test_frozen_untrained_marker_rows_fail(runs):
    _, verdict = audited(runs, "data_tokens")
    (f,) = [f for f in findings(verdict, "LOOP-02") if f["evidence"].get("kind") == "untrained_markers"]
    assert f["severity"] == "fail" and f["evidence"]["frozen"]
    assert [m["token"] for m in f["evidence"]["markers"]] == ["<|eot_id|>"]
    assert f["evidence"]["markers"][0]["embed_norm"] == 0 and f["evidence"]["embed_median"] > 0


def test_tokenizer_swapped_mid_run_fails_at_the_step_and_the_checkpoint(runs):
    run_dir, verdict = audited(runs, "data_template")
    at_step = next(f for f in findings(verdict, "LOOP-02") if "tokenizer_length_now" in f["evidence"])
    assert (at_step["severity"], at_step["step"]) == ("fail", 5)
    assert at_step["evidence"]["tokenizer_length_now"] == at_step["evidence"]["tokenizer_length_start"] + 2
    assert at_step["evidence"]["sample_ids"] == batch_ids(run_dir, 5)
    saved = next(f for f in findings(verdict, "LOOP-02") if "fingerprint_now" in f["evidence"])
    assert saved["evidence"]["checkpoints"] == ["checkpoint-6"] and saved["step"] == 6
    assert at_step["checkpoint"] == "checkpoint-6"  # the window after checkpoint-3, which predates the swap


def test_clean_run_raises_nothing(clean_run):
    from ..shared import cached_audit

    assert [f for f in clean_data_findings(cached_audit(clean_run)) if f["code"] == "LOOP-02"] == []
