"""The analyzer pipeline: ingest -> checks -> attribution/verdict -> stored in DuckDB."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .checks import AuditContext, Finding, registered_checks
from .config import AuditConfig
from .errors import InputError
from .ingest import connect, first_row, ingest, load_manifest
from .verdict import build_verdict, checkpoint_name


def run_checks(ctx: AuditContext, config: AuditConfig) -> tuple[list[Finding], list[dict[str, str]]]:
    """Every registered, enabled check; a check that crashes is reported, not fatal."""
    findings, errors = [], []
    for check_cls in registered_checks():
        if check_cls.code in config.disabled:
            continue
        try:
            check = check_cls(**config.check_options.get(check_cls.code, {}))
        except ValueError as exc:
            raise InputError(str(exc)) from None
        try:
            findings += check.run(ctx)
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
            errors.append({"code": check_cls.code, "error": f"{type(exc).__name__}: {exc}"})
    return findings, errors


def saved_checkpoints(ctx: AuditContext) -> list[dict[str, Any]]:
    rows = ctx.con.execute(
        "SELECT max(step), path FROM checkpoints WHERE event = 'saved' AND rank = 0 GROUP BY path ORDER BY 1"
    ).fetchall()
    return [{"name": checkpoint_name(path), "step": step, "path": path} for step, path in rows]


def audit(run_dir: str | Path, config: AuditConfig | None = None) -> dict[str, Any]:
    """Ingest what is new, run the checks, store findings + verdict in DuckDB; return the verdict."""
    run_dir = Path(run_dir)
    ingest(run_dir)
    con = connect(run_dir)
    try:
        return judge(con, run_dir, config or AuditConfig())
    finally:
        con.close()


def judge(con, run_dir: Path, config: AuditConfig) -> dict[str, Any]:
    """Run the checks on an ingested database, store findings + verdict + series in it."""
    manifest = load_manifest(con)
    ctx = AuditContext(con, run_dir, manifest)
    findings, errors = run_checks(ctx, config)
    verdict = build_verdict(manifest.get("run_id") or run_dir.name, findings, saved_checkpoints(ctx), errors,
                            config.rollback_margin)
    con.execute("CREATE OR REPLACE TABLE audit_verdict (verdict JSON)")
    con.execute("INSERT INTO audit_verdict VALUES (?)", [json.dumps(verdict)])
    con.execute("""CREATE OR REPLACE TABLE findings (code VARCHAR, severity VARCHAR, step BIGINT,
                   checkpoint VARCHAR, message VARCHAR, evidence JSON)""")
    rows = [(f["code"], f["severity"], f["step"], f["checkpoint"], f["message"], json.dumps(f["evidence"]))
            for f in verdict["findings"]]
    if rows:
        con.executemany("INSERT INTO findings VALUES (?, ?, ?, ?, ?, ?)", rows)
    _store_series(con, ctx.series)
    return verdict


def _store_series(con, series: list[dict[str, Any]]) -> None:
    con.execute("""CREATE OR REPLACE TABLE series (code VARCHAR, name VARCHAR, step BIGINT, value DOUBLE,
                   threshold DOUBLE)""")
    for s in series:
        con.execute(
            "INSERT INTO series SELECT ?, ?, unnest(?::BIGINT[]), unnest(?::DOUBLE[]), ?",
            [s["code"], s["name"], s["steps"], s["values"], s["threshold"]],
        )


def stored_verdict(run_dir: str | Path) -> dict[str, Any]:
    con = connect(run_dir, read_only=True)
    try:
        row = first_row(con, "SELECT verdict FROM audit_verdict") if _has_table(con, "audit_verdict") else None
    finally:
        con.close()
    if row is None:
        raise InputError(f"{run_dir}: not audited yet (run `sftaudit audit {run_dir}`)")
    return json.loads(row[0])


def _has_table(con, name: str) -> bool:
    return bool(first_row(con, "SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [name])[0])
