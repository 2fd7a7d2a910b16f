"""LOOP-17 cross-rank consistency: planted faults in 2-rank CPU runs (the `distributed_runs` launch),
each found at its step; silent on the clean runs of every framework."""

import json

import numpy as np
import pytest

from sftaudit.checks.base import AuditContext
from sftaudit.checks.loop17_cross_rank import CrossRankConsistency
from sftaudit.core.artifacts import rank_dir
from sftaudit.store.ingest import ingest
from sftaudit.store.rundb import connect, load_manifest
from sftaudit.verdict.audit import audit

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
    assert found and found[0]["step"] == step and named in found[0]["message"], [
        (f["code"], f["step"], f["message"]) for f in verdict["findings"]
    ]
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


def test_outlying_finite_local_loss_is_pinned_to_its_rank(verdict_of):
    """ZeRO-2, 12 steps: rank 1's model loss x10 at step 10 (finite; its gradients x10 too)."""
    verdict = verdict_of("zero2_loss_x10")
    found = [f for f in verdict["findings"] if f["code"] == "LOOP-17"]
    assert [(f["severity"], f["step"], f["evidence"]["rank"], f["evidence"]["steps_affected"]) for f in found] == [
        ("warn", 10, 1, 1)
    ], found
    assert "rank 1 at step 10" in found[0]["message"] and found[0]["evidence"]["sample_ids"]
    assert 9 < found[0]["evidence"]["ratio"] < 11


@pytest.mark.parametrize(
    "name", ["ddp", "fsdp1_flat", "fsdp2", "trainer_ddp", "zero1", "zero2", "zero3", "fsdp2_spike"]
)
def test_silent_on_clean_runs(verdict_of, name):
    """fsdp2_spike's x100 is in one gradient shard: its 12 steps of losses are a clean history
    long enough for the outlying-loss rule to judge steps 9-12."""
    assert not [f for f in verdict_of(name)["findings"] if f["code"] == "LOOP-17"]


def ddp_records(run, norms_by_rank):
    """Two DDP ranks' artifacts as the shim writes them (layouts: every tensor replicated)."""
    for rank, steps in norms_by_rank.items():
        folder = rank_dir(run, rank)
        folder.mkdir(parents=True)
        params = [
            {
                "name": n,
                "shape": [2],
                "dtype": "float32",
                "numel": 2,
                "requires_grad": True,
                "kind": "replicated",
                "start": 0,
                "stop": 2,
                "local_numel": 2,
                "replica": rank,
            }
            for n in ("a", "b")
        ]
        (folder / "manifest.jsonl").write_text(
            json.dumps(
                {
                    "schema_version": 1,
                    "seg": 0,
                    "rank": rank,
                    "world_size": 2,
                    "profile": "prod",
                    "params": params,
                    "tied": {},
                    "grad_norm_source": "pre_clip",
                }
            )
            + "\n"
        )
        (folder / "steps.jsonl").write_text(
            "".join(
                json.dumps({"seg": 0, "step": s, "loss": 1.0, "grad_norms": norms}) + "\n" for s, norms in steps.items()
            )
        )
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


def loss_records(run, losses):
    """Ranks' artifacts with only losses that matter (`losses`: steps x ranks)."""
    for rank in range(losses.shape[1]):
        folder = rank_dir(run, rank)
        folder.mkdir(parents=True)
        params = [
            {
                "name": "a",
                "shape": [2],
                "dtype": "float32",
                "numel": 2,
                "requires_grad": True,
                "kind": "replicated",
                "start": 0,
                "stop": 2,
                "local_numel": 2,
                "replica": rank,
            }
        ]
        (folder / "manifest.jsonl").write_text(
            json.dumps(
                {
                    "schema_version": 1,
                    "seg": 0,
                    "rank": rank,
                    "world_size": losses.shape[1],
                    "profile": "prod",
                    "params": params,
                    "tied": {},
                    "grad_norm_source": "pre_clip",
                }
            )
            + "\n"
        )
        (folder / "steps.jsonl").write_text(
            "".join(
                json.dumps({"seg": 0, "step": s + 1, "loss": float(v), "grad_norms": [1.0]}) + "\n"
                for s, v in enumerate(losses[:, rank])
            )
        )
    return run


def noisy_losses(steps, ranks, seed=0):
    """A decaying SFT loss; each rank's micro-batch loss off it by heavy-tailed noise (t, 5 dof, ~10%:
    a batch 1.5x harder than the others' now and then)."""
    rng = np.random.default_rng(seed)
    trend = 1.0 + 1.5 * np.exp(-np.arange(steps) / 150)
    return trend[:, None] * np.exp(0.1 * rng.standard_t(5, size=(steps, ranks)))


@pytest.mark.parametrize("ranks", [2, 4])
def test_outlying_loss_rule_on_long_noisy_runs(tmp_path, ranks):
    for seed in range(2):  # silent on heavy-tailed per-rank noise over 400 steps
        assert not loop17(loss_records(tmp_path / f"clean{seed}", noisy_losses(400, ranks, seed))), seed
    for factor, rank in ((10.0, ranks - 1), (0.1, 0)):  # a loss x10, or one that collapses to a tenth
        losses = noisy_losses(400, ranks)
        losses[250, rank] *= factor
        found = loop17(loss_records(tmp_path / f"x{factor}", losses))
        assert [(f.severity, f.step, f.evidence["rank"]) for f in found] == [("warn", 251, rank)]
