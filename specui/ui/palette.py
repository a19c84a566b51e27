"""What every panel shares: one colour per node status (the tree's nodes, the bars, the
provenance text's tints), a colour cycle for the other series that never borrows a status
colour, legends kept outside the plotting area, and small multiples (one y-scale per quantity)."""

from __future__ import annotations

import plotly.graph_objects as go

STATUS_COLORS = {
    "accepted": "#2e9e44",
    "rejected": "#d62728",
    "resampled": "#ff9f1c",
    "bonus": "#1f77b4",
    "unverified": "#b0b0b0",
    "target": "#6f42c1",
    "dropped": "#e8c4c4",
    "filled": "#ffd58a",
}
# Series that are not a node status (gamma, widths, ms, tokens/s, methods): none of these is a
# status colour, so green always means accepted, red rejected, purple the target's own tokens.
SERIES_COLORS = ("#333333", "#8c564b", "#17becf", "#bcbd22", "#e377c2", "#7f7f7f", "#393b79", "#637939")
NEUTRAL = "#333333"


def tint(color: str, strength: float) -> str:
    """`color` mixed with white: strength 1 is the colour, 0 is white."""
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(255 - (255 - c) * strength):02x}" for c in rgb)


# The reply's characters: accepted draft tokens in the accepted tint, the target's in its own.
PROVENANCE_COLORS = {"draft": tint(STATUS_COLORS["accepted"], 0.28), "target": tint(STATUS_COLORS["target"], 0.2)}


def plain_figure(data: list[dict], layout: dict) -> go.Figure:
    """A figure from plain dicts without plotly's per-property validation (10x cheaper; the
    live panels are rebuilt while a reply streams)."""
    return go.Figure(data=data, layout=layout, _validate=False)


LEGEND_ROW = 21  # px per row of a horizontal legend at font size 11
BADGE_SPACE = 30  # px at the top for Gradio's label and plotly's mode bar
TITLE_SPACE = 56  # px above the legend for those and a title under them


def legend_above() -> dict:
    """A horizontal legend in the top margin, just above the plotting area (never over it),
    in the order the traces come."""
    return dict(orientation="h", x=0, xanchor="left", y=1, yanchor="bottom", traceorder="normal",
                font=dict(size=11))


def panel_title(text: str) -> dict:
    """A title on its own line below Gradio's label and the mode bar, above the legend."""
    return dict(text=text, font=dict(size=13), x=0.5, xanchor="center", y=1, yref="container", yanchor="top",
                pad=dict(t=32))


def legend_rows(names: list[str], width: float = 540) -> int:
    """Rows a horizontal legend of these entries takes in a plot `width` px wide. As plotly lays
    it out: one row if every entry fits, else columns as wide as the widest entry (each entry
    estimated generously: symbol and gap 40 px, 5.8 px a character at font size 11)."""
    entries = [40 + 5.8 * len(name) for name in names]
    if sum(entries) <= width:
        return 1
    columns = max(1, int(width // max(entries)))
    return -(-len(entries) // columns)


def top_margin(names: list[str], title: bool) -> int:
    """Room above the plot for a title and a legend of these entries (at least Gradio's own
    floor of 100 px under a title)."""
    need = (TITLE_SPACE if title else BADGE_SPACE) + LEGEND_ROW * legend_rows(names) + 12  # 12: its padding
    return max(100, need) if title else need


def stacked_axes(titles: list[str], gap: float = 0.07) -> dict:
    """Small multiples sharing one x-axis (step): a y-axis per quantity, the first on top.
    Trace i of panel k sets yaxis="y" (k = 0) or f"y{k + 1}"."""
    n = max(1, len(titles))
    span = (1.0 - gap * (n - 1)) / n
    axes = {}
    for k, title in enumerate(titles or [""]):
        top = 1.0 - k * (span + gap)
        axes["yaxis" if k == 0 else f"yaxis{k + 1}"] = dict(
            domain=[max(0.0, top - span), top], anchor="x", rangemode="tozero",
            title=dict(text=title, font=dict(size=11)))
    axes["xaxis"] = dict(anchor="y" if n == 1 else f"y{n}", title=dict(text="step"))
    return axes
