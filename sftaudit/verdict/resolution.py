"""The resolution of a finding on imported logs: which steps it can stand for.

A Trainer logs every ``logging_steps`` steps: its ``loss`` is the mean over the window since the
previous log and its ``grad_norm`` that of the window's last step. A finding a check makes at a
logged step s therefore happened somewhere in (previous logged step, s]. The finding is moved to
the window's first step (so the rollback checkpoint is one saved before the whole window), its
message says the window, and its evidence carries it. With ``logging_steps = 1`` the window is the
step itself: the step is exact. Findings that carry their own resolution (a checkpoint window)
and findings without a step are left as they are. Findings on the training data given with
``--data`` (recorded at step 0: the order the run drew the rows in is not on disk) become
dataset-level: no step, resolution "dataset".
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ..checks.base import Finding
from ..imports.dataset import DATASET_SOURCE, DATASET_STEP


def at_logging_resolution(con, manifest: dict[str, Any], findings: list[Finding]) -> tuple[list[Finding], dict | None]:
    """Findings restated at the logs' resolution, and the resolution summary for the verdict."""
    if not manifest.get("imported"):
        return findings, None
    logging_steps = (manifest.get("granularity") or {}).get("logging_steps")
    logged = con.sql("SELECT DISTINCT step FROM steps WHERE rank = 0 ORDER BY step").fetchnumpy()["step"]
    dataset = manifest.get("dataset")
    out = []
    for f in findings:
        if dataset and f.step == DATASET_STEP:
            note = (
                f" [dataset given with --data ({dataset['data']}): the step the run trained each row at is not on disk]"
            )
            out.append(
                replace(
                    f,
                    step=None,
                    message=f.message + note,
                    evidence={**f.evidence, "resolution": {"kind": "dataset", "source": DATASET_SOURCE}},
                )
            )
            continue
        if f.step is None or f.checkpoint is not None or "resolution" in f.evidence:
            out.append(f)
            continue
        i = int(np.searchsorted(logged, f.step))
        if i >= logged.size or logged[i] != f.step:
            out.append(f)  # not a logged step (a metric logged between training logs): left as is
            continue
        first = int(logged[i - 1]) + 1 if i else 1
        resolution = {
            "kind": "logging window",
            "first_step": first,
            "last_step": int(f.step),
            "logging_steps": logging_steps,
        }
        if first == f.step:
            resolution["kind"] = "exact step"
            out.append(replace(f, evidence={**f.evidence, "resolution": resolution}))
            continue
        note = (
            f" [imported logs, logged every {logging_steps} steps: first anomalous logging window: "
            f"steps {first}-{f.step}]"
        )
        out.append(replace(f, step=first, message=f.message + note, evidence={**f.evidence, "resolution": resolution}))
    notes = (
        {"notes": manifest["import_notes"]} if manifest.get("import_notes") else {}
    )  # what the import could not read
    return out, {
        "kind": "logging window" if (logging_steps or 1) > 1 else "exact step",
        "logging_steps": logging_steps,
        "source": manifest.get("source"),
        **notes,
    }


def first_window(verdict: dict[str, Any]) -> dict[str, Any] | None:
    """The narrowest window (logging or checkpoint) known to hold the first anomalous step: kind,
    first_step, last_step (None: no anomaly, or its step is exact)."""
    first = verdict.get("first_anomalous_step")
    if first is None:
        return None
    windows = [
        r
        for f in verdict.get("findings", [])
        if f["step"] == first
        and f["severity"] != "info"
        and f["scope"] == "run"
        and "last_step" in (r := (f.get("evidence") or {}).get("resolution") or {})
        and r.get("first_step") == first
    ]
    if not windows or any(r["last_step"] == first for r in windows):
        return None
    best = min(windows, key=lambda r: (r["last_step"], r["kind"] != "logging window"))
    return {k: best[k] for k in ("kind", "first_step", "last_step")}
