"""Attribution and verdict: findings -> checkpoint windows -> per-checkpoint and run verdicts.

A finding at step s falls in the window of the first checkpoint saved at a step >= s
(after checkpoint A, up to and including checkpoint B). A checkpoint's verdict is the
worst severity of everything that happened up to it: findings in its window or an
earlier one, run-level findings (no step), and findings about the checkpoint itself.
The rollback checkpoint is the last intact one (still on disk, no warn/fail finding about
the checkpoint itself, i.e. it passes LOOP-09) saved at least `rollback_margin` (default 1)
steps before the first anomalous step; `rollback_deleted` names a later sound one that was
rotated out or deleted.

The kept checkpoint (`keep_checkpoint`, what to ship) is chosen on the run's selection metric (trainer_state.json's
best_metric, else eval_loss; LOOP-26 judges the same series) among the checkpoints that could be the rollback
target (intact, saved at least `rollback_margin` steps before the first anomalous step: so never later than the
rollback checkpoint) and were evaluated at their own step: of those, the best on the metric, or, when the eval's
noise band is known, the earliest from which every evaluation up to that best one stays within the band of it
(as good as far as the eval can tell, with less training: the conservative choice). The `keep` object says on
what and why, where the run's best evaluation was (`best`, `best_not_saved` when no checkpoint was saved at its
step) and how much of the run came after it (`after_best`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..checks.selection_metric import better
from ..core.artifacts import SCHEMA_VERSION
from ..schema.findings import SEVERITY_RANK, Finding
from ..schema.verdict import ChainLink, CheckError, CheckpointVerdict, EvidenceCoverage, Keep, Verdict
from .config import DEFAULT_ROLLBACK_MARGIN

# Findings within this many steps of the first anomalous step form its chain (what fired around it).
CHAIN_WINDOW = 50


def attribute(findings: list[Finding], checkpoints: list[dict[str, Any]]) -> list[Finding]:
    """Set each stepped finding's checkpoint to the window it falls in (None: after the last save)."""
    ordered = sorted(checkpoints, key=lambda c: c["step"])
    out = []
    for f in findings:
        if f.checkpoint is None and f.step is not None:
            window = next((c["name"] for c in ordered if c["step"] >= f.step), None)
            f = replace(f, checkpoint=window)
        out.append(f)
    return out


def build_verdict(
    run: str,
    findings: list[Finding],
    checkpoints: list[dict[str, Any]],
    check_errors: list[dict[str, str]] | None = None,
    rollback_margin: int = DEFAULT_ROLLBACK_MARGIN,
    evidence: dict[str, Any] | None = None,
    selection: dict[str, Any] | None = None,
) -> Verdict:
    """The run's verdict; "unjudged" (never pass) when the evidence says it cannot be judged. `selection` is the
    run's selection metric with its evaluations (`checks.selection_metric.run_selection_series`): what the kept
    checkpoint is chosen on."""
    # Findings a check already tied to a checkpoint (LOOP-09) are about that checkpoint alone
    # (scope "checkpoint"); the rest are about the run, up to the step they happened (scope "run").
    about_checkpoint = [replace(f, scope="checkpoint") for f in findings if f.checkpoint is not None]
    about_run = [replace(f, scope="run") for f in attribute([f for f in findings if f.checkpoint is None], checkpoints)]
    scoped = about_checkpoint + about_run
    scoped.sort(key=lambda f: (f.step is None, f.step or 0, f.code, -SEVERITY_RANK[f.severity], f.message, f.scope))
    # Only anomalies date the run: a configuration or a risk is not "where it went wrong".
    anomalous = [f.step for f in about_run if f.step is not None and f.severity != "info" and f.category == "anomaly"]
    first = min(anomalous) if anomalous else None
    chain = [
        ChainLink(f.code, f.severity, f.step, f.message)
        for f in scoped
        if first is not None and f.step is not None and abs(f.step - first) <= CHAIN_WINDOW
    ]

    per_checkpoint = []
    for c in sorted(checkpoints, key=lambda c: c["step"]):
        upto = findings_up_to(scoped, c["name"], c["step"])
        own = [f for f in scoped if f.checkpoint == c["name"]]
        sound = not any(f.scope == "checkpoint" and f.severity != "info" for f in own) and not any(
            c["name"] in unusable(f) for f in about_run
        )
        on_disk = c.get("on_disk", True)
        per_checkpoint.append(
            CheckpointVerdict(
                name=c["name"],
                step=c["step"],
                path=c["path"],
                saves=c.get("saves", [c["step"]]),
                on_disk=on_disk,
                verdict=worst_of(upto),
                intact=sound and on_disk,
                sound=sound,
                findings=own,
            )
        )

    # A check that raised judged nothing: a verdict without it would pass what it exists to catch.
    reasons = [r for r in [(evidence or {}).get("cannot_judge")] if r]
    reasons += [f"check {e['code']} failed to run ({e['error']})" for e in check_errors or []]
    if not reasons and (evidence or {}).get("too_little") and worst_of(scoped) == "pass":
        reasons.append(evidence["too_little"])
    keep = kept_checkpoint(per_checkpoint, first, rollback_margin, selection, bool(reasons))
    return Verdict(
        schema_version=SCHEMA_VERSION,
        run=run,
        verdict="unjudged" if reasons else worst_of(scoped),
        cannot_judge="; ".join(reasons) or None,
        evidence=EvidenceCoverage.from_dict(evidence or {}),
        first_anomalous_step=first,
        first_anomaly_chain=chain,
        rollback_checkpoint=rollback_checkpoint(per_checkpoint, first, rollback_margin),
        rollback_deleted=rollback_deleted(per_checkpoint, first, rollback_margin),
        rollback_margin=rollback_margin,
        keep_checkpoint=keep.pop("checkpoint"),
        keep=Keep.from_dict(keep),
        checkpoints=per_checkpoint,
        findings=scoped,
        check_errors=[CheckError(**e) for e in check_errors or []],
    )


def unusable(finding: Finding) -> list[str]:
    """The checkpoints a finding says cannot be used at all (evidence `not_intact`: a logs-only copy's), whatever
    its severity."""
    return list(finding.evidence.get("applies_to") or []) if finding.evidence.get("not_intact") else []


def findings_up_to(findings: list[Finding], name: str, step: int) -> list[Finding]:
    """What a checkpoint's verdict rests on: run findings up to its step (or without a step) and
    the findings about that checkpoint itself. A run finding whose evidence names the checkpoints
    it `applies_to` (one warn for several checkpoints) counts for those alone."""
    return [
        f
        for f in findings
        if (f.scope == "checkpoint" and f.checkpoint == name)
        or (
            f.scope == "run"
            and (f.step is None or f.step <= step)
            and name in (f.evidence or {}).get("applies_to", [name])
        )
    ]


def rollback_checkpoint(per_checkpoint: list[CheckpointVerdict], first: int | None, margin: int) -> str | None:
    """The last intact checkpoint (on disk, passes LOOP-09) saved at least `margin` (>= 1) steps
    before the first anomaly."""
    if first is None:
        return None
    intact = [c for c in per_checkpoint if c.step <= first - max(margin, 1) and c.intact]
    return intact[-1].name if intact else None


def rollback_deleted(per_checkpoint: list[CheckpointVerdict], first: int | None, margin: int) -> str | None:
    """The checkpoint that would have been the rollback target had it not been rotated out or deleted."""
    if first is None:
        return None
    sound = [c for c in per_checkpoint if c.step <= first - max(margin, 1) and c.sound]
    return sound[-1].name if sound and not sound[-1].on_disk else None


def kept_checkpoint(
    per_checkpoint: list[CheckpointVerdict],
    first: int | None,
    margin: int,
    selection: dict[str, Any] | None,
    unjudged: bool = False,
) -> dict[str, Any]:
    """The checkpoint to ship (`checkpoint`, None when none can be named) and the `keep` object: metric,
    direction, selected_by, step, value, band, best, best_not_saved, after_best, why."""
    s = selection or {}
    metric, way, band = s.get("metric"), s.get("direction"), s.get("band")
    steps, values = list(s.get("steps") or []), list(s.get("values") or [])
    keep: dict[str, Any] = {
        "checkpoint": None,
        "metric": metric,
        "direction": way,
        "selected_by": s.get("source"),
        "step": None,
        "value": None,
        "band": band,
        "best": None,
        "best_not_saved": None,
        "after_best": None,
        "why": "",
    }
    if not s.get("evaluated"):
        return keep | {"why": "no evaluation was logged: nothing tells which checkpoint is best"}
    if metric is None or way is None or not steps:
        return keep | {"why": f"no metric to choose on: {s.get('note') or 'none was logged'}"}
    x = better(values, way)
    b = min(range(len(x)), key=lambda i: (x[i], steps[i]))
    # Saved: a checkpoint recorded at that step, or the one the run's own state names as its best (maybe since removed).
    saved = {step for c in per_checkpoint for step in c.saves} | {s.get("best_saved_at")}
    last = max(s.get("last_step") or 0, steps[-1])
    keep["best"] = {"step": steps[b], "value": values[b]}
    keep["best_not_saved"] = None if steps[b] in saved else steps[b]
    keep["after_best"] = {"steps": steps[-1] - steps[b], "share": (steps[-1] - steps[b]) / last if last else 0.0}
    if unjudged:
        return keep | {"why": "the run could not be judged: no checkpoint is named to ship"}
    measured = dict(zip(steps, x))
    evaluated = [c for c in per_checkpoint if c.step in measured]
    eligible = [c for c in evaluated if c.intact and (first is None or c.step <= first - max(margin, 1))]
    if not eligible:
        return keep | {"why": _none_kept(per_checkpoint, evaluated, first, margin, steps, s.get("best_saved_at"))}
    top = min(eligible, key=lambda c: (measured[c.step], c.step))
    chosen = top
    if band is not None:
        # The earliest candidate from which every evaluation up to the best candidate stays within the band of it:
        # the first one after the last evaluation (up to the best) outside the band.
        limit = measured[top.step] + band
        outside = max((step for step, xi in zip(steps, x) if step <= top.step and xi > limit), default=-1)
        chosen = min((c for c in eligible if outside < c.step <= top.step), key=lambda c: c.step)
    value = values[steps.index(chosen.step)]
    why = f"{metric} {value:.4g} at step {chosen.step}: " + (
        "the best of the checkpoints that can be shipped"
        if chosen is top
        else f"as good as {top.name} ({values[steps.index(top.step)]:.4g}) within the eval's noise band "
        f"({band:.3g}) at every evaluation in between, with less training"
    )
    if measured[top.step] > x[b] + (band or 0):
        where = (
            "was never saved"
            if keep["best_not_saved"] is not None
            else "has no checkpoint that can be shipped (not intact, or at or after the first anomaly)"
        )
        why += f"; the run's best evaluation ({values[b]:.4g} at step {steps[b]}) {where}"
    if band is None:
        why += "; too few evaluations to tell the eval's noise: the values are taken as measured"
    if s.get("source") != "run":
        why += f" ({s.get('note')})"
    return keep | {"checkpoint": chosen.name, "step": chosen.step, "value": value, "why": why}


def _none_kept(per_checkpoint, evaluated, first, margin, steps, best_saved_at) -> str:
    """Why no checkpoint can be kept, in words."""
    if not per_checkpoint:
        return "no checkpoint is in the run folder" + (
            f" (the run saved its best at step {best_saved_at}, but it is not here)"
            if best_saved_at is not None
            else ""
        )
    if not evaluated:
        return (
            f"no checkpoint was evaluated at its own step (saved at {_few(c.step for c in per_checkpoint)}, "
            f"evaluated at {_few(steps)}): save and evaluate on the same steps"
        )
    broken = [c.name for c in evaluated if not c.intact]
    late = [c.name for c in evaluated if c.intact and first is not None and c.step > first - max(margin, 1)]
    parts = []
    if broken:
        parts.append(f"{len(broken)} not intact (not on disk, or failing LOOP-09: {_few(broken)})")
    if late:
        parts.append(f"{len(late)} saved at or after the first anomalous step {first} ({_few(late)})")
    return f"of the {len(evaluated)} checkpoint(s) evaluated at their step, " + " and ".join(parts)


def _few(items, shown: int = 5) -> str:
    items = [str(i) for i in items]
    return ", ".join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


def worst_of(findings: list[Finding]) -> str:
    rank = max((SEVERITY_RANK[f.severity] for f in findings), default=0)
    return "pass" if rank == 0 else ("warn", "fail")[rank - 1]
