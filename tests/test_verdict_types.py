"""The verdict's types: a recorded and an imported run's verdict, read back with `Verdict.from_dict`, writes the same
bytes again; every finding names its rule id; verdict.schema.json (generated from the types) accepts them."""

from __future__ import annotations

import importlib.resources
import json

import numpy as np
import pytest
from jsonschema import Draft202012Validator

from sftaudit.checks import registered_checks
from sftaudit.schema.findings import Finding
from sftaudit.schema.verdict import CheckpointVerdict, Verdict
from sftaudit.verdict.audit import audit

from .checks.dynamics_runs import recorded_series_run
from .checks.logged_runs import audited, trainer_run


def _recorded(tmp_path):
    """A recorded run whose loss goes NaN from step 30 and one tensor's gradient spikes at step 20."""
    rng = np.random.default_rng(0)
    steps = 40
    norms = np.exp(rng.normal(-2, 0.1, (steps, 6)))
    norms[19, 2] *= 300
    loss = list(np.linspace(2.0, 1.0, steps))
    loss[29:] = [float("nan")] * (steps - 29)
    names = [f"model.layers.{i}.weight" for i in range(6)]
    return audit(recorded_series_run(tmp_path / "recorded", [1e-4] * steps, loss, norms, names))


def _imported(tmp_path):
    """An imported Trainer run (logged every 10 steps) whose loss is 0 from step 20."""
    return audited(trainer_run(tmp_path / "imported", [0.0328] + [0.0] * 99, every=10, decimals=4))


@pytest.mark.parametrize("make", [_recorded, _imported], ids=["recorded", "imported"])
def test_a_verdict_reads_back_into_its_types_and_writes_the_same_bytes(make, tmp_path):
    stored = make(tmp_path)
    assert stored["findings"] and any(f["severity"] != "info" for f in stored["findings"])
    typed = Verdict.from_dict(json.loads(json.dumps(stored)))
    assert json.dumps(typed.to_dict()) == json.dumps(stored)
    assert all(isinstance(f, Finding) and f.scope in ("run", "checkpoint") for f in typed.findings)
    assert all(isinstance(c, CheckpointVerdict) for c in typed.checkpoints)
    rules = {f"{c.code}/{slug}" for c in registered_checks() for slug in c.rules}
    assert all(f.rule in rules and f.rule.startswith(f.code + "/") for f in typed.findings)
    assert typed.verdict == stored["verdict"] and typed.evidence.ranks[0].rank == 0
    schema = json.loads((importlib.resources.files("sftaudit") / "schema" / "verdict.schema.json").read_text())
    errors = list(Draft202012Validator(schema).iter_errors(stored))
    assert not errors, [f"{list(e.path)}: {e.message[:200]}" for e in errors[:3]]


def test_a_verdict_of_an_older_sftaudit_reads_without_the_new_fields(tmp_path):
    stored = json.loads(json.dumps(_imported(tmp_path)))
    for f in stored["findings"]:
        del f["rule"]
    typed = Verdict.from_dict(stored | {"a_field_of_a_newer_sftaudit": 1})
    assert all(f.rule is None for f in typed.findings) and typed.to_dict()["findings"][0]["rule"] is None
