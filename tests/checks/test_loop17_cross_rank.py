"""LOOP-17 cross-rank consistency: planted faults in 2-rank CPU runs (the `distributed_runs` launch),
each found at its step; silent on the clean runs of every framework."""

import pytest

from sftaudit.audit import audit

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
