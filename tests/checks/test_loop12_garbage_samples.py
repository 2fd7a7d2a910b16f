"""LOOP-12: a burst of gibberish samples is found at its first step with its sample ids; clean runs stay silent."""

import pytest

from sftaudit.verdict.audit import audit

from ..shared import cached_audit

GARBAGE_STEP = 12


def loop12(verdict):
    return [f for f in verdict["findings"] if f["code"] == "LOOP-12"]


@pytest.fixture(scope="module")
def garbage_run(runs):
    return runs(
        "garbage",
        steps=18,
        checkpoint_every=0,
        faults={"garbage_from": GARBAGE_STEP},
        probe_every=0,
        generate_every=0,
        eval_every=0,
    )


def test_garbage_burst_warns_at_its_first_step_with_the_sample_ids(garbage_run):
    verdict = audit(garbage_run)
    (finding,) = loop12(verdict)
    assert finding["severity"] == "warn" and finding["step"] == GARBAGE_STEP
    assert finding["evidence"]["steps"] == [GARBAGE_STEP, GARBAGE_STEP + 1, GARBAGE_STEP + 2]  # the fault's 3 steps
    ids = finding["evidence"]["sample_ids"]
    assert len(ids) == 10 and all(i.startswith(f"garbage-{GARBAGE_STEP}-") for i in ids[:8])
    assert min(finding["evidence"]["shares"]) >= 0.5 > finding["evidence"]["median_share"]
    assert verdict["first_anomalous_step"] == GARBAGE_STEP


def test_clean_run_raises_nothing(clean_run):
    assert loop12(cached_audit(clean_run)) == []
