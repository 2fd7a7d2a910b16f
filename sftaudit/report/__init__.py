"""The HTML audit report: one self-contained offline file rendered from the audited DuckDB file.

The report only presents: it reads the stored verdict and tables, shapes them for
display, and renders; it runs no check and computes no statistic.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jinja2
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from ..audit import stored_verdict
from ..checks import registered_checks
from ..ingest import connect, load_manifest

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("sftaudit", "templates"),
    autoescape=True,  # dataset text, token strings and file names are untrusted
    undefined=jinja2.StrictUndefined,
)


def safe_name(name: str) -> str:
    """A run id as a single safe path component (run ids come from untrusted artifacts)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "run"
    return cleaned[:100]


def write_report(run_dir: str | Path, out_dir: str | Path) -> Path:
    verdict = stored_verdict(run_dir)
    con = connect(run_dir, read_only=True)
    try:
        manifest = load_manifest(con)
        steps = con.sql("SELECT step, loss, lr, grad_norm FROM steps WHERE rank = 0 ORDER BY seg, step").pl()
        shim_errors = con.sql(
            "SELECT step, probe, error FROM events WHERE kind = 'shim_error' ORDER BY time").pl().to_dicts()
    finally:
        con.close()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    html = _ENV.get_template("report.html.j2").render(
        verdict=verdict,
        manifest=manifest,
        checks=[{"code": c.code, "name": c.name, "doc": (c.__doc__ or "").strip()} for c in registered_checks()],
        timeline=_timeline(steps, verdict),
        shim_errors=shim_errors,
        plotly_js=get_plotlyjs(),
    )
    path = out_dir / "report.html"
    path.write_text(html, encoding="utf-8")
    return path


def _timeline(steps: Any, verdict: dict) -> dict:
    fig = go.Figure()
    for column in ("loss", "grad_norm"):
        fig.add_trace(go.Scatter(x=steps["step"].to_list(), y=steps[column].to_list(), name=column, mode="lines"))
    for c in verdict["checkpoints"]:
        fig.add_vline(x=c["step"], line_dash="dot", line_color="#888")
    fig.update_layout(height=320, margin=dict(l=40, r=10, t=10, b=30), yaxis_type="log")
    return json.loads(fig.to_json())  # plain JSON types; the template embeds it with |tojson
