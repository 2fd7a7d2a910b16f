"""The analyzer pipeline: import -> ingest -> checks -> attribution/verdict -> stored in the run database.

`audit` (and `audited`, the same under a ``with``) is its one entry point: every command that judges a run
(audit, replay, gate, report, diff) and the notebook API go through it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from .._version import __version__
from ..checks import AuditContext, Finding, registered_checks
from ..checks.base import EVIDENCE, CannotJudge, alternatives, needed
from ..checks.selection_metric import run_selection_series
from ..errors import InputError, UnsupportedVersion
from ..imports import ensure_artifacts, recorded_by_shim
from ..readers.checkpoints import CheckpointError, inside_run
from ..readers.layouts import final_model_files
from ..schema.findings import SEVERITY_RANK
from ..schema.verdict import CheckCoverage, RunResolution
from ..store.import_state import imported_if_changed
from ..store.ingest import ingested
from ..store.rundb import (
    connect,
    first_row,
    has_table,
    inside_run_folder,
    load_manifest,
    recorded_checkpoints,
    run_lock,
)
from .attribution import build_verdict
from .config import DEFAULT_MAX_MISSING_SHARE, AuditConfig
from .resolution import at_logging_resolution, first_window


def run_checks(
    ctx: AuditContext, config: AuditConfig, recorded: dict[str, bool]
) -> tuple[list[Finding], list[dict[str, str]]]:
    """Every registered, enabled check that can judge what was recorded (`recorded`: `recorded_evidence`; see
    `cannot_run`); a check that crashes is reported, not fatal (the verdict is then unjudged). A check that finds
    too little to judge (`CannotJudge`) goes in `ctx.not_judged` with its reason."""
    try:
        return _run_checks(ctx, config, recorded)
    finally:
        ctx.close()


def _run_checks(
    ctx: AuditContext, config: AuditConfig, recorded: dict[str, bool]
) -> tuple[list[Finding], list[dict[str, str]]]:
    findings, errors = [], []
    for check_cls in registered_checks():
        if check_cls.code in config.disabled or cannot_run(check_cls, recorded, ctx.manifest):
            continue
        try:
            check = check_cls(**config.check_options.get(check_cls.code, {}))
        except ValueError as exc:
            raise InputError(str(exc)) from None
        try:
            findings += [f for f in check.run(ctx) if f.rule not in config.disabled]
        except (CannotJudge, UnsupportedVersion) as exc:  # the others judge on
            ctx.not_judged[check_cls.code] = str(exc)
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
            errors.append({"code": check_cls.code, "error": f"{type(exc).__name__}: {exc}"})
    return folded_restatements(findings), errors


def folded_restatements(findings: list[Finding]) -> list[Finding]:
    """`findings` with each one that another rule restates (`Check.restated_by`) folded into that rule's finding
    at its step: when that rule found something as severe or more at each step the finding flagged (its step
    and its `spike_steps`), it is left out of the list and named, with its message, in the other's
    `also_flagged_by`. Where the other rule did not find all of them (or was disabled), it stays."""
    restated_by = {f"{c.code}/{rule}": other for c in registered_checks() for rule, other in c.restated_by.items()}
    told = {(f.rule, f.step): i for i, f in enumerate(findings) if f.step is not None}
    into: dict[int, list[int]] = {}
    for i, f in enumerate(findings):
        if f.rule not in restated_by or f.step is None:
            continue
        flagged = {f.step, *(f.evidence.get("spike_steps") or ())}
        tellers = [told.get((restated_by[f.rule], step)) for step in flagged]
        if all(j is not None and SEVERITY_RANK[findings[j].severity] >= SEVERITY_RANK[f.severity] for j in tellers):
            into.setdefault(told[(restated_by[f.rule], f.step)], []).append(i)
    folded = {i for rows in into.values() for i in rows}
    return [
        dataclasses.replace(
            f,
            evidence={
                **f.evidence,
                "also_flagged_by": [{"rule": findings[k].rule, "message": findings[k].message} for k in into[i]],
            },
        )
        if i in into
        else f
        for i, f in enumerate(findings)
        if i not in folded
    ]


def saved_checkpoints(ctx: AuditContext) -> list[dict[str, Any]]:
    """The run's checkpoints (one per path, the last save), and whether each is still on disk."""
    out = []
    for c in recorded_checkpoints(ctx.con):
        try:
            on_disk = inside_run(ctx.run_dir, c["path"]).exists()
        except CheckpointError:
            on_disk = False
        out.append({k: c[k] for k in ("name", "step", "path", "saves")} | {"on_disk": on_disk})
    return out


# Logged losses below which nothing about the training can be told (one point has no trend or noise).
MIN_JUDGED_STEPS = 3

# Shim components without which a run cannot be judged at all: the steps (loss, gradient norms)
# and the batches (what was trained on).
ESSENTIAL_COMPONENTS = ("steps", "gradients", "batches")


def evidence_coverage(
    con,
    check_errors: list[dict[str, str]],
    not_judged: dict[str, str],
    manifest: dict[str, Any] | None = None,
    max_missing_share: float = DEFAULT_MAX_MISSING_SHARE,
) -> dict[str, Any]:
    """What the evidence covers: steps recorded per rank, shim components switched off (from which
    step, with which error), unreadable artifact lines, recorded steps without their batch or
    gradient records, checks that could not run; and why the run cannot be judged, if so."""
    ranks = [
        {"rank": r, "steps": n, "first_step": lo, "last_step": hi}
        for r, n, lo, hi in con.execute(
            """SELECT m.rank, count(s.step), min(s.step), max(s.step) FROM (SELECT DISTINCT rank FROM manifest) m
           LEFT JOIN steps s USING (rank) GROUP BY m.rank ORDER BY m.rank"""
        ).fetchall()
    ]
    off = [
        {"rank": r, "component": c, "from_step": step, "error": error}
        for r, c, step, error in con.execute(
            """SELECT rank, probe, min(step), arg_min(error, coalesce(step, -1)) FROM events
           WHERE kind = 'shim_error' GROUP BY rank, probe ORDER BY rank, probe"""
        ).fetchall()
    ]
    first = {r["rank"]: r["first_step"] for r in ranks}
    reasons = []
    # How many steps logged a loss, counted up to MIN_JUDGED_STEPS (a distinct over a million steps costs 0.08 s).
    logged = first_row(
        con,
        "SELECT count(*) FROM (SELECT DISTINCT step FROM steps WHERE rank = 0 AND loss IS NOT NULL LIMIT ?)",
        [MIN_JUDGED_STEPS],
    )[0]
    if not any(r["steps"] for r in ranks):
        reasons.append("no training step was recorded")
    # No trend, spike or plateau can be told from one or two points: a run with nothing found on so
    # little is unjudged, not a pass (what was found on it still stands).
    too_little = (
        (
            f"only {logged} step(s) logged a loss: too little to judge the training (at least "
            f"{MIN_JUDGED_STEPS} are needed)"
        )
        if 0 < logged < MIN_JUDGED_STEPS
        else None
    )
    for o in off:
        start = first.get(o["rank"])
        if o["component"] in ESSENTIAL_COMPONENTS and (
            o["from_step"] is None or start is None or o["from_step"] <= start
        ):
            reasons.append(
                f"rank {o['rank']}'s {o['component']} recording was switched off from the start "
                f"(step {o['from_step']}: {o['error']})"
            )
    partial = [
        f"rank {o['rank']}'s {o['component']} recording stopped at step {o['from_step']} ({o['error']}); "
        f"later steps are judged without it"
        for o in off
        if o["component"] not in ESSENTIAL_COMPONENTS
        or first.get(o["rank"]) is not None
        and o["from_step"] is not None
        and o["from_step"] > first[o["rank"]]
    ]
    bad = bad_lines(con) + skipped_at_import(manifest)
    for b in bad:
        if b["lines"] > max_missing_share * b["of"]:
            reasons.append(
                f"{b['lines']} of the {b['of']} lines of {b['file']} are unreadable (more than "
                f"{max_missing_share:.0%}): repair or re-record the artifacts"
            )
        else:
            partial.append(f"{b['lines']} of the {b['of']} lines of {b['file']} are unreadable and were skipped")
    missing = []
    if any(r["steps"] for r in ranks) and not (manifest or {}).get("imported"):
        missing = missing_step_evidence(con, off)
        for m in missing:
            note = f"rank {m['rank']}: {m['steps']} of {m['of']} recorded steps lack their {m['evidence']}" + (
                f" (first step {m['first_step']})" if m["first_step"] is not None else ""
            )
            if m["steps"] > max_missing_share * m["of"]:
                reasons.append(
                    f"{note}: the shim records them at every step, so the artifacts are incomplete; "
                    f"re-record the run, or audit the complete artifacts"
                )
            else:
                partial.append(f"{note}; those steps are judged without it")
    return {
        "ranks": ranks,
        "components_off": off,
        "bad_lines": bad,
        "mended_lines": mended_lines(con),
        "missing": missing,
        "checks_not_run": [e["code"] for e in check_errors] + sorted(not_judged),
        "partial": partial,
        "too_little": too_little,
        "cannot_judge": "; ".join(reasons) or None,
    }


def bad_lines(con) -> list[dict[str, Any]]:
    """Artifact files with unreadable lines beyond the one torn line each restart may leave (a
    crash mid-write, ended by the resumed shim): file, bad lines, lines read."""
    restarts = dict(con.execute("SELECT rank, count(*) - 1 FROM manifest GROUP BY rank").fetchall())
    rows = con.execute("SELECT file, bad_lines, lines FROM ingest_state WHERE bad_lines > 0 ORDER BY file").fetchall()
    out = []
    for file, bad, lines in rows:
        rank = int(file.split("/")[0].removeprefix("rank-")) if file.startswith("rank-") else None
        excess = bad - restarts.get(rank, 0)
        if excess > 0:
            out.append({"file": file, "lines": int(excess), "of": int(lines or bad)})
    return out


def mended_lines(con) -> list[dict[str, Any]]:
    """Artifact files with records kept whose text was mended (a lone surrogate kept as its escape, bytes that
    are not UTF-8 replaced): file, lines mended, lines read."""
    rows = con.execute(
        "SELECT file, mended_lines, lines FROM ingest_state WHERE mended_lines > 0 ORDER BY file"
    ).fetchall()
    return [{"file": file, "lines": int(n), "of": int(lines or n)} for file, n, lines in rows]


def skipped_at_import(manifest: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The records of an imported run's logs that the import could not read and skipped (a TensorBoard record
    whose CRC fails, a trainer_log.jsonl line that is not JSON), in `bad_lines`' shape."""
    notes = (manifest or {}).get("notes")
    counts = [
        (n.get("file"), n.get("lines"), n.get("of"))
        for n in (notes if isinstance(notes, list) else [])
        if isinstance(n, dict) and n.get("key") == "skipped_records"
    ]
    return [
        {"file": str(file), "lines": lines, "of": of}
        for file, lines, of in counts
        if type(lines) is int and type(of) is int and 0 < lines <= of
    ]


# Per-step evidence the shim writes at every step in every profile, and its component's name.
PER_STEP_EVIDENCE = (
    ("batches", "batches", "batch records (or a step its batches name lacks its step record)"),
    ("grad_piece_steps", "gradients", "gradient norms"),  # the steps of grad_pieces, listed at ingest
)


def missing_step_evidence(con, off: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank and kind of per-step evidence: recorded steps without it (and steps whose batches
    were recorded but whose step record is gone), leaving out the steps after the shim switched that
    component off. Batches after the last step record are the step a crash interrupted, not a gap.

    Compared as each rank's distinct steps in numpy (integer set lookups by table): DuckDB's distinct and anti joins
    of a million steps cost 0.4 s of CPU at each audit."""
    import numpy as np

    recorded, unstepped = _steps_by_rank(con, "steps")
    out = []
    for table, component, words in PER_STEP_EVIDENCE:
        have, _ = _steps_by_rank(con, table)
        stopped: dict[int, int] = {}  # rank -> the first step the component was off from (-1: from the start)
        for o in off:
            if o["component"] == component:
                from_step = o["from_step"] if o["from_step"] is not None else -1
                stopped[o["rank"]] = min(stopped.get(o["rank"], from_step), from_step)
        for rank in sorted(recorded.keys() | unstepped):
            steps = recorded.get(rank, np.zeros(0, dtype=np.int64))
            seen = have.get(rank, np.zeros(0, dtype=np.int64))
            gaps = steps[~np.isin(steps, seen)]
            if table == "batches" and steps.size:  # batches of a step whose record is gone
                gaps = np.concatenate([gaps, seen[(seen < steps[-1]) & ~np.isin(seen, steps)]])
            if rank in stopped:
                gaps = gaps[gaps < stopped[rank]]
            # A step record without a step matches no evidence: a gap, unless the component was off.
            missing = int(gaps.size) + (rank in unstepped and rank not in stopped)
            if missing:
                out.append(
                    {
                        "rank": rank,
                        "evidence": words,
                        "steps": missing,
                        "of": int(steps.size) + (rank in unstepped),
                        "first_step": int(gaps.min()) if gaps.size else None,
                    }
                )
    return out


def _steps_by_rank(con, table: str) -> tuple[dict[int, Any], set[int]]:
    """Per rank, the distinct steps of `table`, ascending (int64); and the ranks with a record of no step."""
    import numpy as np

    rows = con.sql(f'SELECT rank, step FROM "{table}" WHERE step IS NOT NULL').fetchnumpy()
    rank, step = np.asarray(rows["rank"], dtype=np.int64), np.asarray(rows["step"], dtype=np.int64)
    # Ingested in order, a table is sorted by rank and step already but where a log repeats a step.
    ordered = (np.diff(rank) > 0) | ((np.diff(rank) == 0) & (np.diff(step) > 0))
    if not ordered.all():
        order = np.lexsort((step, rank))
        rank, step = rank[order], step[order]
        distinct = np.r_[True, (np.diff(rank) != 0) | (np.diff(step) != 0)]
        rank, step = rank[distinct], step[distinct]
    starts = np.flatnonzero(np.r_[True, np.diff(rank) != 0]) if rank.size else rank
    by_rank = dict(zip(rank[starts].tolist(), np.split(step, starts[1:])))
    unstepped = {r for (r,) in con.execute(f'SELECT DISTINCT rank FROM "{table}" WHERE step IS NULL').fetchall()}
    return by_rank, unstepped


def preflight_coverage(
    con, check_errors: list[dict[str, str]], not_judged: dict[str, str], explained: bool = False
) -> dict[str, Any]:
    """A preflight's evidence: the dataset's rows that rendered into batches. None rendered is unjudged,
    unless a failing finding already says why (LOOP-01's render failures: the verdict is then FAIL)."""
    rows, rendered = first_row(
        con, "SELECT (SELECT manifest->>'$.dataset.rows' FROM manifest LIMIT 1)::BIGINT, (SELECT count(*) FROM samples)"
    )
    failed = first_row(
        con, "SELECT count(DISTINCT sample_id), any_value(error) FROM events WHERE kind = 'render_failed'"
    )
    reason = None
    if not rendered and not explained:
        reason = (
            f"no sample of the {rows or 0} dataset rows rendered"
            + (f" (first error: {failed[1]})" if failed[0] else "")
            + ": fix the rows or the chat template (--template) and run again"
        )
    return {
        "ranks": [],
        "components_off": [],
        "bad_lines": [],
        "missing": [],
        "dataset": {"rows": rows, "rendered": rendered, "render_failed": failed[0]},
        "checks_not_run": [e["code"] for e in check_errors] + sorted(not_judged),
        "partial": [],
        "cannot_judge": reason,
    }


# Shim components (as `shim_error` events name them) -> the evidence table each one writes.
COMPONENT_TABLES = {
    "steps": "steps",
    "gradients": "grad_norms",
    "batches": "batches",
    "probes": "probes",
    "generations": "generations",
    "evals": "evals",
    "checkpoints": "checkpoints",
    "metrics": "metrics",
}


# The kinds of evidence the manifest tells; every other kind of `EVIDENCE` is a table of that name.
MANIFEST_EVIDENCE = ("tokenizer", "chat_template", "final_model")
EVIDENCE_TABLES = tuple(t for t in EVIDENCE if t not in MANIFEST_EVIDENCE)


def recorded_evidence(con, manifest: dict[str, Any]) -> dict[str, bool]:
    """Per kind of evidence (`EVIDENCE`): whether the run has any (a table: whether it holds a row)."""
    tokenizer = manifest.get("tokenizer") or {}
    recorded = {
        "tokenizer": bool(tokenizer),
        "chat_template": bool(tokenizer.get("chat_template")),
        "final_model": bool(manifest.get("final_model")),
    }
    tables = {t for (t,) in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    for table in EVIDENCE_TABLES:
        recorded[table] = table in tables and first_row(con, f'SELECT 1 FROM "{table}" LIMIT 1') is not None
    if manifest.get("imported"):  # a training log's loss and gradient norm are its steps' (`STEP_METRICS`)
        recorded["metrics"] = recorded["metrics"] or recorded["steps"]
    return recorded


def cannot_run(check, recorded: dict[str, bool], manifest: dict[str, Any]) -> str | None:
    """Why the check cannot judge this run (None: it can): evidence it needs was not recorded, or the
    manifest says the run's source lacks what the check cannot judge without (an imported run's `lacks`)."""
    # The source's words come first: "the tokenizer asks for remote code" says more than "not recorded".
    lacks = manifest.get("lacks") or {}
    said = next((lacks[kind] for kind in check.source_needs if lacks.get(kind)), None)
    if said:
        return said
    missing = [
        " or ".join(EVIDENCE[t] for t in need) for need in alternatives(check) if not any(recorded[t] for t in need)
    ]
    return "not recorded: " + ", ".join(missing) if missing else None


def check_coverage(
    recorded: dict[str, bool],
    manifest: dict[str, Any],
    config: AuditConfig,
    check_errors: list[dict[str, str]],
    evidence: dict[str, Any] | None,
    not_judged: dict[str, str],
    partly_judged: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Per registered check: "ran", "partial" (a component it reads stopped mid-run, what it
    judges more finely with was not recorded, or the check judged only part of what was: `partly_judged`), "not_run"
    (evidence it needs was not recorded, or does not carry what it judges), "disabled" (by config) or
    "error"; with the reason and
    the evidence it ran on (`recorded`: `recorded_evidence`)."""
    stopped = {COMPONENT_TABLES.get(o["component"]): o for o in (evidence or {}).get("components_off", [])}
    errors = {e["code"]: e["error"] for e in check_errors}
    source = "dataset (preflight)" if manifest.get("profile") == "preflight" else manifest.get("source", "shim")
    sources = manifest.get("sources") or {}  # an imported run: where each kind of evidence came from
    out = []
    for check in registered_checks():
        unjudged = cannot_run(check, recorded, manifest)
        cut = [stopped[t] for t in needed(check) + list(check.uses) if t in stopped]
        lacking = [t for t in check.uses if not recorded[t]]
        if check.code in config.disabled:
            status, reason = "disabled", "switched off in the audit config"
        elif check.code in errors:
            status, reason = "error", errors[check.code]
        elif unjudged or check.code in not_judged:
            status, reason = "not_run", unjudged or not_judged[check.code]
        elif cut:
            status = "partial"
            reason = "; ".join(
                f"rank {o['rank']}'s {o['component']} recording stopped at step {o['from_step']}" for o in cut
            )
        elif lacking:
            status, reason = "partial", "not recorded: " + ", ".join(EVIDENCE[t] for t in lacking)
        elif check.code in (partly_judged or {}):
            status, reason = "partial", partly_judged[check.code]
        else:
            status, reason = "ran", None
        out.append(
            {
                "code": check.code,
                "name": check.name,
                "status": status,
                "reason": reason,
                "evidence": [EVIDENCE[t] for t in dict.fromkeys(needed(check) + list(check.uses)) if recorded[t]],
                "sources": list(dict.fromkeys(sources.get(t, source) for t in needed(check) if recorded[t]))
                if status in ("ran", "partial")
                else [],
            }
        )
    return out


@dataclasses.dataclass(frozen=True)
class Audited:
    """What `audited` yields: the verdict (None only when asked not to judge a run never judged) and the
    records new to the database, per kind."""

    verdict: dict[str, Any] | None
    added: dict[str, int]


@contextmanager
def audited(
    run_dir: str | Path,
    config: AuditConfig | None = None,
    *,
    data: str | Path | None = None,
    source: str | None = None,
    log_file: str | Path | None = None,
    judge: Literal["always", "if_stale", "never"] = "always",
) -> Iterator[Audited]:
    """The pipeline under the run's lock, held until the ``with`` ends (so what the caller then reads with
    `connect(run_dir, read_only=True)` is what was judged): a Trainer output trained without the shim is
    imported (again: it may have grown; `data` is its training data), what is new is ingested, and the run
    is judged. `judge`: "always"; "if_stale", the verdict this sftaudit stored is reused unless the database
    changed since it was judged, another version judged it, or another config (`config` None: the stored
    verdict's own); "never", import and ingest only (the stored verdict, if any). `source`, `log_file`: the kind
    of training log and the log file named on the command line (a run trained without the shim:
    `sftaudit.imports.import_run`)."""
    run_dir = inside_run_folder(run_dir)  # a link out of the run is refused before anything is written
    with run_lock(run_dir):  # a second audit of the run waits for this one
        if recorded_by_shim(run_dir):  # nothing to import (--data refused): the folder is not walked
            ensure_artifacts(run_dir, data, source=source, file=log_file)
        else:
            imported_if_changed(
                run_dir,
                lambda: ensure_artifacts(run_dir, data, source=source, file=log_file),
                source,
                log_file,
                always=data is not None,
            )
        if config is None:  # its limits are ingest's too
            config = _judged_with(_stored(run_dir)) if judge == "if_stale" else AuditConfig()
        with ingested(run_dir, config.max_record_bytes, config.max_file_bytes) as (con, added):
            verdict = _judged(con, run_dir, config, judge)
        yield Audited(verdict, added)


def _judged(con, run_dir: Path, config: AuditConfig, judge: str) -> dict[str, Any] | None:
    """The verdict `audited` yields, on ingest's connection (one opening of the database an audit, not two): the
    stored one read and, when it must be judged again, judged."""
    stored = _stored_in(con) if judge != "always" else None
    if judge == "always" or (judge == "if_stale" and _stale(stored, config)):
        return judge_database(con, run_dir, config)
    return stored["verdict"] if stored else None


def audit(
    run_dir: str | Path,
    config: AuditConfig | None = None,
    *,
    data: str | Path | None = None,
    source: str | None = None,
    log_file: str | Path | None = None,
    judge: Literal["always", "if_stale", "never"] = "always",
) -> dict[str, Any]:
    """Import (a run trained without the shim), ingest what is new, run the checks, store findings + verdict in
    the run database; return the verdict (`audited`)."""
    with audited(run_dir, config, data=data, source=source, log_file=log_file, judge=judge) as done:
        return done.verdict


# What the database holds of the artifacts (every file's identity and how far it was read): a verdict judged
# on other contents is stale, whoever ingested them since.
_INGESTED = """SELECT md5(coalesce(string_agg(concat_ws(':', file, "offset", records, device, inode, head), ','
               ORDER BY file), '')) FROM ingest_state"""


def _stored(run_dir: Path) -> dict[str, Any] | None:
    """The stored verdict, the config it was judged with, the sftaudit version that judged it, what the
    database held then and holds now; None when there is no database or no verdict in it."""
    try:
        con = connect(run_dir, read_only=True, views=False)
    except InputError:
        return None
    try:
        return _stored_in(con)
    finally:
        con.close()


def _stored_in(con) -> dict[str, Any] | None:
    """`_stored` of an open database."""
    if not has_table(con, "audit_verdict"):
        return None
    row = first_row(con, "SELECT verdict, config, sftaudit, ingested FROM audit_verdict")
    now = first_row(con, _INGESTED)[0]
    if row is None:
        return None
    verdict, config, version, ingested = row
    return {
        "verdict": json.loads(verdict),
        "config": json.loads(config) if config else None,
        "version": version,
        "ingested": ingested,
        "now": now,
    }


def _judged_with(stored: dict[str, Any] | None) -> AuditConfig:
    """The config a stored verdict was judged with (the defaults for what it does not name)."""
    names = {f.name for f in dataclasses.fields(AuditConfig)}
    return AuditConfig(**{k: v for k, v in ((stored or {}).get("config") or {}).items() if k in names})


def _stale(stored: dict[str, Any] | None, config: AuditConfig) -> bool:
    return (
        stored is None
        or stored["ingested"] != stored["now"]
        or stored["version"] != __version__
        or stored["config"] != json.loads(json.dumps(dataclasses.asdict(config)))
    )


def with_final_model(con, run_dir: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest with the run's final model: an import lists it (`final_model`); a recorded run's is read off
    its folder now (the weight files at its top, less any the shim recorded as a checkpoint, at the last recorded
    step), so a recorded run with no checkpoint still has its shipped model judged, as an import's is."""
    if manifest.get("imported"):
        return manifest
    recorded = {c["path"] for c in recorded_checkpoints(con)}
    files = [f for f in final_model_files(run_dir) if f not in recorded]
    last = first_row(con, "SELECT max(step) FROM steps WHERE rank = 0") if files and has_table(con, "steps") else None
    if not last or last[0] is None:
        return manifest
    return manifest | {"final_model": {"step": last[0], "files": files}}


def judge_database(con, run_dir: Path, config: AuditConfig) -> dict[str, Any]:
    """Run the checks on an ingested database, store findings + verdict + series in it."""
    manifest = with_final_model(con, run_dir, load_manifest(con))
    # Once an audit: a table's first row is one query each, a view over every part a bind of them all (the
    # checks' `has_rows` of an evidence table is this answer, not a second bind of the gradient parts).
    recorded = recorded_evidence(con, manifest)
    ctx = AuditContext(con, run_dir, manifest, known_rows={t: recorded[t] for t in EVIDENCE_TABLES})
    findings, errors = run_checks(ctx, config, recorded)
    findings, resolution = at_logging_resolution(con, manifest, findings)
    # A preflight judges a dataset before any training: it has no steps to cover by design.
    evidence = (
        preflight_coverage(con, errors, ctx.not_judged, any(f.severity == "fail" for f in findings))
        if manifest.get("profile") == "preflight"
        else evidence_coverage(con, errors, ctx.not_judged, manifest, config.max_missing_share)
    )
    checks = check_coverage(recorded, manifest, config, errors, evidence, ctx.not_judged, ctx.partly_judged)
    if not any(c["status"] in ("ran", "partial") for c in checks) and not evidence["cannot_judge"]:
        evidence["cannot_judge"] = (
            "no check could run on what was recorded ("
            + "; ".join(f"{c['code']}: {c['reason']}" for c in checks if c["status"] != "disabled")[:500]
            + ")"
        )
    verdict = build_verdict(
        manifest.get("run_id") or run_dir.name,
        findings,
        saved_checkpoints(ctx),
        errors,
        config.rollback_margin,
        evidence,
        run_selection_series(con, manifest),
    )
    typed = dataclasses.replace(verdict, checks=[CheckCoverage(**c) for c in checks])
    if resolution:  # an imported run: how finely its evidence places a step
        window = first_window(typed.to_dict())
        typed = dataclasses.replace(
            typed, resolution=RunResolution.from_dict({**resolution, "first_anomalous_window": window})
        )
    verdict = typed.to_dict()
    # With the config it was judged with, the version that judged it and what the database held: `audited`
    # reuses it only while all three are the same.
    con.execute("CREATE OR REPLACE TABLE audit_verdict (verdict JSON, config JSON, sftaudit VARCHAR, ingested VARCHAR)")
    con.execute(
        f"INSERT INTO audit_verdict SELECT ?, ?, ?, ({_INGESTED})",
        [json.dumps(verdict), json.dumps(dataclasses.asdict(config)), __version__],
    )
    con.execute("""CREATE OR REPLACE TABLE findings (code VARCHAR, severity VARCHAR, step BIGINT,
                   checkpoint VARCHAR, message VARCHAR, evidence JSON, rule VARCHAR)""")
    rows = [
        (f.code, f.severity, f.step, f.checkpoint, f.message, json.dumps(f.evidence), f.rule) for f in typed.findings
    ]
    if rows:
        con.executemany("INSERT INTO findings VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    _store_series(con, ctx.series)
    return verdict


def _store_series(con, series: list[dict[str, Any]]) -> None:
    """The checks' series into the `series` table. A re-audit of a grown run finds most points as it stored them
    (a running statistic of a step judged before does not change): when the stored series are the same ones, in
    the same order, each with ascending steps, only each series' points from the first that differs on are
    replaced (a DuckDB insert costs about 0.2 s of CPU a million points; a run of 10^6 steps has several such
    series). Else the table is written anew. Either way it holds what a fresh audit stores."""
    import numpy as np
    import polars as pl

    series = [s for s in series if len(s["steps"])]  # a series of no points stores no row
    con.execute("BEGIN TRANSACTION")
    try:
        kept = _stored_prefixes(con, series)
        if kept is None:
            con.execute("""CREATE OR REPLACE TABLE series (code VARCHAR, name VARCHAR, step BIGINT, value DOUBLE,
                           threshold DOUBLE, sole_condition BOOLEAN)""")
            kept = [0] * len(series)
        for s, rows in zip(series, kept):
            if rows:  # the points after the last one kept go (a series may have shrunk or changed at its end)
                con.execute(
                    "DELETE FROM series WHERE code = ? AND name = ? AND step > ?",
                    [s["code"], s["name"], s["steps"][rows - 1]],
                )
        new = [(i, s, rows) for i, (s, rows) in enumerate(zip(series, kept)) if rows < len(s["steps"])]
        if new:
            # The points in one frame, each row naming its series (from 1); the series' own fields looked up by it
            # in the statement (a list bound as a parameter is converted value by value).
            con.register(
                "series_rows",
                pl.DataFrame(
                    {
                        "series": np.repeat([i + 1 for i, _, _ in new], [len(s["steps"]) - rows for _, s, rows in new]),
                        "step": pl.concat([s["steps"][rows:] for _, s, rows in new]),
                        "value": pl.concat([s["values"][rows:] for _, s, rows in new]),
                    }
                ),
            )
            con.execute(
                "INSERT INTO series SELECT (?::VARCHAR[])[series], (?::VARCHAR[])[series], step, value, "
                "(?::DOUBLE[])[series], (?::BOOLEAN[])[series] FROM series_rows",
                [[s[key] for s in series] for key in ("code", "name", "threshold", "sole_condition")],
            )
            con.unregister("series_rows")
        _index_series(con, series)
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise


def _index_series(con, series: list[dict[str, Any]]) -> None:
    """The stored series, in their order, with the rows the `series` table holds now: what the next audit lists
    them by (a group-by over every point, 4 million at 10^6 steps, cost 0.1 s of CPU an audit)."""
    con.execute("""CREATE OR REPLACE TABLE series_index (position INTEGER, code VARCHAR, name VARCHAR,
                   threshold DOUBLE, sole_condition BOOLEAN, points BIGINT)""")
    points = first_row(con, "SELECT count(*) FROM series")[0]
    if series:
        con.executemany(
            "INSERT INTO series_index VALUES (?, ?, ?, ?, ?, ?)",
            [(i, s["code"], s["name"], s["threshold"], s["sole_condition"], points) for i, s in enumerate(series)],
        )


def _stored_series(con) -> list[tuple]:
    """(code, name, threshold, sole_condition) of each stored series, in their order: from `series_index` while it
    counts the rows the table holds (written by this sftaudit at the last audit), else from the points."""
    if has_table(con, "series_index"):
        listed = con.execute(
            "SELECT code, name, threshold, sole_condition, points FROM series_index ORDER BY position"
        ).fetchall()
        if listed and listed[0][4] == first_row(con, "SELECT count(*) FROM series")[0]:
            return [row[:4] for row in listed]
    return con.execute(
        "SELECT code, name, any_value(threshold), bool_or(sole_condition) FROM series GROUP BY code, name "
        "ORDER BY min(rowid)"
    ).fetchall()


def _stored_prefixes(con, series: list[dict[str, Any]]) -> list[int] | None:
    """Per series, how many of its first points the `series` table holds as they are (steps, values bit for bit,
    nulls), its threshold set anew; None when the table does not hold these series, in this order, each with
    strictly ascending steps (a point is then found by its step)."""
    import numpy as np

    if not has_table(con, "series"):
        return None
    columns = [c[0] for c in con.execute("DESCRIBE series").fetchall()]
    if columns != ["code", "name", "step", "value", "threshold", "sole_condition"]:
        return None
    stored = _stored_series(con)
    if [(code, name, sole) for code, name, _, sole in stored] != [
        (s["code"], s["name"], s["sole_condition"]) for s in series
    ]:
        return None
    for (_, _, threshold, _), s in zip(stored, series):  # a threshold scaled by a whole-run statistic moves
        if threshold != s["threshold"]:
            con.execute(
                "UPDATE series SET threshold = ? WHERE code = ? AND name = ?", [s["threshold"], s["code"], s["name"]]
            )
    kept = []
    for s in series:
        steps = s["steps"].to_numpy()
        if steps.size > 1 and not (np.diff(steps) > 0).all():
            return None
        # In the order stored (DuckDB keeps insertion order): ascending steps, as written, unless it is not
        # (then written anew); sorting a million points costs 0.06 s of CPU.
        old = con.sql("SELECT step, value FROM series WHERE code = ? AND name = ?", params=[s["code"], s["name"]]).pl()
        m = min(old.height, steps.size)
        old_steps = old["step"].to_numpy()
        if old_steps.size > 1 and not (np.diff(old_steps) > 0).all():
            return None
        old_values, new_values = old["value"][:m], s["values"][:m]
        differ = (
            (old_steps[:m] != steps[:m])
            | (old_values.is_null().to_numpy() != new_values.is_null().to_numpy())
            | (_bits(old_values) != _bits(new_values))
        )
        first = int(np.argmax(differ)) if differ.any() else m
        if first == 0:  # its first point changed: where the series stands among the others would change
            return None
        kept.append(first)
    return kept


def _bits(values) -> Any:
    """A float column's bits (a null as 0.0's): equal bits, equal values, NaN included."""
    import numpy as np

    return values.fill_null(0.0).to_numpy().view(np.int64)


def stored_verdict(run_dir: str | Path) -> dict[str, Any]:
    """The verdict this sftaudit stored for the run (by `audit`, or `preflight` for its output folder)."""
    with run_lock(run_dir):
        stored = _stored(Path(run_dir))
    if stored is None:
        raise InputError(f"{run_dir}: not audited yet (run `sftaudit audit {run_dir}`)")
    return stored["verdict"]


def unjudged_reason(verdict: dict) -> str:
    """The one line saying why a run could not be judged, and what to do about it."""
    advice = []
    if verdict.get("check_errors"):
        codes = ", ".join(f'"{c}"' for c in sorted({e["code"] for e in verdict["check_errors"]}))
        advice.append(
            f"a check that fails on this input is a bug in sftaudit: report it; to judge without it, "
            f"disable it in the config ([audit] disable = [{codes}])"
        )
    return f"{verdict['run']}: could not judge: {verdict['cannot_judge']}" + "".join(f"; {a}" for a in advice)
