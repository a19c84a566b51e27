"""Plotly figures built from step traces (plain data)."""

from __future__ import annotations

import html
from collections.abc import Sequence

import plotly.graph_objects as go

from specui.engine.trace import StepTrace

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


def _figure(data: list[dict], layout: dict) -> go.Figure:
    """A figure from plain dicts without plotly's per-property validation (10x cheaper; the
    live panels are rebuilt while a reply streams)."""
    return go.Figure(data=data, layout=layout, _validate=False)


def tree_layout(parents: Sequence[int]) -> list[tuple[float, float]]:
    """(x = depth, y = tidy leaf order) for each node; parent -1 hangs under a virtual
    root (the committed context) at (0, y)."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    pos: dict[int, tuple[float, float]] = {}
    next_leaf = [0.0]

    def place(node: int, depth: int) -> float:
        kids = children.get(node, [])
        if not kids:
            y = next_leaf[0]
            next_leaf[0] += 1.0
        else:
            ys = [place(k, depth + 1) for k in kids]
            y = sum(ys) / len(ys)
        pos[node] = (float(depth), y)
        return y

    place(-1, 0)
    return [pos[i] for i in range(len(parents))]


def _hover(node) -> str:
    parts = [f"<b>{node.text!r}</b> ({node.token_id})", f"status: {node.status}"]
    for label, value in (("q", node.q), ("p", node.p), ("p^", node.p_hat), ("min(1,p/q)", node.accept_ratio)):
        if value is not None:
            parts.append(f"{label} = {value:.4f}")
    if node.beam is not None:
        parts.append(f"beam {node.beam}")
    if node.score is not None:
        parts.append(f"beam log-lik = {node.score:.3f}")
    if node.draft_score is not None:
        parts.append(f"draft log-lik = {node.draft_score:.3f}")
    if node.accept_pred is not None:  # SpecDec++'s head, MCSD's decision model
        parts.append(f"predicted a_t = {node.accept_pred:.3f}")
    if node.reject_pred is not None:
        parts.append(f"P(some rejected) = {node.reject_pred:.3f}")
    if node.status == "target" and node.parent == -1:
        parts.append("drawn from the target's own distribution")
    return "<br>".join(parts)


def tree_figure(step: StepTrace | None) -> go.Figure:
    """The step's draft tree (chain, tree or beam layer): nodes coloured by status."""
    if step is None or not step.nodes:
        return _figure([], dict(title=dict(text="draft tree: no step yet"), height=320))
    parents = [n.parent for n in step.nodes]
    xy = tree_layout(parents)
    leaves = len(parents) - len({p for p in parents if p >= 0})  # one row per leaf: room for the labels
    root_y = sum(y for (x, y), p in zip(xy, parents) if p == -1) / max(1, parents.count(-1))
    edge_x, edge_y = [], []
    for (x, y), p in zip(xy, parents):
        px, py = (0.0, root_y) if p == -1 else xy[p]
        edge_x += [px, x, None]
        edge_y += [py, y, None]
    data = [
        dict(type="scatter", x=edge_x, y=edge_y, mode="lines", line=dict(color="#999", width=1),
             hoverinfo="skip", showlegend=False),
        dict(type="scatter", x=[0.0], y=[root_y], mode="markers+text", text=["context"],
             textposition="top center", marker=dict(size=14, color="#444"), hoverinfo="skip", showlegend=False),
    ]
    for status, color in STATUS_COLORS.items():
        idx = [i for i, n in enumerate(step.nodes) if n.status == status]
        if not idx:
            continue
        data.append(dict(
            type="scatter", x=[xy[i][0] for i in idx], y=[xy[i][1] for i in idx], mode="markers+text",
            name=status, text=[step.nodes[i].text for i in idx], textposition="top center",
            marker=dict(size=18, color=color, line=dict(color="white", width=1)),
            hovertext=[_hover(step.nodes[i]) for i in idx], hoverinfo="text",
        ))
    return _figure(data, dict(
        title=dict(text=f"step {step.index}: {step.accepted}/{step.drafted} drafts accepted, "
                        f"+{len(step.new_token_ids)} tokens"),
        height=max(320, 90 + 22 * leaves), margin=dict(l=20, r=20, t=40, b=20),
        xaxis=dict(title=dict(text="depth"), dtick=1, zeroline=False), yaxis=dict(visible=False),
    ))


def _reply_lengths(steps: Sequence[StepTrace]) -> list[int]:
    """Tokens in the reply after each step (a replacing step, beam search's, restarts it)."""
    lengths, total = [], 0
    for s in steps:
        total = len(s.new_token_ids) + (0 if s.replaces else total)
        lengths.append(total)
    return lengths


def acceptance_figure(steps: Sequence[StepTrace]) -> go.Figure:
    """Accepted vs rejected draft tokens per step, and the running mean accepted length."""
    xs = [s.index for s in steps]
    accepted = [s.accepted for s in steps]
    rejected = [s.drafted - s.accepted for s in steps]
    running = [n / (i + 1) for i, n in enumerate(_reply_lengths(steps))]
    return _figure([
        dict(type="bar", x=xs, y=accepted, name="accepted", marker=dict(color=STATUS_COLORS["accepted"])),
        dict(type="bar", x=xs, y=rejected, name="rejected / unverified", marker=dict(color=STATUS_COLORS["rejected"])),
        dict(type="scatter", x=xs, y=running, name="tokens per target forward (running mean)", mode="lines",
             yaxis="y2", line=dict(color="#1f77b4")),
    ], dict(
        barmode="stack", height=280, margin=dict(l=20, r=20, t=30, b=20),
        xaxis=dict(title=dict(text="step")), yaxis=dict(title=dict(text="draft tokens")),
        yaxis2=dict(overlaying="y", side="right", title=dict(text="tokens / forward"), rangemode="tozero"),
        legend=dict(orientation="h", y=1.15),
    ))


def choices_figure(steps: Sequence[StepTrace]) -> go.Figure:
    """The dynamic choices each step made: candidate length, tree size / depth, E(A) next
    to the achieved acceptance length A, beam width."""
    data = []
    xs = [s.index for s in steps]
    series = {
        "gamma (candidate length)": [s.gamma for s in steps],
        "tree nodes": [s.tree_nodes for s in steps],
        "tree depth": [s.tree_depth for s in steps],
        "E(A) expected": [s.expected_accept for s in steps],
        "beam width": [s.beam_width for s in steps],
        "DSBD: layer where verification stopped": [s.stop_layer for s in steps],
    }
    chosen = [s.choice for s in steps]
    for name, ys in series.items():
        if any(y is not None for y in ys):
            data.append(dict(type="scatter", x=xs, y=ys, name=name, mode="lines+markers"))
    if any(s.expected_accept is not None for s in steps):
        data.append(dict(type="scatter", x=xs, y=[s.accepted + 1 for s in steps], name="A achieved", mode="markers"))
    widths = [(s.index, layer, w) for s in steps for layer, w in enumerate(s.layer_widths or [], 1)]
    if widths:  # DSBD: the width chosen at every verified layer, one marker per layer
        data.append(dict(type="scatter", x=[i for i, _, _ in widths], y=[w for _, _, w in widths],
                         text=[f"layer {layer}" for _, layer, _ in widths], name="DSBD: width per layer",
                         hovertemplate="step %{x}, %{text}: width %{y}<extra></extra>", mode="markers",
                         marker=dict(symbol="diamond-open", size=9)))
    if any(s.chains is not None for s in steps):  # MCSD forks: chains per step
        data.append(dict(type="scatter", x=xs, y=[s.chains for s in steps], name="MCSD: chains", mode="lines+markers"))
    if any(s.threshold is not None for s in steps):  # the stop rule's input against its threshold
        mcsd = any(s.chains is not None for s in steps)
        value = [s.stop_value if s.stop_value is not None else
                 max((n.reject_pred for n in s.nodes if n.reject_pred is not None), default=None) for s in steps]
        data.append(dict(type="scatter", x=xs, y=value, yaxis="y2", text=[s.stop_reason for s in steps],
                         name="MCSD: best chain's predicted acceptance at stop" if mcsd
                         else "SpecDec++: P(some rejected) at stop", mode="markers", marker=dict(symbol="x"),
                         hovertemplate="step %{x}: %{y:.3f} (stopped: %{text})<extra></extra>"))
        data.append(dict(type="scatter", x=xs, y=[s.threshold for s in steps], yaxis="y2", mode="lines",
                         name="stop threshold" if mcsd else "threshold H", line=dict(dash="dash")))
    if any(c is not None for c in chosen):  # auto / ems-sd: what it chose, drafted tokens per step
        data.append(dict(type="scatter", x=xs, y=[s.drafted if c else None for s, c in zip(steps, chosen, strict=True)],
                         text=chosen, hovertemplate="step %{x}: %{text}<extra></extra>",
                         name=f"{steps[0].method}: drafted (0 = autoregressive)", mode="markers",
                         marker=dict(symbol="square")))
    data += batch_series(steps, xs)
    many = len(data) > 3  # a long legend goes below the plot (it would cover it in a narrow column)
    layout = dict(height=260 + (26 * ((len(data) + 1) // 2) if many else 0),
                  margin=dict(l=20, r=20, t=30, b=20), xaxis=dict(title=dict(text="step")),
                  legend=dict(orientation="h", y=-0.25, yanchor="top") if many else dict(orientation="h", y=1.2),
                  title=dict(text="dynamic choices" if steps else "no steps yet"))
    if any(d.get("yaxis") == "y2" for d in data):
        layout["yaxis2"] = dict(overlaying="y", side="right", range=[0, 1], title=dict(text="probability"))
    return _figure(data, layout)


def batch_series(steps: Sequence[StepTrace], xs: list[int]) -> list[dict]:
    """EMS-SD: the batch's size per step and every row's accepted length (this chat's row
    drawn apart from the others)."""
    if not any(s.batch_size is not None for s in steps):
        return []
    others = [(s.index, a) for s in steps for r, a in enumerate(s.batch_accepted or []) if r != s.batch_row]
    return [
        dict(type="scatter", x=xs, y=[s.batch_size for s in steps], name="batch size", mode="lines",
             line=dict(shape="hv", color="#555")),
        dict(type="scatter", x=[i for i, _ in others], y=[a for _, a in others], name="other rows: accepted",
             mode="markers", marker=dict(color="rgba(120,120,120,0.45)", size=6)),
        dict(type="scatter", x=xs, y=[s.accepted for s in steps], name="this chat: accepted", mode="markers",
             marker=dict(color="#2e9e44", size=8, symbol="diamond")),
    ]


def timing_figure(steps: Sequence[StepTrace]) -> go.Figure:
    """Draft vs verify time per step (stacked bars) and the running tokens/s."""
    xs = [s.index for s in steps]
    other = [max(0.0, s.step_ms - s.draft_ms - s.verify_ms) for s in steps]
    running, ms = [], 0.0
    for s, tokens in zip(steps, _reply_lengths(steps)):
        ms += s.step_ms
        running.append(1000.0 * tokens / ms if ms > 0 else 0.0)
    return _figure([
        dict(type="bar", x=xs, y=[s.draft_ms for s in steps], name="draft ms", marker=dict(color="#9ecae1")),
        dict(type="bar", x=xs, y=[s.verify_ms for s in steps], name="verify ms", marker=dict(color="#6f42c1")),
        dict(type="bar", x=xs, y=other, name="other ms", marker=dict(color="#dddddd")),
        dict(type="scatter", x=xs, y=running, name="tokens/s (running)", mode="lines", yaxis="y2",
             line=dict(color="#2e9e44")),
    ], dict(
        barmode="stack", height=260, margin=dict(l=20, r=20, t=30, b=20),
        xaxis=dict(title=dict(text="step")), yaxis=dict(title=dict(text="ms per step")),
        yaxis2=dict(overlaying="y", side="right", title=dict(text="tokens/s"), rangemode="tozero"),
        legend=dict(orientation="h", y=1.2), title=dict(text="time per step" if steps else "no steps yet"),
    ))


PROVENANCE_COLORS = {"draft": "#c8efd0", "target": "#e6dcf7"}


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
            token = _cell(n.text)
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
        return _figure([], dict(height=260, title=dict(text="no cost profile measured yet")))
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
    return _figure(data, dict(height=300, margin=dict(l=20, r=20, t=30, b=20), legend=dict(orientation="h", y=1.2),
                              xaxis=dict(type="log", title=dict(text="k tokens / width w")),
                              yaxis=dict(title=dict(text="ms")), title=dict(text="cost profile")))
