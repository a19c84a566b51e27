"""A draft's learning curve: held-out agreement (answer tokens only) against the answer tokens
trained on, in this run (probed every few steps) and over the draft's versions (each run that
went on from a trained draft (`--init`) carries that draft's history forward). Written to the
draft's folder as curve.html / curve.png (and the points into metrics.json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def run_points(probes: list[tuple[int, float]], tokens_per_epoch: int, batches: int) -> list[dict]:
    """Probes (step, agreement) as answer tokens seen so far: whole epochs are exact, a step
    inside one counts the epoch's mean tokens per batch."""
    per_batch = tokens_per_epoch / max(1, batches)
    return [{"step": step, "tokens_seen": round(step * per_batch), "agreement": value} for step, value in probes]


def history(init_folder: Path | None, init_agreement: float | None) -> list[dict]:
    """The versions before this run: the init draft's own history, then the init draft itself
    (its training-set size, and its agreement as measured before this run, on this run's
    held-out set)."""
    if init_folder is None:
        return []
    path = Path(init_folder) / "metrics.json"
    try:
        metrics = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    past = [dict(h) for h in metrics.get("history", []) if isinstance(h, dict)]
    if "train_answer_tokens" in metrics and init_agreement is not None:
        past.append({"train_answer_tokens": metrics["train_answer_tokens"], "agreement": init_agreement,
                     "heldout": "this run's held-out set, before training",
                     "command": metrics.get("command", "")})
    return past


def trained_so_far(sizes: list[int]) -> list[int]:
    """Each version's x: the largest training set of it and the versions before it. Every run
    draws from one growing answer store, so a later run on part of it (a continuation on the
    new answers only) stands above the data already learnt, not at its own smaller size."""
    out, most = [], 0
    for size in sizes:
        most = max(most, size)
        out.append(most)
    return out


def figure(points: list[dict], versions: list[dict], train_tokens: int, final: float):
    """The plotly figure (plotly imported here: training runs, e.g. on a GPU machine, without it)."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("This run: held-out agreement as training goes",
                                                        "Versions: held-out agreement vs training answers"))
    fig.add_scatter(x=[p["tokens_seen"] for p in points], y=[p["agreement"] for p in points],
                    mode="lines+markers", name="this run", row=1, col=1)
    xs = trained_so_far([v["train_answer_tokens"] for v in versions] + [train_tokens])
    ys = [v["agreement"] for v in versions] + [final]
    # a version trained further on the same store stands on its predecessor: label only the last there
    text = [f"{y:.3f}" if i == len(xs) - 1 or xs[i + 1] != x else "" for i, (x, y) in enumerate(zip(xs, ys))]
    fig.add_scatter(x=xs, y=ys, mode="lines+markers+text", name="versions", row=1, col=2,
                    text=text, textposition=["bottom right"] * (len(ys) - 1) + ["top left"])
    fig.add_hline(y=0.6, line_dash="dot", line_color="grey", annotation_text="goal 0.6", row=1, col=2)
    fig.update_xaxes(title_text="answer tokens seen", row=1, col=1)
    fig.update_xaxes(title_text="answer tokens trained on (the largest training set so far)", type="log", row=1, col=2)
    fig.update_yaxes(title_text="greedy top-1 agreement with the target", row=1, col=1)
    fig.update_yaxes(range=[min(ys) - 0.03, max(0.62, max(ys) + 0.02)], row=1, col=2)
    fig.update_layout(width=1100, height=460, showlegend=False)
    return fig


def write(folder: Path, points: list[dict], versions: list[dict], train_tokens: int, final: float) -> list[Path]:
    """curve.html / curve.png in `folder`; none, with a note, where plotly is not installed (the
    points stay in metrics.json)."""
    try:
        import plotly  # noqa: F401
    except ImportError:
        print("plotly is not installed: no curve.html / curve.png (the curve's points are in metrics.json)",
              file=sys.stderr)
        return []
    from specui.bench.png import save_figure

    return save_figure(figure(points, versions, train_tokens, final), folder, "curve")
