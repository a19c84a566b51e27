"""The benchmark's figures from its result rows (plain dicts): speed-up bars per workload,
accepted-length histograms (tokens each step committed), and the time split per step.
Each is written as HTML and, where a Chromium is found, PNG."""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go

from specui.bench.png import save_figure


def group(row: dict) -> str:
    """A row's bar group: its workload, and its target quantization where it has one."""
    quant = row.get("quantization", "none")
    return row["workload"] if quant == "none" else f"{row['workload']} · {quant}"


def _bars(rows: list[dict], key: str, unit: str) -> go.Figure:
    fig = go.Figure()
    for name in dict.fromkeys(group(r) for r in rows):
        part = [r for r in rows if group(r) == name]
        fig.add_bar(x=[r["method"] for r in part], y=[r[key] for r in part], name=name,
                    error_y=dict(type="data", symmetric=False, array=[r[f"{key}_max"] - r[key] for r in part],
                                 arrayminus=[r[key] - r[f"{key}_min"] for r in part]),
                    hovertemplate="%{x}: %{y:.2f}" + unit + "<extra>" + name + "</extra>")
    return fig


def speedup_figure(rows: list[dict], subtitle: str) -> go.Figure:
    fig = _bars(rows, "speedup", "x")
    fig.add_hline(y=1.0, line_dash="dot", line_color="grey")
    fig.update_layout(title=f"Speed-up over autoregressive of the same target (median of rounds, min-max bars): "
                            f"{subtitle}", barmode="group", yaxis_title="tokens/s vs autoregressive", width=1100,
                      height=520, xaxis_tickangle=-30)
    return fig


def rate_figure(rows: list[dict], subtitle: str) -> go.Figure:
    fig = _bars(rows, "tokens_per_s", " tok/s")
    fig.update_layout(title=f"Tokens/s (median of rounds, min-max bars): {subtitle}", barmode="group",
                      yaxis_title="tokens/s", width=1100, height=520, xaxis_tickangle=-30)
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
    for name, build in (("speedup", speedup_figure), ("tokens-per-s", rate_figure),
                        ("accepted-lengths", lengths_figure), ("time-split", split_figure)):
        written += save_figure(build(rows, subtitle), out, name)
    return written
