"""The live panels, redrawn in place while a reply streams.

Gradio's Plot component re-creates its chart whenever its value changes: a keyed block mounts a
new element, plotly builds the whole figure again, and a second `Plotly.react` follows. Counted
in headless Chromium on a 2-core CPU (opt-tree, panels once a second): 8 plotly calls a second
for the four panels, 28 ms each. So while a reply streams the four figures travel as JSON in
one hidden text carrier, and a script in the page hands them to `Plotly.react` on the charts
already drawn: the traces are replaced in place and nothing is rebuilt (4 calls a second, about
20 ms each). Figures that arrive while a draw runs, or sooner after it than ten times its
duration, wait and fold into one (only the newest is drawn): on a slow machine the charts
redraw less often, and plotly takes at most a tenth of a core. In a background tab the browser
pauses animation frames, so nothing piles up there. The Plot components get the final figures
once, when the reply ends, so the final panels are exactly the recorded trace's."""

from __future__ import annotations

import json
from typing import Any

from specui.ui.tree_figure import CHART_MIN_W

CARRIER_ID = "live-figures"

# Gradio marks every output of a running event "generating" and pulses its border with an endless
# CSS animation: eight boxes while a reply streams, so the browser composites frames all the time.
# Measured in headless Chromium on a 2-core CPU: its compositor thread took 0.48 of a core for as
# long as a reply streamed, panels on or off. The reply's own growing text shows progress. Passed
# to every `launch` of the page.
# the tree charts never narrower than the width their labels are laid out for (CHART_MIN_W):
# a narrower window (a phone) scrolls them sideways instead of piling labels up
PAGE_CSS = (".generating { animation: none !important; }\n"
            "#tree, #step-tree { overflow-x: auto; }\n"
            f"#tree .js-plotly-plot, #step-tree .js-plotly-plot {{ min-width: {CHART_MIN_W}px; }}\n"
            # the options table keeps whole words in a narrow column and scrolls sideways instead
            "#quant-options { overflow-x: auto; }\n"
            "#quant-options th, #quant-options td { word-break: normal; overflow-wrap: normal; }")

# `payload`: {"<elem_id of a gr.Plot>": <plotly figure JSON>, ...}. Layout as Gradio's own Plot
# sets it (autosize, margins that grow for a title), so a live chart looks like the final one.
DRAW_JS = """
(payload) => {
  const SHARE = 10;  // after a draw of d ms the next waits >= SHARE * d ms: plotly gets <= 1/SHARE of a core
  const live = window.__specuiLive = window.__specuiLive || {pending: null, busy: false, draws: 0, nextAt: 0};
  live.pending = payload || null;  // "": the reply ended, its final charts replace these; drop the rest
  if (live.pending === null || live.busy || !window.Plotly) return [];
  live.busy = true;
  const schedule = () => setTimeout(() => requestAnimationFrame(drawNewest),
                                    Math.max(0, live.nextAt - performance.now()));
  const drawNewest = () => {
    const text = live.pending;
    live.pending = null;
    if (text === null) { live.busy = false; return; }
    const t0 = performance.now();
    let figures = {};
    try { figures = JSON.parse(text); } catch (e) { figures = {}; }
    const draws = Object.entries(figures).map(([id, fig]) => {
      const gd = document.querySelector(`#${id} .js-plotly-plot`);
      if (!gd || !fig || !fig.layout) return null;
      const layout = fig.layout;
      layout.autosize = true;
      layout.margin = layout.margin || {};
      layout.margin.autoexpand = true;
      if (layout.title) layout.margin.t = Math.max(100, layout.margin.t || 0);
      return Plotly.react(gd, fig.data || [], layout);
    });
    Promise.all(draws).catch(() => null).then(() => {
      live.draws += 1;
      live.lastMs = performance.now() - t0;
      live.nextAt = performance.now() + SHARE * live.lastMs;
      if (live.pending !== null) schedule();
      else live.busy = false;
    });
  };
  schedule();
  return [];
}
"""


def live_payload(figures: dict[str, Any]) -> str:
    """One JSON text carrying plotly figures by the elem_id of the Plot each belongs in."""
    return "{" + ",".join(f"{json.dumps(elem_id)}:{figure.to_json()}" for elem_id, figure in figures.items()) + "}"
