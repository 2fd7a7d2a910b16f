"""Checkpoints as real loops and libraries save them: identity by path, overwritten paths,
nested torch.save dicts, PEFT adapters, DDP-wrapped models. Each layout: a clean run audits
and gates as it should, a planted fault gates 1 (or 2 where it cannot be judged)."""

import json
import shutil

import pytest
from sftaudit.fixtures import layouts
from sftaudit.fixtures.faults.checkpoints import NAN_TENSOR

from sftaudit.cli import main
from sftaudit.readers.inspection import STATE_HEAD_BYTES, state_parts
from sftaudit.store.rundb import connect
from sftaudit.verdict.audit import audit

RUN = dict(steps=12, checkpoint_every=4, profile="prod")


def gate(run, checkpoint, *extra):
    return main(["gate", str(run), "--checkpoint", str(checkpoint), *map(str, extra)])


def loop09(verdict):
    return [f for f in verdict["findings"] if f["code"] == "LOOP-09"]


@pytest.fixture(scope="module")
def step_folders(runs):
    """checkpoints/step-N/model.safetensors, weights only; step 12's save holds a NaN."""
    return runs("step-folders", **RUN, saver=layouts.step_folder_weights(nan_at=12))


def test_same_file_name_in_step_folders_is_told_apart_by_path(step_folders, tmp_path, capsys):
    verdict = audit(step_folders)
    assert [(c["name"], c["path"]) for c in verdict["checkpoints"]] == [
        (f"step-{s}", f"checkpoints/step-{s}/model.safetensors") for s in (4, 8, 12)
    ]
    fails = [f for f in loop09(verdict) if f["severity"] == "fail"]
    assert [(f["checkpoint"], f["step"]) for f in fails] == [("step-12", 12)]
    # Weights only: a configuration stated once for the run (info), naming what no checkpoint holds.
    [stated] = [f for f in loop09(verdict) if f["severity"] != "fail"]
    assert (stated["severity"], stated["category"], stated["step"]) == ("info", "configuration", None)
    assert stated["evidence"]["applies_to"] == ["step-4", "step-8", "step-12"]
    assert {"optimizer", "rng_states", "data_position"} <= stated["evidence"]["missing_state"].keys()
    # The sound weights-only checkpoints pass the gate (by step, name or path); the NaN one fails.
    assert gate(step_folders, 8) == 0
    assert gate(step_folders, "step-4") == 0
    assert gate(step_folders, step_folders / "checkpoints/step-8/model.safetensors") == 0
    assert gate(step_folders, 12) == 1
    assert gate(step_folders, "step-4", "--strict") == 0  # a weights-only save is no warn
    policy = tmp_path / "resume.toml"
    policy.write_text("[gate]\nrequire_resume_state = true\n")
    assert gate(step_folders, "step-4", "--policy", policy) == 1  # unless the policy requires resumability
    capsys.readouterr()


@pytest.fixture(scope="module")
def one_path(runs):
    """nanoGPT style: torch.save({"model": ..., "optimizer": ..., ...}, "ckpt.pt") at every save."""
    return runs("one-path", **RUN, saver=layouts.one_path_nested())


def test_one_path_saved_at_every_step_is_one_checkpoint(one_path, capsys):
    verdict = audit(one_path)
    assert verdict["verdict"] == "pass"
    [c] = verdict["checkpoints"]
    assert (c["name"], c["step"], c["saves"], c["intact"]) == ("ckpt.pt", 12, [4, 8, 12], True)
    [info] = loop09(verdict)
    assert info["severity"] == "info" and "saved at steps 4, 8, 12" in info["message"]
    assert gate(one_path, "ckpt.pt") == 0 and gate(one_path, 12) == 0
    assert gate(one_path, 8) == 2
    assert "overwritten at step 12" in capsys.readouterr().err


def test_nested_torch_save_with_a_nan_fails(runs):
    run = runs("one-path-nan", **RUN, saver=layouts.one_path_nested(nan_at=12))
    [fail] = [f for f in loop09(audit(run)) if f["severity"] == "fail"]
    assert fail["checkpoint"] == "ckpt.pt" and "non-finite" in fail["message"]
    assert fail["evidence"]["tensors"][0]["tensor"] == NAN_TENSOR
    assert gate(run, "ckpt.pt") == 1


@pytest.fixture(scope="module")
def lora_run(runs):
    return runs("lora", **RUN, wrap=layouts.lora, saver=layouts.peft_adapters())


def test_peft_adapters_are_judged_against_their_config(lora_run):
    verdict = audit(lora_run)
    assert verdict["verdict"] == "pass", [f["message"] for f in verdict["findings"] if f["severity"] != "info"]
    assert loop09(verdict) == [] and all(c["intact"] for c in verdict["checkpoints"])
    assert gate(lora_run, "checkpoint-12") == 0


def test_empty_adapter_fails(runs):
    run = runs("lora-empty", **RUN, wrap=layouts.lora, saver=layouts.peft_adapters(empty_adapter_at=8))
    fails = [f for f in loop09(audit(run)) if f["severity"] == "fail"]
    assert [f["checkpoint"] for f in fails] == ["checkpoint-8"]
    assert "holds no tensors" in fails[0]["message"]
    assert gate(run, "checkpoint-8") == 1 and gate(run, "checkpoint-4") == 0


def test_untrained_lora_b_fails(runs):
    run = runs("lora-lr0", **RUN, lr=0.0, wrap=layouts.lora, saver=layouts.peft_adapters())
    fails = [f for f in loop09(audit(run)) if f["severity"] == "fail" and "lora_B" in f["message"]]
    assert [f["checkpoint"] for f in fails] == ["checkpoint-4", "checkpoint-8", "checkpoint-12"]
    assert fails[0]["evidence"]["tensor_count"] == 4  # q_proj and v_proj in both layers
    assert gate(run, "checkpoint-4") == 1


def test_config_ties_embeddings_the_saved_tensors_do_not(runs):
    run = runs("tied-config", steps=4, checkpoint_every=4, profile="prod", saver=layouts.tied_config_untied_tensors())
    [fail] = [f for f in loop09(audit(run)) if f["severity"] == "fail"]
    assert (
        fail["checkpoint"] == "checkpoint-4"
        and "the config ties lm_head.weight to model.embed_tokens.weight" in fail["message"]
    )
    assert gate(run, "checkpoint-4") == 1


def test_deepspeed_engine_folders_are_read_statically(runs):
    run = runs("deepspeed", **RUN, saver=layouts.deepspeed_engine_folders())
    verdict = audit(run)
    assert verdict["verdict"] == "pass", [f["message"] for f in verdict["findings"] if f["severity"] != "info"]
    assert loop09(verdict) == [] and gate(run, "checkpoint-12") == 0
    assert not (run / "ZERO_TO_FP32_RAN").exists()


def test_sharded_save_pretrained_is_read_shard_by_shard(runs, tmp_path, capsys):
    run = runs("sharded", steps=4, checkpoint_every=4, profile="prod", saver=layouts.sharded_save_pretrained())
    shards = sorted(p.name for p in (run / "checkpoint-4").glob("model-*.safetensors"))
    assert len(shards) > 1 and (run / "checkpoint-4" / "model.safetensors.index.json").is_file()
    verdict = audit(run)
    assert loop09(verdict) == [] and gate(run, 4) == 0
    # A shard lost after the save: the checkpoint cannot be loaded.
    (run / "checkpoint-4" / shards[-1]).unlink()
    messages = sorted(f["message"] for f in loop09(audit(run)) if f["severity"] == "fail")
    assert [f"shard {shards[-1]} is missing" in m for m in messages] == [False, True]  # also: a file vanished
    assert "changed or vanished" in messages[0]
    capsys.readouterr()


def test_reaudit_reads_only_changed_checkpoints(clean_run, tmp_path):
    run = tmp_path / "clean"
    shutil.copytree(clean_run, run)
    first = audit(run)
    con = connect(run, read_only=True)
    try:
        cached = con.execute("SELECT count(*) FROM checkpoint_inspections").fetchone()[0]
    finally:
        con.close()
    assert cached == len(first["checkpoints"]) == 3
    assert audit(run)["findings"] == first["findings"]  # from the cache, the same findings
    weights = run / "checkpoint-20" / "model.safetensors"
    weights.write_bytes(weights.read_bytes() + b"\0" * 8)  # changed after the shim hashed it
    [changed] = loop09(audit(run))
    assert changed["checkpoint"] == "checkpoint-20" and "changed or vanished" in changed["message"]


def test_a_trainer_states_step_is_read_from_its_head_unless_the_save_was_cut_short(tmp_path):
    """A long run's state (its log past the head read) gives its global_step from the fields before the log, as
    the Trainer sorts them; keys in another order are read whole; a save cut short gives none."""
    history = [{"loss": 1.0, "step": s} for s in range(1, 5001)]
    sorted_keys = json.dumps({"global_step": 5000, "log_history": history}, indent=2, sort_keys=True)
    log_first = json.dumps({"log_history": history, "global_step": 5000}, indent=2)
    assert len(sorted_keys) > STATE_HEAD_BYTES
    for name, text in [("sorted", sorted_keys), ("log-first", log_first), ("cut", sorted_keys[:-100])]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer_state.json").write_text(text)
    for name in ("sorted", "log-first"):
        assert {"step", "data_position"} <= set(state_parts(tmp_path / name, {})[0])
    assert not {"step", "data_position"} & set(state_parts(tmp_path / "cut", {})[0])


def test_a_trainer_states_duplicate_step_is_the_last_as_the_json_module_reads_it(tmp_path):
    """Of duplicate ``global_step`` keys the json module (the import) keeps the last: so does the head read, whether
    the duplicate is in the head or after the log (then the file is read whole)."""
    log = json.dumps([{"loss": 1.0, "step": s} for s in range(1, 5001)], indent=2)
    texts = {
        "null-last-in-head": '{"global_step": 5000, "global_step": null, "log_history": %s}' % log,
        "step-last-in-head": '{"global_step": null, "global_step": 5000, "log_history": %s}' % log,
        "null-after-log": '{"global_step": 5000, "log_history": %s, "global_step": null}' % log,
        "escaped-after-log": '{"global_step": 5000, "log_history": %s, "global\\u005fstep": null}' % log,
    }
    for name, text in texts.items():
        assert len(text) > STATE_HEAD_BYTES
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer_state.json").write_text(text)
        has_step = json.loads(text)["global_step"] is not None
        assert ("data_position" in state_parts(tmp_path / name, {})[0]) is has_step, name
