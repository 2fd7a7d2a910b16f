"""The HTML audit report: one self-contained offline file rendered from the audited DuckDB file.

The report only presents: it reads the stored verdict and tables, shapes them for
display (downsampling that keeps every spike), and renders; it runs no check and
computes no statistic. plotly.js (its cartesian partial bundle, vendor/README.md) is
inlined once; every figure travels as JSON.
"""

from __future__ import annotations

import re
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Any

import jinja2

from ...checks import registered_checks
from ...checks.base import SEVERITY_RANK
from ...core.terminal import safe_name
from ...store.rundb import connect, load_manifest
from ...verdict.audit import stored_verdict
from . import figures, tables
from .dataset import dataset_context
from .evidence import blocks, check_doc, check_page

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("sftaudit.outputs", "templates"),
    autoescape=True,  # dataset text, token strings and file names are untrusted
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)

# Sections that draw the statistics of one check each (the check's own section links here).
BEHAVIOUR_PANELS = (
    (
        "probe-stability",
        "Probe stability",
        "LOOP-06",
        "Top-k probability spread, entropy and step-to-step KL drift of the next-token distribution on the fixed probe prompts.",
    ),
    (
        "generation-diversity",
        "Generation diversity",
        "LOOP-07",
        "Distinct-1/2 and n-gram repetition of sampled generations on the probe prompts.",
    ),
    (
        "eval-metrics",
        "Eval metrics",
        "LOOP-08",
        "ROUGE-L and BLEU-4 on the frozen eval set, and their rolling correlation.",
    ),
)
MAX_SERIES_PER_CHECK = 12


def anchor(code: str) -> str:
    return "check-" + (re.sub(r"[^A-Za-z0-9_-]+", "-", code) or "unknown")


def checkpoint_anchor(name: str, step: int | None = None) -> str:
    """Names can collide (two runs' `checkpoint-500` in one folder): the step tells them apart."""
    return "ckpt-" + safe_name(name) + ("" if step is None else f"-{step}")


def _fnum(value: Any) -> Any:
    """Numbers at four significant digits for reading; anything else unchanged."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return value


def _fbytes(n: int | None) -> str:
    size = float(n or 0)
    if size < 1024:
        return f"{size:.0f} B"
    for unit in ("KB", "MB"):
        size /= 1024
        if size < 1024:
            return f"{size:.1f} {unit}"
    return f"{size / 1024:.1f} GB"


_ENV.filters["num"] = _fnum
_ENV.filters["bytes"] = _fbytes
_ENV.globals["checkpoint_anchor"] = checkpoint_anchor
# Colour is never the only signal: each status has a word and an icon beside its colour.
_ENV.globals["LABELS"] = {
    "pass": "PASS",
    "warn": "WARN",
    "fail": "FAIL",
    "info": "INFO",
    "notrun": "NOT RUN",
    "disabled": "OFF",
    "partial": "PARTIAL",
    "error": "COULD NOT RUN",
    "unjudged": "COULD NOT JUDGE",
    "unsaved": "NOT SAVED",
}
_ENV.globals["ICONS"] = {
    "pass": "✓",
    "warn": "▲",
    "fail": "✕",
    "info": "i",
    "notrun": "–",
    "disabled": "○",
    "partial": "◐",
    "error": "!",
    "unjudged": "?",
    "unsaved": "○",
}
STRIP_LABELLED = 40  # checkpoint windows drawn with their names; more are drawn narrow and scroll


@cache
def plotly_js() -> str:
    """plotly.js with only the cartesian trace types the report draws (1.5 MB, not the full 4.8 MB)."""
    return (files(__package__) / "vendor" / "plotly-cartesian.min.js").read_text(encoding="utf-8")


def write_report(run_dir: str | Path, out_dir: str | Path) -> Path:
    """Render RUN_DIR's audited DuckDB file to OUT_DIR/report.html (no check is re-run)."""
    verdict = stored_verdict(run_dir)
    con = connect(run_dir, read_only=True)
    try:
        manifest = load_manifest(con)
        if manifest.get("profile") == "preflight":  # a dataset, not a training run
            template, context = "dataset.html.j2", _dataset(con, verdict, manifest)
        else:
            template, context = "report.html.j2", _context(con, verdict)
    finally:
        con.close()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    html = _ENV.get_template(template).render(plotly_js=plotly_js(), **context)
    path = out_dir / "report.html"
    path.write_text(html, encoding="utf-8")
    return path


def write_diff_report(result: dict[str, Any], out_dir: str | Path) -> Path:
    """`sftaudit diff`'s result (sftaudit.commands.diff.compare) as OUT_DIR/diff.html."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "diff.html"
    path.write_text(_ENV.get_template("diff.html.j2").render(d=result), encoding="utf-8")
    return path


def report_figures(con, verdict: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The training report's figures (plotly JSON by div id), for a notebook to show the same lanes."""
    return _context(con, verdict)["figures"]


def _findings(verdict: dict[str, Any]) -> list[dict[str, Any]]:
    """The verdict's findings with their anchors, evidence blocks and window: the steps a finding
    on imported logs (or between two checkpoints) can stand for, when that is more than one step."""
    out = []
    for i, f in enumerate(verdict["findings"]):
        resolution = (f.get("evidence") or {}).get("resolution") or {}
        window = (
            resolution
            if isinstance(resolution, dict)
            and resolution.get("last_step") is not None
            and resolution.get("first_step") != resolution.get("last_step")
            else None
        )
        out.append(
            dict(
                f,
                index=i,
                anchor=f"finding-{i}",
                blocks=blocks(f.get("evidence")),
                window=window,
                category=f.get("category", "anomaly"),
            )
        )
    return out


def _context(con, verdict: dict[str, Any]) -> dict[str, Any]:
    manifest = load_manifest(con)
    findings = _findings(verdict)
    finding_steps = sorted({f["step"] for f in findings if f["step"] is not None})
    figs: dict[str, dict[str, Any]] = {}

    steps = {
        "loss": tables.envelope(con, "SELECT seg, step, loss AS value FROM steps WHERE rank = 0", [], finding_steps),
        "lr": tables.envelope(con, "SELECT seg, step, lr AS value FROM steps WHERE rank = 0", [], finding_steps),
        "grad_norm": tables.envelope(
            con, "SELECT seg, step, grad_norm AS value FROM steps WHERE rank = 0", [], finding_steps
        ),
        "eval_loss": tables.envelope(
            con,
            "SELECT seg, step, value FROM metrics WHERE rank = 0 AND name IN ('eval_loss', 'eval/loss')",
            [],
            finding_steps,
        ),
    }
    if steps["loss"].height or findings:
        figs["timeline"] = figures.timeline(
            steps, verdict["findings"], shown_checkpoints(verdict), verdict["first_anomalous_step"]
        )
    lanes = tables.rank_lanes(con, finding_steps)
    if lanes:
        figs["ranks"] = figures.rank_lanes(lanes, finding_steps)
    matrix = tables.gradient_matrix(con)
    if matrix is not None:
        figs["grad-heatmap"] = figures.gradient_heatmap(matrix)
    histograms = []
    for h in tables.histogram_steps(con, finding_steps):
        div = f"grad-hist-{h['step']}"
        figs[div] = figures.histogram_heatmap(h["step"], h["reason"], h["frame"])
        histograms.append({"div": div, "step": h["step"], "reason": h["reason"]})

    series_divs, series_values = _series_figures(con, findings, figs)
    checks = _checks(
        findings, verdict.get("check_errors") or [], verdict.get("checks") or [], series_divs, series_values
    )
    return {
        "verdict": verdict,
        "run_info": _run_info(manifest),
        "findings": findings,
        "first_causes": _first_causes(findings, verdict["first_anomalous_step"]),
        "evidence_lines": _evidence_lines(verdict, checks),
        "chain": verdict.get("first_anomaly_chain"),
        "first_window": (verdict.get("resolution") or {}).get("first_anomalous_window"),
        **strip_context(verdict, findings, con),
        "checks": checks,
        "checkpoints": shown_checkpoints(verdict),
        "behaviour": [
            {
                "id": pid,
                "title": title,
                "code": code,
                "about": about,
                "div": series_divs.get(code),
                "points": series_values.get(code, []),
                "check_anchor": anchor(code),
                "why": next((c["why"] for c in checks if c["code"] == code), None),
            }
            for pid, title, code, about in BEHAVIOUR_PANELS
        ],
        "behaviour_codes": [code for _, _, code, _ in BEHAVIOUR_PANELS],
        "histograms": histograms,
        "rank_lanes": [{"title": lane["title"], "per_rank": lane["per_rank"]} for lane in lanes],
        "has_grad_norms": matrix is not None,
        "heatmap_width": matrix["width"] if matrix else 1,
        "figures": figs,
        "summary": tables.run_summary(con),
    }


def _dataset(con, verdict: dict[str, Any], manifest: dict[str, Any]) -> dict[str, Any]:
    findings = _findings(verdict)
    checks = _checks(findings, verdict.get("check_errors") or [], verdict.get("checks") or [], {}, {})
    return {"verdict": verdict, **dataset_context(con, manifest, checks, findings)}


def _run_info(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest fields the Run section shows (older or foreign manifests may lack any of them)."""
    params = manifest.get("params") or []
    tokenizer = manifest.get("tokenizer") or {}
    return {
        "run_id": manifest.get("run_id"),
        "model": (manifest.get("model") or {}).get("class") or "not recorded",
        "tensors": len(params),
        "parameters": sum(p.get("numel") or 0 for p in params),
        "tokenizer": {
            "class": tokenizer.get("class"),
            "length": tokenizer.get("length"),
            "fingerprint": tokenizer.get("fingerprint"),
        }
        if tokenizer
        else None,
        "profile": manifest.get("profile") or "not recorded",
        "world_size": manifest.get("world_size"),
        "versions": manifest.get("versions") or {},
    }


def _series_figures(
    con, findings: list[dict[str, Any]], figs: dict[str, dict[str, Any]]
) -> tuple[dict[str, str], dict[str, list[dict[str, Any]]]]:
    """One panel per check code that stored statistics of two points or more; returns code -> figure
    div id, and code -> the statistics of one point, shown as values (a chart of one point draws an
    axis around nothing)."""
    if not tables.has_table(con, "series"):
        return {}, {}
    sole = "bool_or(sole_condition)" if tables.has_column(con, "series", "sole_condition") else "false"
    names = con.execute(
        f"""SELECT code, name, any_value(threshold), {sole}, count(*), any_value(step), any_value(value) FROM series
            GROUP BY code, name ORDER BY code, min(rowid)"""
    ).fetchall()
    by_code: dict[str, dict[str, dict[str, Any]]] = {}
    values: dict[str, list[dict[str, Any]]] = {}
    for code, name, threshold, alone, points, step, value in names:
        if points == 1:
            values.setdefault(code, []).append(
                {"name": name, "step": step, "value": value, "threshold": threshold, "sole_condition": alone}
            )
            continue
        panel = by_code.setdefault(code, {})
        if len(panel) < MAX_SERIES_PER_CHECK:
            steps = sorted({f["step"] for f in findings if f["code"] == code and f["step"] is not None})
            frame = tables.envelope(
                con, "SELECT 0 AS seg, step, value FROM series WHERE code = ? AND name = ?", [code, name], steps
            )
            panel[name] = {"frame": frame, "threshold": threshold, "sole_condition": alone}
    divs = {}
    for code, panel in by_code.items():
        steps = sorted({f["step"] for f in findings if f["code"] == code and f["step"] is not None})
        divs[code] = "series-" + anchor(code)
        figs[divs[code]] = figures.series_panel(code, panel, steps)
    return divs, values


def _checks(
    findings: list[dict[str, Any]],
    errors: list[dict[str, str]],
    coverage: list[dict[str, Any]],
    series_divs: dict[str, str],
    series_values: dict[str, list[dict[str, Any]]],
) -> list[dict[str, Any]]:
    """Every check with its status as the verdict states it: a check that did not run, or ran on
    partial evidence, says so (with the reason) and never shows as passing."""
    registered = {c.code: c for c in registered_checks()}
    codes = sorted(set(registered) | {f["code"] for f in findings} | {e["code"] for e in errors})
    out = []
    for code in codes:
        cls = registered.get(code)
        own = [f for f in findings if f["code"] == code]
        error = next((e["error"] for e in errors if e["code"] == code), None)
        covered = next((c for c in coverage if c["code"] == code), {})
        ran = covered.get("status", "ran")
        if error:
            status = "error"
        elif own:
            status = max((f["severity"] for f in own), key=SEVERITY_RANK.__getitem__)
        else:
            status = {"not_run": "notrun", "disabled": "disabled", "partial": "partial"}.get(ran, "pass")
        reason = covered.get("reason")
        out.append(
            {
                "code": code,
                "anchor": anchor(code),
                "name": cls.name if cls else "(check not installed)",
                "doc": check_doc(cls) if cls else None,
                "page": check_page(cls.code) if cls else None,
                "defaults": dict(cls.defaults) if cls else {},
                "status": status,
                "error": error,
                "findings": own,
                "coverage": ran,
                "reason": reason,
                "why": (
                    f"not run: {reason}"
                    if ran in ("not_run", "disabled")
                    else f"partial evidence: {reason}"
                    if ran == "partial"
                    else None
                ),
                "evidence": covered.get("evidence") or [],
                "sources": covered.get("sources") or [],
                "series_div": series_divs.get(code),
                "series_values": series_values.get(code, []),
            }
        )
    return out


def _evidence_lines(verdict: dict[str, Any], checks: list[dict[str, Any]]) -> list[str]:
    """What the verdict rests on, as the verdict records it: steps per rank, where the evidence
    came from (recorded by the shim or imported), components switched off mid-run, checks not run."""
    evidence = verdict.get("evidence") or {}
    lines = []
    ranks = evidence.get("ranks") or []
    if ranks:
        counts = {(r["steps"], r["first_step"], r["last_step"]) for r in ranks}
        if len(counts) == 1:
            n, lo, hi = counts.pop()
            where = f" (steps {lo}..{hi})" if n else ""
            lines.append(
                f"{n} step{'s' * (n != 1)} recorded{where}"
                + (f" on each of {len(ranks)} ranks" if len(ranks) > 1 else "")
            )
        else:
            lines.append(
                "steps recorded per rank: "
                + ", ".join(
                    f"rank {r['rank']} {r['steps']}" + (f" ({r['first_step']}..{r['last_step']})" if r["steps"] else "")
                    for r in ranks
                )
            )
    sources = sorted({src for c in checks for src in c["sources"]})
    if sources:
        lines.append("evidence from: " + "; ".join(sources))
    resolution = verdict.get("resolution") or {}
    if resolution.get("kind") == "logging window":
        lines.append(
            f"imported logs written every {resolution.get('logging_steps')} steps: a finding at a logged "
            "step is known only to its logging window"
        )
    lines += list(evidence.get("partial") or [])  # components switched off mid-run (from the start: cannot_judge)
    skipped = [c["code"] for c in checks if c["coverage"] == "not_run"]
    if skipped:
        lines.append(
            f"{len(skipped)} check{'s' * (len(skipped) != 1)} not run for lack of evidence: " + ", ".join(skipped)
        )
    return lines


def _first_causes(findings: list[dict[str, Any]], first: int | None) -> list[dict[str, Any]]:
    """The most severe findings at the first anomalous step: the one-sentence cause at the top."""
    # As the verdict dates the run: anomalies about the run (a checkpoint's own finding is about that file).
    at_first = [
        f
        for f in findings
        if first is not None
        and f["step"] == first
        and f["severity"] != "info"
        and f["category"] == "anomaly"
        and f.get("scope", "run") == "run"
    ]
    top = max((SEVERITY_RANK[f["severity"]] for f in at_first), default=0)
    return [f for f in at_first if SEVERITY_RANK[f["severity"]] == top]


def shown_checkpoints(verdict: dict[str, Any]) -> list[dict[str, Any]]:
    """The checkpoints in step order with the verdict to show: under a run that could not be judged
    (a check raised, too little evidence) a checkpoint's "pass" is no judgement, shown as such."""
    unjudged = verdict.get("verdict") == "unjudged"
    return [
        dict(c, verdict="unjudged" if unjudged and c["verdict"] == "pass" else c["verdict"])
        for c in sorted(verdict["checkpoints"], key=lambda c: c["step"])
    ]


def strip_context(verdict: dict[str, Any], findings: list[dict[str, Any]], con) -> dict[str, Any]:
    """The strip, whether it is too dense to label each window, and the failing checkpoints
    (listed by name under a dense strip, so every one stays visible)."""
    strip = _checkpoint_strip(verdict, findings, con)
    return {
        "strip": strip,
        "strip_dense": len(strip) > STRIP_LABELLED,
        "failing_checkpoints": [w for w in strip if w["verdict"] == "fail" and w["anchor"]],
    }


def _checkpoint_strip(verdict: dict[str, Any], findings: list[dict[str, Any]], con) -> list[dict[str, Any]]:
    """Checkpoint windows along the step axis, each as wide as the steps it covers."""
    last = tables.first_row(con, "SELECT max(step) FROM steps WHERE rank = 0")[0]
    start = 0
    windows = []
    for c in shown_checkpoints(verdict):
        windows.append(
            {
                "name": c["name"],
                "step": c["step"],
                "from": start + 1,
                "to": c["step"],
                "verdict": c["verdict"],
                "count": len(c["findings"]),
                "anchor": checkpoint_anchor(c["name"], c["step"]),
            }
        )
        start = c["step"]
    if last is not None and last > start:
        # Steps after the last save: never green, nothing of them can be rolled back to (warn/fail show as such).
        tail = [f for f in findings if f["checkpoint"] is None and f["step"] is not None and f["step"] > start]
        rank = max((SEVERITY_RANK[f["severity"]] for f in tail), default=0)
        windows.append(
            {
                "name": "not saved",
                "step": None,
                "from": start + 1,
                "to": last,
                "verdict": ("unsaved", "warn", "fail")[rank],
                "count": len(tail),
                "anchor": None,
            }
        )
    total = sum(w["to"] - w["from"] + 1 for w in windows) or 1
    for w in windows:
        w["width"] = 100 * (w["to"] - w["from"] + 1) / total
    return windows
