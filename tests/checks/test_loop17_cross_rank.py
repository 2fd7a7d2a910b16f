"""LOOP-17 cross-rank consistency: planted faults in 2-rank CPU runs (the `distributed_runs` launch),
each found at its step; silent on the clean runs of every framework."""

import json

import pytest

from sftaudit.artifacts import rank_dir
from sftaudit.audit import audit
from sftaudit.checks.base import AuditContext
from sftaudit.checks.loop17_cross_rank import CrossRankConsistency
from sftaudit.ingest import connect, ingest, load_manifest

# run -> (code, step, what the message must name)
FAULTS = {
    "fsdp2_spike": ("LOOP-05", 10, "model.layers.1.mlp.down_proj.weight"),  # x100 in rank 0's shard only
    "ddp_nan_loss": ("LOOP-17", 4, "rank(s) 1"),
    "ddp_same_samples": ("LOOP-17", 1, "same 4 of 4 sample"),
    "fsdp2_stop": ("LOOP-17", 5, "rank 1 stopped recording after step 4"),
    "ddp_perturb": ("LOOP-17", 3, "rank(s) 1 differ from rank 0 in 1 tensor(s), first lm_head.weight"),
    "fsdp1_local_clip": ("LOOP-17", 1, "clip_grad_norm_"),
}


@pytest.fixture(scope="module")
def verdict_of(distributed_runs):
    """Each run audited once for this module."""
    done = {}

    def get(name):
        if name not in done:
            done[name] = audit(distributed_runs / name)
        return done[name]

    return get


@pytest.mark.parametrize("name", FAULTS)
def test_planted_fault_is_found_at_its_step(verdict_of, name):
    code, step, named = FAULTS[name]
    verdict = verdict_of(name)
    found = [f for f in verdict["findings"] if f["code"] == code and f["severity"] == "fail"]
    assert found and found[0]["step"] == step and named in found[0]["message"], \
        [(f["code"], f["step"], f["message"]) for f in verdict["findings"]]
    assert verdict["verdict"] == "fail" and verdict["first_anomalous_step"] == step
    assert not [f for f in verdict["findings"] if f["code"] == "LOOP-17" and f["step"] < step]


def test_evidence_names_ranks_and_values(verdict_of):
    nan = next(f for f in verdict_of("ddp_nan_loss")["findings"] if f["code"] == "LOOP-17")
    assert nan["evidence"]["ranks"] == [1] and [x["rank"] for x in nan["evidence"]["losses"]] == [0, 1]
    stop = next(f for f in verdict_of("fsdp2_stop")["findings"] if f["code"] == "LOOP-17")
    assert stop["evidence"]["steps_per_rank"] == {"0": 6, "1": 4} and stop["evidence"]["incomplete_steps"] == 2
    clip = next(f for f in verdict_of("fsdp1_local_clip")["findings"] if f["code"] == "LOOP-17")
    # Each rank clipped by the norm of its own shards: less than the whole model's.
    assert clip["evidence"]["logged"] < clip["evidence"]["reduced"]
    same = next(f for f in verdict_of("ddp_same_samples")["findings"] if f["code"] == "LOOP-17")
    assert same["evidence"]["steps_affected"] == 6 and same["evidence"]["ranks"] == [0, 1]


@pytest.mark.parametrize("name", ["ddp", "fsdp1_flat", "fsdp2", "trainer_ddp"])
def test_silent_on_clean_runs(verdict_of, name):
    assert not [f for f in verdict_of(name)["findings"] if f["code"] == "LOOP-17"]


def ddp_records(run, norms_by_rank):
    """Two DDP ranks' artifacts as the shim writes them (layouts: every tensor replicated)."""
    for rank, steps in norms_by_rank.items():
        folder = rank_dir(run, rank)
        folder.mkdir(parents=True)
        params = [{"name": n, "shape": [2], "dtype": "float32", "numel": 2, "requires_grad": True,
                   "kind": "replicated", "start": 0, "stop": 2, "local_numel": 2, "replica": rank} for n in ("a", "b")]
        (folder / "manifest.jsonl").write_text(json.dumps(
            {"schema_version": 1, "seg": 0, "rank": rank, "world_size": 2, "profile": "prod", "params": params,
             "tied": {}, "grad_norm_source": "pre_clip"}) + "\n")
        (folder / "steps.jsonl").write_text("".join(
            json.dumps({"seg": 0, "step": s, "loss": 1.0, "grad_norms": norms}) + "\n" for s, norms in steps.items()))
    return run


def loop17(run):
    ingest(run)
    con = connect(run)
    try:
        return CrossRankConsistency().run(AuditContext(con, run, load_manifest(con)))
    finally:
        con.close()


def test_replicated_gradients_that_differ_name_the_rank_and_step(tmp_path):
    same = {1: [1.0, 2.0], 2: [1.5, 2.5], 3: [1.25, 2.25]}
    corrupted = ddp_records(tmp_path / "sdc", {0: same, 1: {**same, 2: [1.5, 2.5000002]}})
    found = loop17(corrupted)
    assert [(f.step, f.evidence["ranks"], f.evidence["steps_affected"]) for f in found] == [(2, [1], 1)]
    assert "first b" in found[0].message and "silent data corruption" in found[0].message
    unsynced = ddp_records(tmp_path / "alone", {0: same, 1: {s: [v * 1.1 for v in n] for s, n in same.items()}})
    assert "not synchronised" in loop17(unsynced)[0].message
    assert loop17(ddp_records(tmp_path / "clean", {0: same, 1: same})) == []
