"""Plotly figures built from step traces (plain data)."""

from __future__ import annotations

import html
from collections.abc import Sequence

import plotly.graph_objects as go

from specui.engine.trace import StepTrace
from specui.ui.palette import (
    NEUTRAL,
    PROVENANCE_COLORS,
    SERIES_COLORS,
    STATUS_COLORS,
    legend_above,
    panel_title,
    plain_figure,
    stacked_axes,
    top_margin,
)
from specui.ui.tree_figure import tree_figure
from specui.ui.tree_layout import token_label, tree_layout

__all__ = ["STATUS_COLORS", "PROVENANCE_COLORS", "tree_figure", "tree_layout", "acceptance_figure", "choices_figure",
           "timing_figure", "provenance_html", "provenance_segments", "step_markdown", "profile_figure"]

def _reply_lengths(steps: Sequence[StepTrace]) -> list[int]:
    """Tokens in the reply after each step (a replacing step, beam search's, restarts it)."""
    lengths, total = [], 0
    for s in steps:
        total = len(s.new_token_ids) + (0 if s.replaces else total)
        lengths.append(total)
    return lengths


def acceptance_figure(steps: Sequence[StepTrace]) -> go.Figure:
    """Accepted vs rejected draft tokens per step (bars) above the running mean tokens per
    target forward: two panels, one y-scale each."""
    xs = [s.index for s in steps]
    accepted = [s.accepted for s in steps]
    rejected = [s.drafted - s.accepted for s in steps]
    running = [n / (i + 1) for i, n in enumerate(_reply_lengths(steps))]
    return plain_figure([
        dict(type="bar", x=xs, y=accepted, name="accepted", marker=dict(color=STATUS_COLORS["accepted"])),
        dict(type="bar", x=xs, y=rejected, name="rejected / unverified", marker=dict(color=STATUS_COLORS["rejected"])),
        dict(type="scatter", x=xs, y=running, name="tokens per target forward (running mean)", mode="lines+markers",
             yaxis="y2", line=dict(color=NEUTRAL), marker=dict(size=4)),
    ], dict(
        barmode="stack", height=320 + top_margin(LEGEND_ACCEPT, title=False),
        margin=dict(l=20, r=20, t=top_margin(LEGEND_ACCEPT, title=False), b=40), legend=legend_above(),
        **stacked_axes(["draft tokens", "tokens / forward"]),
    ))


LEGEND_ACCEPT = ["accepted", "rejected / unverified", "tokens per target forward (running mean)"]


# The choices panel's quantities, one small multiple each: (y-axis title, series names in it).
CHOICE_PANELS = {
    "tokens": "tokens / layers",  # gamma, depth, E(A), A, DSBD's stop layer, what auto drafted, rows' accepted
    "nodes": "tree nodes",
    "width": "width (beams, chains, rows)",
    "probability": "probability",
}


def _choice_series(steps: Sequence[StepTrace]) -> list[tuple[str, dict]]:
    """(panel, trace) for every choice the steps recorded."""
    xs = [s.index for s in steps]
    out: list[tuple[str, dict]] = []
    series = (
        ("tokens", "gamma (candidate length)", [s.gamma for s in steps]),
        ("nodes", "tree nodes", [s.tree_nodes for s in steps]),
        ("tokens", "tree depth", [s.tree_depth for s in steps]),
        ("tokens", "E(A) expected", [s.expected_accept for s in steps]),
        ("width", "beam width", [s.beam_width for s in steps]),
        ("tokens", "DSBD: layer where verification stopped", [s.stop_layer for s in steps]),
    )
    for panel, name, ys in series:
        if any(y is not None for y in ys):
            out.append((panel, dict(type="scatter", x=xs, y=ys, name=name, mode="lines+markers")))
    if any(s.expected_accept is not None for s in steps):
        out.append(("tokens", dict(type="scatter", x=xs, y=[s.accepted + 1 for s in steps], name="A achieved",
                                   mode="markers")))
    widths = [(s.index, layer, w) for s in steps for layer, w in enumerate(s.layer_widths or [], 1)]
    if widths:  # DSBD: the width chosen at every verified layer, one marker per layer
        out.append(("width", dict(type="scatter", x=[i for i, _, _ in widths], y=[w for _, _, w in widths],
                                  text=[f"layer {layer}" for _, layer, _ in widths], name="DSBD: width per layer",
                                  hovertemplate="step %{x}, %{text}: width %{y}<extra></extra>", mode="markers",
                                  marker=dict(symbol="diamond-open", size=9))))
    if any(s.chains is not None for s in steps):  # MCSD forks: chains per step
        out.append(("width", dict(type="scatter", x=xs, y=[s.chains for s in steps], name="MCSD: chains",
                                  mode="lines+markers")))
    if any(s.threshold is not None for s in steps):  # the stop rule's input against its threshold
        mcsd = any(s.chains is not None for s in steps)
        value = [s.stop_value if s.stop_value is not None else
                 max((n.reject_pred for n in s.nodes if n.reject_pred is not None), default=None) for s in steps]
        out.append(("probability", dict(
            type="scatter", x=xs, y=value, text=[s.stop_reason for s in steps],
            name="MCSD: predicted acceptance at stop" if mcsd else "SpecDec++: P(some rejected) at stop",
            mode="markers", marker=dict(symbol="x"),
            hovertemplate="step %{x}: %{y:.3f} (stopped: %{text})<extra></extra>")))
        out.append(("probability", dict(type="scatter", x=xs, y=[s.threshold for s in steps], mode="lines",
                                        name="stop threshold" if mcsd else "threshold H", line=dict(dash="dash"))))
    chosen = [s.choice for s in steps]
    if any(c is not None for c in chosen):  # auto / ems-sd: what it chose, drafted tokens per step
        out.append(("tokens", dict(
            type="scatter", x=xs, y=[s.drafted if c else None for s, c in zip(steps, chosen, strict=True)],
            text=chosen, hovertemplate="step %{x}: %{text}<extra></extra>",
            name=f"{steps[0].method}: drafted (0 = autoregressive)", mode="markers", marker=dict(symbol="square"))))
    return out + batch_series(steps, xs)


def choices_figure(steps: Sequence[StepTrace]) -> go.Figure:
    """The dynamic choices each step made: candidate length, tree size / depth, E(A) next
    to the achieved acceptance length A, widths, the stop rule; one small multiple per
    quantity (tree nodes in the tens beside widths of 1-4 would flatten the widths)."""
    series = _choice_series(steps)
    panels = [p for p in CHOICE_PANELS if any(panel == p for panel, _ in series)]
    data = []
    for panel, trace in series:
        k = panels.index(panel)
        data.append(dict(trace, yaxis="y" if k == 0 else f"y{k + 1}"))
    axes = stacked_axes([CHOICE_PANELS[p] for p in panels])
    if "probability" in panels:
        k = panels.index("probability")
        axes["yaxis" if k == 0 else f"yaxis{k + 1}"].update(range=[0, 1], rangemode="normal")
    top = top_margin([d["name"] for d in data], title=True)
    return plain_figure(data, dict(
        height=top + 44 + 130 * max(1, len(panels)), margin=dict(l=20, r=20, t=top, b=44), legend=legend_above(),
        colorway=list(SERIES_COLORS), title=panel_title("dynamic choices" if steps else "no steps yet"), **axes))


def batch_series(steps: Sequence[StepTrace], xs: list[int]) -> list[tuple[str, dict]]:
    """EMS-SD: the batch's size per step and every row's accepted length (this chat's row
    drawn apart from the others)."""
    if not any(s.batch_size is not None for s in steps):
        return []
    others = [(s.index, a) for s in steps for r, a in enumerate(s.batch_accepted or []) if r != s.batch_row]
    return [
        ("width", dict(type="scatter", x=xs, y=[s.batch_size for s in steps], name="batch size", mode="lines",
                       line=dict(shape="hv", color=NEUTRAL))),
        ("tokens", dict(type="scatter", x=[i for i, _ in others], y=[a for _, a in others], name="other rows: accepted",
                        mode="markers", marker=dict(color="rgba(120,120,120,0.45)", size=6))),
        ("tokens", dict(type="scatter", x=xs, y=[s.accepted for s in steps], name="this chat: accepted",
                        mode="markers", marker=dict(color=STATUS_COLORS["accepted"], size=8, symbol="diamond"))),
    ]


def timing_figure(steps: Sequence[StepTrace]) -> go.Figure:
    """Draft vs verify time per step (stacked bars) above the running tokens/s: two panels."""
    xs = [s.index for s in steps]
    other = [max(0.0, s.step_ms - s.draft_ms - s.verify_ms) for s in steps]
    running, ms = [], 0.0
    for s, tokens in zip(steps, _reply_lengths(steps)):
        ms += s.step_ms
        running.append(1000.0 * tokens / ms if ms > 0 else 0.0)
    return plain_figure([
        dict(type="bar", x=xs, y=[s.draft_ms for s in steps], name="draft ms", marker=dict(color=SERIES_COLORS[1])),
        dict(type="bar", x=xs, y=[s.verify_ms for s in steps], name="verify ms",
             marker=dict(color=STATUS_COLORS["target"])),
        dict(type="bar", x=xs, y=other, name="other ms", marker=dict(color="#dddddd")),
        dict(type="scatter", x=xs, y=running, name="tokens/s (running)", mode="lines", yaxis="y2",
             line=dict(color=NEUTRAL)),
    ], dict(
        barmode="stack", height=280 + top_margin(LEGEND_TIMING, title=True),
        margin=dict(l=20, r=20, t=top_margin(LEGEND_TIMING, title=True), b=40), legend=legend_above(),
        title=panel_title("time per step" if steps else "no steps yet"),
        **stacked_axes(["ms per step", "tokens/s"]),
    ))


LEGEND_TIMING = ["draft ms", "verify ms", "other ms", "tokens/s (running)"]


def provenance_segments(steps: Sequence[StepTrace]) -> list[tuple[str, str]]:
    """The reply as (text, 'draft' | 'target') runs: characters from accepted draft tokens
    vs characters the target produced itself. Empty if the steps do not add up to the
    reply (beam search rewrites its text)."""
    if not steps:
        return []
    segments: list[tuple[str, str]] = []
    for s in steps:
        for text, source in ((s.new_text[: s.new_draft_chars], "draft"), (s.new_text[s.new_draft_chars:], "target")):
            if not text:
                continue
            if segments and segments[-1][1] == source:
                segments[-1] = (segments[-1][0] + text, source)
            else:
                segments.append((text, source))
    if "".join(t for t, _ in segments) != steps[-1].text:
        return []
    return segments


def provenance_html(steps: Sequence[StepTrace]) -> str:
    """The last reply coloured by where each character came from."""
    if not steps:
        return "<div class='specui-prov'><i>no reply yet</i></div>"
    segments = provenance_segments(steps)
    legend = " ".join(f"<span style='background:{c};padding:0 4px'>{name}</span>"
                      for name, c in (("accepted draft", PROVENANCE_COLORS["draft"]),
                                      ("target", PROVENANCE_COLORS["target"])))
    if not segments:
        body = html.escape(steps[-1].text)
        legend = f"<i>{html.escape(steps[-1].method)}: the reply was rewritten during decoding, shown plain</i>"
    else:
        body = "".join(f"<span class='prov-{src}' style='background:{PROVENANCE_COLORS[src]}'>{html.escape(t)}</span>"
                       for t, src in segments)
    drafted = sum(len(t) for t, src in segments if src == "draft")
    total = max(1, sum(len(t) for t, _ in segments))
    share = f" · {drafted / total:.0%} of the characters came from accepted drafts" if segments else ""
    return (f"<div class='specui-prov'><div style='font-size:0.85em'>{legend}{share}</div>"
            f"<div style='white-space:pre-wrap;line-height:1.6'>{body}</div></div>")


def _fmt(value, spec: str = ".3f") -> str:
    return "" if value is None else format(value, spec)


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell and code span."""
    return text.replace("`", "'").replace("|", "\\|").replace("\n", "\\n")


def step_markdown(step: StepTrace | None, max_nodes: int = 40) -> str:
    """The numbers of one step, as recorded (nothing recomputed)."""
    if step is None:
        return "_no step selected_"
    choices = [f"{name} {value}" for name, value in (
        ("gamma", step.gamma), ("beam width", step.beam_width), ("tree nodes", step.tree_nodes),
        ("tree depth", step.tree_depth), ("widths per layer", step.layer_widths), ("stopped at layer", step.stop_layer),
        ("E(A)", None if step.expected_accept is None else f"{step.expected_accept:.2f}"),
        ("chains", step.chains), ("threshold", step.threshold), ("stopped by", step.stop_reason),
        ("at", None if step.stop_value is None else f"{step.stop_value:.3f}")) if value is not None]
    lines = [
        f"**step {step.index}** · {step.method} · drafted {step.drafted} · accepted {step.accepted} · "
        f"+{len(step.new_token_ids)} tokens {step.new_text!r}",
        f"draft {step.draft_ms:.1f} ms · verify {step.verify_ms:.1f} ms · step {step.step_ms:.1f} ms"
        + (" · " + " · ".join(choices) if choices else ""),
    ]
    lines += [f"ℹ️ {n}" for n in step.notes]
    if step.beams:
        lines += ["", "| beam | log-lik | text |", "|---|---|---|"]
        lines += [f"| {i} | {b['score']:.3f} | {_cell(b['text'][-80:])} |" for i, b in enumerate(step.beams)]
    if step.nodes:
        lines += ["", "| # | token | parent | depth | status | q | p | p^ | min(1,p/q) | beam "
                      "| log-lik target / draft |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for i, n in enumerate(step.nodes[:max_nodes]):
            token = _cell(token_label(n.text, 40))  # whitespace visible, as on the tree
            lines.append(f"| {i} | `{token}` | {n.parent} | {n.depth} | {n.status} | {_fmt(n.q)} | {_fmt(n.p)} "
                         f"| {_fmt(n.p_hat)} | {_fmt(n.accept_ratio)} | {'' if n.beam is None else n.beam} "
                         f"| {_fmt(n.score)} / {_fmt(n.draft_score)} |")
        head = [(i, n) for i, n in enumerate(step.nodes[:max_nodes]) if n.accept_pred is not None]
        if head:  # SpecDec++'s head after each candidate; MCSD: the decision model per chain candidate
            lines += ["", "| # | predicted acceptance | P(some rejected) so far |", "|---|---|---|"]
            lines += [f"| {i} | {_fmt(n.accept_pred)} | {_fmt(n.reject_pred)} |" for i, n in head]
        if len(step.nodes) > max_nodes:
            lines.append(f"\n… {len(step.nodes) - max_nodes} more nodes (see the JSON export)")
    return "\n".join(lines)


def profile_figure(profile: dict | None) -> go.Figure:
    """The pair's cost profile (CostProfile.to_dict(), plain data): target ms vs k tokens at
    each measured context, and draft ms per layer of width w, on one log-k axis."""
    if not profile:
        return plain_figure([], dict(height=260, title=dict(text="no cost profile measured yet")))
    data = []
    for context, row in sorted(profile.get("target_ms", {}).items(), key=lambda kv: int(kv[0])):
        ks = sorted(row, key=int)
        data.append(dict(type="scatter", x=[int(k) for k in ks], y=[row[k] for k in ks], mode="lines+markers",
                         name=f"target, context {context}"))
    draft = profile.get("draft_ms", {})
    if draft:
        ws = sorted(draft, key=int)
        data.append(dict(type="scatter", x=[int(w) for w in ws], y=[draft[w] for w in ws], mode="lines+markers",
                         name="draft, one layer of width w"))
    return plain_figure(data, dict(
        height=340, margin=dict(l=20, r=20, t=100, b=40), legend=legend_above(), colorway=list(SERIES_COLORS),
        xaxis=dict(type="log", title=dict(text="k tokens / width w")), yaxis=dict(title=dict(text="ms")),
        title=panel_title("cost profile")))
