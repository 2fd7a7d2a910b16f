"""The tracker fixtures write real runs that their libraries read back as written (each source is skipped where its
library is not installed; `pip install wandb mlflow trackio lightning torchtune "torchao<=0.15"` brings them all)."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
from sftaudit.fixtures.trackers import mismatches
from sftaudit.fixtures.trackers.generate_all import TARGETS, clean_run, nan_loss_run

# Sources whose write starts a process (wandb-core, trackio's child) or trains (Lightning's Trainer.fit).
SLOW = {"wandb_offline", "trackio_db", "lightning_csv"}


@pytest.mark.parametrize(
    "target", [pytest.param(t, marks=pytest.mark.slow) if t in SLOW else t for t in TARGETS], ids=str
)
def test_fixture_reads_back_as_written(target, tmp_path):
    module_name, options = TARGETS[target]
    module = importlib.import_module(f"sftaudit.fixtures.trackers.{module_name}")
    if importlib.util.find_spec(module.LIBRARY) is None:
        pytest.skip(f"{module.LIBRARY} is not installed")
    run = nan_loss_run(12)
    path = module.write(
        tmp_path / target, run["steps"], run["loss"], run["lr"], run["grad_norm"], run["evals"], run["plan"], **options
    )
    got = module.read_back(path)
    plan = {k: v for k, v in run["plan"].items() if k in module.PLAN_KEYS}
    assert mismatches({**run, "plan": plan}, got) == []
    # The comparison sees a different run: the clean twin differs from this one in loss, grad norm and evals.
    assert {"loss differs", "grad_norm differs"} <= set(mismatches({**clean_run(12), "plan": plan}, got))
