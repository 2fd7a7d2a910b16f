"""LOOP-02: split markers, pad == eos with masked pads, a tokenizer swapped mid-run; clean is silent."""

import numpy as np
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
    # checkpoint-3's tokenizer had tokenized with truncation (as TRL does): the same tokenizer, not a change.
    assert saved["evidence"]["checkpoints"] == ["checkpoint-6"] and saved["step"] == 6
    assert at_step["checkpoint"] == "checkpoint-6"  # the window after checkpoint-3, which predates the swap
    # The plain loop saved no tokenizer with its checkpoints: what changed is read off the batch records.
    assert [c["part"] for c in saved["evidence"]["changes"]] == ["vocabulary", "chat_template"]
    assert "from step 5 were made with" in saved["message"] and "from step 4 were rendered" in saved["message"]


def test_fingerprint_is_what_the_tokenizer_is_not_its_truncation_or_padding_state():
    from sftaudit.fixtures import build_tokenizer

    from sftaudit.core.tokenizer import describe_tokenizer, tokenizer_changes, tokenizer_fingerprint

    tokenizer = build_tokenizer()
    start, described = tokenizer_fingerprint(tokenizer), describe_tokenizer(tokenizer)
    tokenizer("a long text " * 100, truncation=True, max_length=16)  # the backend keeps truncation max_length 16
    assert tokenizer.backend_tokenizer.truncation is not None and tokenizer_fingerprint(tokenizer) == start
    tokenizer(["a", "a b c"], padding="max_length", max_length=8)  # ... and padding to 8 after this one
    assert tokenizer.backend_tokenizer.padding is not None and tokenizer_fingerprint(tokenizer) == start
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool_call|>"]})
    assert tokenizer_fingerprint(tokenizer) != start
    changes = tokenizer_changes(described, describe_tokenizer(tokenizer))
    assert [(c["part"], c.get("role"), c["change"]) for c in changes] == [
        ("special_tokens", "pad", "changed"),
        ("added_tokens", None, "added"),
    ]
    assert changes[0]["before"] == "<|pad|>" and changes[0]["after"] == "<|eot_id|>"


def _old_fingerprint(tokenizer) -> str:
    """The fingerprint the shim recorded before it left out the runtime state: the whole backend JSON
    (its truncation and padding blocks included), the special tokens and the template."""
    import hashlib
    import json

    h = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode())
    specials = {
        r: {"token": getattr(tokenizer, f"{r}_token"), "id": getattr(tokenizer, f"{r}_token_id")}
        for r in ("bos", "eos", "pad", "unk")
    }
    h.update(json.dumps(specials, sort_keys=True).encode())
    h.update((tokenizer.chat_template or "").encode())
    return h.hexdigest()[:16]


def test_old_recordings_are_judged_on_the_tokenizers_saved_with_their_checkpoints(runs, tmp_path):
    """A run recorded with the old fingerprint, whose checkpoints hold the tokenizer as the Trainer saves it:
    checkpoint-2's was saved after a truncated tokenize (the same tokenizer: silent), checkpoint-4's with its
    pad token changed (a fail naming the pad token)."""
    import json
    import shutil

    from sftaudit.core.artifacts import TOKENIZER_DIR, artifact_root
    from sftaudit.core.tokenizer import load_saved_tokenizer
    from sftaudit.verdict.audit import audit

    run_dir = tmp_path / "old"
    shutil.copytree(
        runs("tokenizer_saved", steps=4, checkpoint_every=2, probe_every=0, generate_every=0, eval_every=0), run_dir
    )
    root = artifact_root(run_dir)
    tokenizer = load_saved_tokenizer(root / TOKENIZER_DIR)
    started = _old_fingerprint(tokenizer)
    tokenizer("a long text " * 100, truncation=True, max_length=16)
    tokenizer.save_pretrained(str(run_dir / "checkpoint-2"))
    truncated = _old_fingerprint(tokenizer)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(str(run_dir / "checkpoint-4"))
    recorded = {2: truncated, 4: _old_fingerprint(tokenizer)}
    assert started != truncated
    for name, edit in (
        ("manifest.jsonl", lambda r: r | {"tokenizer": r["tokenizer"] | {"fingerprint": started}}),
        (
            "checkpoints.jsonl",
            lambda r: r | {"tokenizer_fingerprint": recorded[r["step"]]} if r.get("event") == "saved" else r,
        ),
    ):
        path = root / "rank-0" / name
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        path.write_text("".join(json.dumps(edit(r)) + "\n" for r in lines))
    verdict = audit(run_dir)
    (f,) = [f for f in findings(verdict, "LOOP-02") if f["evidence"].get("kind") == "tokenizer_changed"]
    assert (f["severity"], f["step"], f["evidence"]["checkpoints"]) == ("fail", 4, ["checkpoint-4"])
    assert "pad token changed: '<|pad|>' (id 2047) -> '<|eot_id|>' (id 2046)" in f["message"]


def test_pad_token_added_at_save_is_named_as_such(tmp_path):
    """A Trainer output whose last save (the output folder) added a pad token the checkpoints' tokenizer lacks:
    the run trained with one tokenizer; the one shipped differs in its special tokens only."""
    from sftaudit.fixtures import build_tokenizer

    from .logged_runs import audited, trainer_run

    run_dir = trainer_run(tmp_path / "run", loss=np.linspace(3.0, 2.0, 20))
    checkpoint = run_dir / "checkpoint-20"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text((run_dir / "trainer_state.json").read_text())
    tokenizer = build_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(str(checkpoint))
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(str(run_dir))
    (f,) = findings(audited(run_dir), "LOOP-02")
    assert (f["severity"], f["category"], f["step"]) == ("warn", "risk", None)
    assert f["message"].startswith("pad token added at save")
    assert f["evidence"]["changes"][0] | {"text": None} == {
        "part": "special_tokens",
        "role": "pad",
        "change": "added",
        "before": None,
        "after": "<|eot_id|>",
        "text": None,
    }


def test_clean_run_raises_nothing(clean_run):
    from ..shared import cached_audit

    assert [f for f in clean_data_findings(cached_audit(clean_run)) if f["code"] == "LOOP-02"] == []
