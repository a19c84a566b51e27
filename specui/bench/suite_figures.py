"""The benchmark's figures from its result rows (plain dicts): speed-up bars per workload,
accepted-length histograms (tokens each step committed), and the time split per step.
Each is written as HTML and, where a Chromium is found, PNG."""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go

from specui.bench.png import html_to_png


def speedup_figure(rows: list[dict], subtitle: str) -> go.Figure:
    fig = go.Figure()
    for workload in dict.fromkeys(r["workload"] for r in rows):
        part = [r for r in rows if r["workload"] == workload]
        fig.add_bar(x=[r["method"] for r in part], y=[r["speedup"] for r in part], name=workload,
                    error_y=dict(type="data", symmetric=False, array=[r["speedup_max"] - r["speedup"] for r in part],
                                 arrayminus=[r["speedup"] - r["speedup_min"] for r in part]),
                    hovertemplate="%{x}: %{y:.2f}x<extra>" + workload + "</extra>")
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    fig.update_layout(title=f"Speed-up over autoregressive (median of rounds, min-max bars): {subtitle}",
                      barmode="group", yaxis_title="tokens/s vs autoregressive", width=1100, height=520,
                      xaxis_tickangle=-30)
    return fig


def lengths_figure(rows: list[dict], subtitle: str) -> go.Figure:
    """Tokens committed per target forward, per step, of our methods (first workload)."""
    workload = rows[0]["workload"] if rows else ""
    fig = go.Figure()
    for r in rows:
        lengths = [n for samples in r.get("rounds", []) for s in samples for n in (s.get("lengths") or [])]
        if r["workload"] != workload or not lengths or r["method"] == "autoregressive":
            continue
        fig.add_histogram(x=lengths, name=r["method"], histnorm="probability", xbins=dict(size=1), opacity=0.6)
    fig.update_layout(title=f"Tokens per step ({workload}): {subtitle}", barmode="overlay", width=1000, height=480,
                      xaxis_title="tokens committed by one target forward", yaxis_title="share of steps")
    return fig


def split_figure(rows: list[dict], subtitle: str) -> go.Figure:
    workload = rows[0]["workload"] if rows else ""
    part = [r for r in rows if r["workload"] == workload and r.get("draft_ms_per_step") is not None]
    fig = go.Figure()
    for key, name, color in (("draft_ms_per_step", "draft", "#9ecae1"), ("verify_ms_per_step", "verify", "#6f42c1"),
                             ("other_ms_per_step", "other", "#dddddd")):
        fig.add_bar(x=[r["method"] for r in part], y=[r[key] for r in part], name=name, marker_color=color)
    fig.update_layout(title=f"Time per step ({workload}): {subtitle}", barmode="stack", yaxis_title="ms per step",
                      width=1000, height=480, xaxis_tickangle=-30)
    return fig


def write_figures(rows: list[dict], out: Path, subtitle: str) -> list[Path]:
    written = []
    for name, build in (("speedup", speedup_figure), ("accepted-lengths", lengths_figure),
                        ("time-split", split_figure)):
        fig = build(rows, subtitle)
        html = out / f"{name}.html"
        fig.write_html(html, include_plotlyjs="cdn")
        written.append(html)
        if html_to_png(fig, out / f"{name}.png"):
            written.append(out / f"{name}.png")
    return written
