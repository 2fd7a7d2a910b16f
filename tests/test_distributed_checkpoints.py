"""Distributed runs on CPU (gloo): a 2-rank torchrun saving with torch.distributed.checkpoint and a
DistributedDataParallel-wrapped model."""

import json

import pytest
import torch
from sftaudit.fixtures import layouts
from sftaudit.fixtures.distributed import process_group

from sftaudit.cli import main
from sftaudit.core.artifacts import rank_dir
from sftaudit.store.rundb import connect, load_manifest
from sftaudit.verdict.audit import audit

pytestmark = pytest.mark.slow  # torchrun launches


def gate(run, checkpoint):
    return main(["gate", str(run), "--checkpoint", str(checkpoint)])


def test_dcp_checkpoints_of_a_two_rank_run(distributed_runs, capsys):
    """2 ranks, DDP, dcp.save every 3 steps; step 6 saves the wrapper's state dict (module.* keys)."""
    dcp_run = distributed_runs / "dcp"
    assert sorted(p.name for p in (dcp_run / "checkpoint-3").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    verdict = audit(dcp_run)
    assert [(r["rank"], r["steps"]) for r in verdict["evidence"]["ranks"]] == [(0, 6), (1, 6)]
    loop09 = [f for f in verdict["findings"] if f["code"] == "LOOP-09"]
    # checkpoint-3 holds the model (keys as the unwrapped model names them) and the full training
    # state; checkpoint-6's keys all carry DDP's prefix.
    assert [(f["checkpoint"], f["severity"]) for f in loop09] == [("checkpoint-6", "fail")]
    unexpected = loop09[0]["evidence"]["keys"]["unexpected"]
    assert unexpected and all(k.startswith("module.") for k in unexpected)
    assert gate(dcp_run, "checkpoint-3") == 0 and gate(dcp_run, "checkpoint-6") == 1
    capsys.readouterr()


def test_ddp_wrapped_model_is_recorded_under_the_names_its_checkpoints_have(runs):
    with process_group():
        run = runs(
            "ddp",
            steps=8,
            checkpoint_every=4,
            profile="prod",
            wrap=torch.nn.parallel.DistributedDataParallel,
            saver=layouts.ddp_folders(),
        )
    verdict = audit(run)
    con = connect(run, read_only=True)
    try:
        names = [p["name"] for p in load_manifest(con)["params"]]
    finally:
        con.close()
    assert names and not any(n.startswith("module.") for n in names)
    assert verdict["verdict"] == "pass", [f["message"] for f in verdict["findings"] if f["severity"] != "info"]
    assert gate(run, "checkpoint-8") == 0


def test_compiled_and_wrapped_models_are_recorded_under_their_checkpoint_names(tmp_path, tokenizer_cache):
    from sftaudit.fixtures import build_model, build_tokenizer

    from sftaudit.shim import Recorder

    tok = build_tokenizer(tokenizer_cache)
    model = build_model(tok)
    expected = list(model.state_dict())
    compiled = torch.compile(model)  # an OptimizedModule: every name gets `_orig_mod.`
    assert next(n for n, _ in compiled.named_parameters()).startswith("_orig_mod.")
    Recorder(tmp_path, compiled, tok, profile="prod").close()
    manifest = json.loads((rank_dir(tmp_path, 0) / "manifest.jsonl").read_text().splitlines()[0])
    assert [p["name"] for p in manifest["params"]] == expected


def test_per_rank_means_fail_loss_normalisation_when_the_run_is_declared_a_token_mean_across_ranks(distributed_runs):
    """Z24: DDP averages each rank's own token mean; ranks train different token counts, so when the objective
    is declared a token mean across ranks (as the Trainer's average_tokens_across_devices does) tokens weigh unequally."""
    from sftaudit.verdict.config import AuditConfig

    dcp_run = distributed_runs / "dcp"
    assert not [f for f in audit(dcp_run)["findings"] if f["code"] == "LOOP-13" and f["severity"] != "info"]
    verdict = audit(dcp_run, AuditConfig(check_options={"LOOP-13": {"token_mean_across_ranks": True}}))
    [finding] = [f for f in verdict["findings"] if f["code"] == "LOOP-13"]
    assert (finding["severity"], finding["step"]) == ("fail", 1)
    assert finding["evidence"]["convention"] == "mean of per-rank means"
    assert {m["rank"] for m in finding["evidence"]["micro_batches"]} == {0, 1}
