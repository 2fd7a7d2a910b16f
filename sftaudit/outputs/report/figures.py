"""plotly figures built from the report's tables, as plain JSON for the template to embed.

Untrusted strings (tensor names, messages, codes) pass through `escape.html.text` before they
go into a figure: plotly renders a subset of HTML in labels and hover text, and an escaped
string shows as the literal text, its control and bidi characters as their escapes.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ...core.artifacts import GRAD_HIST_EDGES
from ..escape.html import text

SEVERITY_COLOURS = {"info": "#607d8b", "warn": "#ed6c02", "fail": "#c62828", "pass": "#2e7d32"}
SEVERITY_SYMBOLS = {"info": "circle", "warn": "triangle-up", "fail": "x"}  # not colour alone
_BASE_LAYOUT = dict(
    template="none",
    font=dict(family="system-ui, sans-serif", size=12),
    margin=dict(l=60, r=20, t=30, b=40),
    hovermode="closest",
    legend=dict(orientation="h", y=1.02, yanchor="bottom", x=0),
)


def as_json(fig: go.Figure) -> dict[str, Any]:
    """Plain JSON (numpy arrays as plotly's base64 typed arrays, NaN as gaps)."""
    return json.loads(fig.to_json())


def _xy(frame) -> tuple[np.ndarray, np.ndarray]:
    return frame["step"].to_numpy().astype(np.int32), frame["value"].to_numpy().astype(np.float32)


def _lines(fig: go.Figure, frame, name: str, colour: str, row: int | None = None, **kw: Any) -> None:
    """One trace per run segment (a resumed run restarts its steps), one legend entry."""
    kw.setdefault("mode", "lines")
    for i, seg in enumerate(sorted(set(frame["seg"].to_list()))):
        x, y = _xy(frame.filter(frame["seg"] == seg))
        trace = go.Scatter(
            x=x,
            y=y,
            name=name,
            line=dict(color=colour, width=1.3),
            legendgroup=name,
            showlegend=i == 0,
            hovertemplate=f"{text(name)} %{{y:.4g}}<extra>step %{{x}}</extra>",
            **kw,
        )
        fig.add_trace(trace, row=row, col=1 if row else None)


def timeline(
    steps: dict[str, Any],
    findings: list[dict[str, Any]],
    checkpoints: list[dict[str, Any]],
    first_anomalous_step: int | None,
) -> dict[str, Any]:
    """Findings lane, loss (train and eval), learning rate and global gradient norm on one step axis."""
    stepped = [(i, f) for i, f in enumerate(findings) if f["step"] is not None]
    lane = 1 if stepped else 0  # the findings lane is only drawn when some finding has a step
    fig = make_subplots(
        rows=3 + lane,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.03,
        row_heights=([0.16] if lane else []) + [0.38, 0.14, 0.32],
    )
    codes = sorted({f["code"] for _, f in stepped})
    for severity in ("info", "warn", "fail"):
        hits = [(i, f) for i, f in stepped if f["severity"] == severity]
        if hits:
            fig.add_trace(
                go.Scatter(
                    x=[f["step"] for _, f in hits],
                    y=[text(f["code"]) for _, f in hits],
                    mode="markers",
                    name=f"{severity} finding",
                    marker=dict(
                        color=SEVERITY_COLOURS[severity],
                        size=13,
                        symbol=SEVERITY_SYMBOLS[severity],
                        line=dict(color="#fff", width=1),
                    ),
                    customdata=[f"finding-{i}" for i, _ in hits],
                    hovertext=[f"step {f['step']}: {text(_shorten(f['message']))}" for _, f in hits],
                    hovertemplate="%{hovertext}<extra>click for evidence</extra>",
                ),
                row=1,
                col=1,
            )
    _lines(fig, steps["loss"], "train loss", "#1f77b4", row=1 + lane)
    if steps["eval_loss"].height:
        _lines(fig, steps["eval_loss"], "eval loss", "#9467bd", row=1 + lane, mode="lines+markers")
    _lines(fig, steps["lr"], "learning rate", "#2ca02c", row=2 + lane)
    _lines(fig, steps["grad_norm"], "gradient norm", "#d62728", row=3 + lane)
    shapes = [_vline(c["step"], SEVERITY_COLOURS.get(c["verdict"], "#888"), "dot") for c in checkpoints]
    if first_anomalous_step is not None:
        shapes.append(_vline(first_anomalous_step, SEVERITY_COLOURS["fail"], "solid", width=2))
        fig.add_annotation(
            x=first_anomalous_step,
            y=1,
            xref="x",
            yref="paper",
            yanchor="bottom",
            xanchor="right",
            text="first anomaly",
            showarrow=False,
            font=dict(color=SEVERITY_COLOURS["fail"]),
        )
    if lane:  # a fixed margin fits the LOOP-NN codes: automargin would draw the whole figure twice
        fig.update_yaxes(type="category", categoryorder="array", categoryarray=[text(c) for c in codes], row=1, col=1)
    fig.update_yaxes(title_text="loss", **_autoscale(steps["loss"], steps["eval_loss"]), row=1 + lane, col=1)
    fig.update_yaxes(title_text="lr", exponentformat="e", **_autoscale(steps["lr"]), row=2 + lane, col=1)
    fig.update_yaxes(title_text="grad norm", **_autoscale(steps["grad_norm"]), row=3 + lane, col=1)
    fig.update_xaxes(title_text="step", row=3 + lane, col=1)
    fig.update_layout(**_BASE_LAYOUT, height=480 + 80 * lane, shapes=shapes)
    fig.update_layout(margin=dict(l=72))
    return as_json(fig)


def gradient_heatmap(matrix: dict[str, Any]) -> dict[str, Any]:
    """Tensor x step heatmap of log10 of the largest gradient norm per step bucket."""
    tensors = [text(t) for t in matrix["tensors"]]
    steps = matrix["bucket_steps"].astype(np.int32)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(matrix["norm"] > 0, np.log10(matrix["norm"]), np.nan).astype(np.float32)
    span = f"{matrix['width']} steps from %{{x}}" if matrix["width"] > 1 else "step %{x}"
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=steps,
            y=tensors,
            colorscale="Viridis",
            colorbar=dict(title=dict(text="log10 norm"), thickness=12),
            hovertemplate=f"%{{y}}<br>{span}<br>log10 max norm %{{z:.2f}}<extra></extra>",
            name="gradient norm",
        )
    )
    rows, cols = matrix["nonfinite_cells"]
    if len(rows):
        fig.add_trace(
            go.Scatter(
                x=steps[cols],
                y=[tensors[r] for r in rows],
                mode="markers",
                name="non-finite",
                marker=dict(symbol="x-thin", size=9, line=dict(color="#ff1744", width=2)),
                hovertemplate="%{y}<br>step %{x}: non-finite gradient<extra></extra>",
            )
        )
    fig.update_layout(**_BASE_LAYOUT, height=min(900, 140 + 16 * len(tensors)))
    fig.update_layout(margin=dict(l=20), showlegend=bool(len(rows)))
    fig.update_yaxes(autorange="reversed", automargin=True, tickfont=dict(size=10))
    fig.update_xaxes(title_text="step")
    return as_json(fig)


def histogram_heatmap(step: int, reason: str, frame) -> dict[str, Any]:
    """One step's per-tensor gradient histograms: share of each tensor's elements per log10|g| bin."""
    counts = np.array(frame["counts"].to_list(), dtype=np.float64)
    table = np.column_stack([frame["zeros"].to_numpy(), counts, frame["nonfinite"].to_numpy()]).astype(np.float64)
    totals = table.sum(axis=1, keepdims=True)
    share = np.divide(table, totals, out=np.zeros_like(table), where=totals > 0).astype(np.float32)
    bins = ["zero"] + [f"1e{e:g}" for e in GRAD_HIST_EDGES[:-1]] + ["non-finite"]
    tensors = [text(t) for t in frame["tensor"].to_list()]
    fig = go.Figure(
        go.Heatmap(
            z=share,
            x=bins[: share.shape[1]],
            y=tensors,
            colorscale="Blues",
            zmin=0,
            zmax=1,
            customdata=table.astype(np.int64),
            colorbar=dict(title=dict(text="share"), thickness=12),
            hovertemplate="%{y}<br>|g| bin %{x}: %{customdata} elements (%{z:.1%})<extra></extra>",
        )
    )
    fig.update_layout(
        **_BASE_LAYOUT,
        height=min(700, 140 + 14 * len(tensors)),
        title=dict(text=f"step {step} ({text(reason)})", font=dict(size=13)),
    )
    fig.update_layout(margin=dict(l=20, t=40))
    fig.update_yaxes(autorange="reversed", automargin=True, tickfont=dict(size=10))
    decades = [
        b for b, e in zip(bins[1:], GRAD_HIST_EDGES) if e == int(e) and int(e) % 2 == 0 and e > GRAD_HIST_EDGES[0]
    ]
    fig.update_xaxes(
        title_text="|gradient| bin (lower edge)",
        type="category",
        tickmode="array",
        tickvals=["zero", *decades, "non-finite"],
        tickangle=0,
    )
    return as_json(fig)


# A threshold whose crossing alone fires the check is drawn red; one that is one condition of several
# (a spike must also be large against the other tensors, a KL drift also large against its own baseline)
# is drawn grey and labelled so: a line crossed without a finding is not a check that missed.
CONDITION_COLOUR = "#757575"


def series_panel(code: str, series: dict[str, dict[str, Any]], finding_steps: list[int]) -> dict[str, Any]:
    """A check's stored statistics, one row per statistic, each with its threshold."""
    names = list(series)
    fig = make_subplots(
        rows=len(names),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.12 / max(1, len(names)),
        subplot_titles=[text(n) for n in names],
    )
    shapes = [_vline(step, SEVERITY_COLOURS["warn"], "dot") for step in finding_steps[:50]]
    for row, name in enumerate(names, start=1):
        s = series[name]
        _lines(
            fig,
            s["frame"],
            name,
            "#1f77b4",
            row=row,
            mode="lines+markers" if s["frame"].height < 60 else "lines",
            marker=dict(size=4),
        )
        if s["threshold"] is not None:
            axis = "" if row == 1 else str(row)
            colour, label = (
                (SEVERITY_COLOURS["fail"], f"threshold {s['threshold']:.4g}")
                if s["sole_condition"]
                else (CONDITION_COLOUR, f"threshold {s['threshold']:.4g}, one condition of several")
            )
            shapes.append(
                dict(
                    type="line",
                    xref=f"x{axis} domain",
                    x0=0,
                    x1=1,
                    yref=f"y{axis}",
                    y0=s["threshold"],
                    y1=s["threshold"],
                    line=dict(color=colour, dash="dash", width=1),
                )
            )
            fig.add_annotation(
                xref=f"x{axis} domain",
                x=1,
                yref=f"y{axis}",
                y=s["threshold"],
                showarrow=False,
                xanchor="right",
                yanchor="bottom",
                text=label,
                font=dict(size=10, color=colour),
            )
    fig.update_xaxes(title_text="step", row=len(names), col=1)
    fig.update_layout(**_BASE_LAYOUT, height=80 + 170 * len(names), showlegend=False, shapes=shapes)
    return as_json(fig)


def _autoscale(*frames) -> dict[str, Any]:
    """A lane's y axis fitted to its own values: log where positive values span two decades or
    more, and a visible band around a constant (plotly's autorange draws a flat line at an
    arbitrary place; a constant LR of 3e-3 read as 0)."""
    values = np.concatenate([f["value"].to_numpy().astype(np.float64) for f in frames if f.height] or [np.zeros(0)])
    values = values[np.isfinite(values)]
    if not len(values):
        return {}
    lo, hi = float(values.min()), float(values.max())
    if lo > 0 and hi / lo >= 100:
        return {"type": "log"}
    if lo == hi:
        pad = abs(lo) * 0.5 or 1.0
        return {"type": "linear", "range": [lo - pad, hi + pad]}
    return {"type": "linear"}


def _vline(step: int, colour: str, dash: str, width: float = 1) -> dict[str, Any]:
    """A vertical line across every subplot (plotly's add_vline is slow with many lines and rows)."""
    return dict(
        type="line",
        xref="x",
        x0=step,
        x1=step,
        yref="paper",
        y0=0,
        y1=1,
        line=dict(color=colour, dash=dash, width=width),
    )


def _shorten(message: str, limit: int = 160) -> str:
    return message if len(message) <= limit else message[: limit - 1] + "…"


def sample_histogram(frame, xtitle: str, colour: str) -> dict[str, Any]:
    """Samples per bin of a per-sample count (tokens per sample, trained tokens per sample)."""
    low, high = frame["low"].to_numpy().astype(np.int64), frame["high"].to_numpy().astype(np.int64)
    labels = [f"{a}" if a == b else f"{a}-{b}" for a, b in zip(low.tolist(), high.tolist())]
    fig = go.Figure(
        go.Bar(
            x=(low + high) / 2,
            y=frame["samples"].to_numpy().astype(np.int64),
            width=np.maximum(high - low + 1, 1) * 0.95,
            marker=dict(color=colour),
            customdata=labels,
            hovertemplate="%{customdata} tokens: %{y} samples<extra></extra>",
        )
    )
    fig.update_layout(**_BASE_LAYOUT, height=260, showlegend=False, bargap=0)
    fig.update_xaxes(title_text=xtitle)
    fig.update_yaxes(title_text="samples")
    return as_json(fig)


RANK_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")


def rank_lanes(lanes: list[dict[str, Any]], finding_steps: list[int]) -> dict[str, Any]:
    """One lane per metric: a line per rank where the ranks differ, one line where every rank recorded
    the same; a red cross where a rank's value is not finite (drawn at the top of its lane)."""
    fig = make_subplots(rows=len(lanes), cols=1, shared_xaxes=True, vertical_spacing=0.06)
    legend_shown: set[str] = set()
    for row, lane in enumerate(lanes, start=1):
        for rank, frame in lane["frames"].items():
            name = f"rank {rank}" if lane["per_rank"] else f"all {len(lane['ranks'])} ranks (equal)"
            colour = RANK_COLOURS[rank % len(RANK_COLOURS)] if lane["per_rank"] else "#555"
            for seg in sorted(set(frame["seg"].to_list())):
                x, y = _xy(frame.filter(frame["seg"] == seg))
                fig.add_trace(
                    go.Scatter(
                        x=x,
                        y=y,
                        name=name,
                        legendgroup=name,
                        showlegend=name not in legend_shown,
                        mode="lines+markers" if frame.height < 60 else "lines",
                        marker=dict(size=4),
                        line=dict(color=colour, width=1.3),
                        hovertemplate=f"{name}: {text(lane['title'])} %{{y:.4g}}<extra>step %{{x}}</extra>",
                    ),
                    row=row,
                    col=1,
                )
                legend_shown.add(name)
        bad = lane["nonfinite"]
        if bad.height:
            finite = [f["value"].max() for f in lane["frames"].values() if f.height]
            top = max(finite) if finite else 0.0
            fig.add_trace(
                go.Scatter(
                    x=bad["step"].to_numpy().astype(np.int32),
                    y=np.full(bad.height, top, dtype=np.float32),
                    mode="markers",
                    name="not finite",
                    legendgroup="not finite",
                    showlegend="not finite" not in legend_shown,
                    marker=dict(symbol="x", size=12, color=SEVERITY_COLOURS["fail"]),
                    hovertext=[f"rank {r}: {text(lane['title'])} {v}" for r, v in zip(bad["rank"], bad["value"])],
                    hovertemplate="%{hovertext}<extra>step %{x}</extra>",
                ),
                row=row,
                col=1,
            )
            legend_shown.add("not finite")
        fig.update_yaxes(title_text=text(lane["title"]), **_autoscale(*lane["frames"].values()), row=row, col=1)
    fig.update_xaxes(title_text="step", row=len(lanes), col=1)
    shapes = [_vline(step, SEVERITY_COLOURS["warn"], "dot") for step in finding_steps[:50]]
    fig.update_layout(**_BASE_LAYOUT, height=120 + 170 * len(lanes), shapes=shapes)
    return as_json(fig)
