"""What the checkpoint checks share: the run's saved checkpoints with the parameters each is judged
against, their inspections (`sftaudit.readers.inspection`), and the training-state parts an exact resume of
the run needs that a checkpoint lacks (LOOP-09 states them, LOOP-11 says where they bit, `gate`
blocks on them under `require_resume_state`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..readers.inspection import ALWAYS_NEEDED, STATE_KEYS, Inspection, inspect_checkpoint
from ..store.rundb import recorded_checkpoints
from .base import AuditContext


def saved_checkpoints(ctx: AuditContext) -> list[dict[str, Any]]:
    """Rank 0's checkpoints in step order (one per path: its last save), with the recorded hashes
    and the saving segment's params."""
    manifests = {
        seg: json.loads(m) for seg, m in ctx.con.execute("SELECT seg, manifest FROM manifest WHERE rank = 0").fetchall()
    }
    return [
        {
            **c,
            "params": manifests.get(c["seg"], ctx.manifest).get("params", []),
            "tied": manifests.get(c["seg"], ctx.manifest).get("tied", {}),
        }
        for c in recorded_checkpoints(ctx.con)
    ]


# LOOP-09's options that change what an inspection finds (the rest judge what it found).
INSPECTION_OPTIONS = ("expected_dtype", "trusted_pickle_globals", "max_tensors_listed")


def inspection_options(options: dict[str, Any]) -> dict[str, Any]:
    """Of a LOOP-09 options table (its defaults, or the audit config's section), those an inspection takes."""
    return {k: options[k] for k in INSPECTION_OPTIONS if k in options}


def inspected(ctx: AuditContext, checkpoints: list[dict[str, Any]], **options: Any) -> list[Inspection]:
    """Each of `checkpoints` (from `saved_checkpoints`) inspected; `options` as `inspect_checkpoint` takes them."""
    paths = [c["path"] for c in recorded_checkpoints(ctx.con)]
    return [inspect_checkpoint(ctx.con, ctx.run_dir, c, checkpoint_paths=paths, **options) for c in checkpoints]


def needed_state(ctx: AuditContext, inspections: list[Inspection]) -> list[str]:
    """The parts an exact resume of this run needs: step, optimizer, RNG states and data position
    always; the scheduler when the run had one (the shim's manifest describes it, a checkpoint or the
    run folder saved its state, or the learning rate changed); the collator's state when a checkpoint
    saved any (the usual collators have none: their settings are code)."""
    held = {part for i in inspections for part in i.state_found or []}
    manifests = [json.loads(m) for (m,) in ctx.con.execute("SELECT manifest FROM manifest WHERE rank = 0").fetchall()]
    scheduler = (
        "scheduler" in held
        or any(m.get("scheduler") for m in manifests)
        or (ctx.run_dir / "scheduler.pt").is_file()
        or (ctx.scalar("SELECT count(DISTINCT lr) FROM steps WHERE rank = 0 AND isfinite(lr)") or 0) > 1
    )
    return [
        part
        for part in STATE_KEYS
        if part in ALWAYS_NEEDED or (part == "scheduler" and scheduler) or (part == "collator" and part in held)
    ]


def missing_state(ctx: AuditContext, inspections: list[Inspection]) -> dict[str, list[str]]:
    """Checkpoint name -> the training-state parts it lacks of those the run needs (checkpoints whose
    state could be read, and that lack something)."""
    needed = needed_state(ctx, inspections)
    lacking = {
        i.name: [p for p in needed if p not in i.state_found] + i.rng_missing
        for i in inspections
        if i.state_found is not None
    }
    return {name: parts for name, parts in lacking.items() if parts}


def cannot_resume(name: str, lacking: Sequence[str]) -> str:
    """Why a checkpoint fails where an exact resume is required (`require_resume_state`)."""
    return f"{name} cannot resume exactly: its training state lacks {', '.join(lacking)}; save them with the weights"
