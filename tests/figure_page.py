"""Plotly figures drawn in headless Chromium without the app: a static page with plotly's own
JS (the copy the plotly package ships), each figure drawn as Gradio's Plot draws it, and the
drawn SVG read back (the token labels' boxes, the legend's and the plotting area's)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import plotly

from specui.bench.browser_driver import CHROME_FLAGS, CHROMEDRIVER, CHROMIUM

PAGE = """<!doctype html><html><head><meta charset="utf-8"><script src="plotly.min.js"></script></head>
<body style="margin:0;font-family:sans-serif"><div id="stage"></div></body></html>"""

# arguments: figure JSON, the chart's width in px, callback. Draws the figure as Gradio 6's Plot
# does (responsive, autosize, margins that grow for a title) and returns what was drawn.
DRAW_AND_READ_JS = """
const [json, width, done] = arguments;
const stage = document.getElementById('stage');
stage.innerHTML = '';
const gd = document.createElement('div');
gd.style.width = width + 'px';
stage.appendChild(gd);
const fig = JSON.parse(json);
fig.layout.autosize = true;
fig.layout.margin = fig.layout.margin || {};
if (fig.layout.title) fig.layout.margin.t = Math.max(100, fig.layout.margin.t || 0);
fig.layout.margin.autoexpand = true;
const box = el => { const r = el.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
Plotly.react(gd, fig.data, fig.layout, {responsive: true})
  .then(() => document.fonts.ready)
  .then(() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r))))
  .then(() => {
    const texts = Array.from(gd.querySelectorAll('.scatterlayer .textpoint text'))
      .filter(t => t.textContent.length)
      .map(t => [t.textContent, ...box(t)]);
    const legend = gd.querySelector('.legend');
    const title = gd.querySelector('.gtitle');
    const markers = Array.from(gd.querySelectorAll('.scatterlayer .points path.point')).map(box);
    done({texts: texts, markers: markers, legend: legend ? box(legend) : null, title: title ? box(title) : null,
          plots: Array.from(gd.querySelectorAll('.nsewdrag')).map(box), frame: box(gd),
          size: [gd._fullLayout.width, gd._fullLayout.height]});
  })
  .catch(e => done({error: String(e)}));
"""


class FigurePage:
    """One headless Chromium tab on the static page; `draw` renders a figure and reads it back."""

    def __init__(self) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self.folder = Path(tempfile.mkdtemp(prefix="specui-figures-"))
        shutil.copy(Path(plotly.__file__).parent / "package_data" / "plotly.min.js", self.folder)
        (self.folder / "page.html").write_text(PAGE, encoding="utf-8")
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in CHROME_FLAGS:
            options.add_argument(flag)
        self.driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        self.driver.set_script_timeout(20)
        self.driver.get((self.folder / "page.html").as_uri())

    def draw(self, figure, width: int) -> dict:
        drawn = self.driver.execute_async_script(DRAW_AND_READ_JS, figure.to_json(), width)
        if "error" in drawn:
            raise AssertionError(f"plotly could not draw the figure: {drawn['error']}")
        return drawn

    def screenshot(self, path: Path) -> None:
        self.driver.find_element("css selector", "#stage > div").screenshot(str(path))

    def close(self) -> None:
        self.driver.quit()
        shutil.rmtree(self.folder, ignore_errors=True)


def overlaps(boxes: list[list], slack: float = 0.5) -> list[tuple]:
    """Pairs of [text, left, top, right, bottom] boxes that intersect by more than `slack` px
    both ways (sorted by left edge: a sweep, not every pair)."""
    found = []
    ordered = sorted(boxes, key=lambda b: b[1])
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            if b[1] >= a[3] - slack:
                break
            if min(a[4], b[4]) - max(a[2], b[2]) > slack and min(a[3], b[3]) - max(a[1], b[1]) > slack:
                found.append((a, b))
    return found


def disjoint(a: list[float], b: list[float], slack: float = 0.0) -> bool:
    """Two [left, top, right, bottom] boxes that do not intersect (by more than `slack` px)."""
    return a[2] <= b[0] + slack or b[2] <= a[0] + slack or a[3] <= b[1] + slack or b[3] <= a[1] + slack


def covered(texts: list[list], markers: list[list], slack: float = 0.5) -> list[tuple]:
    """(label, marker box) pairs where a label's box lies over a node's marker."""
    return [(t[0], m) for t in texts for m in markers if not disjoint(t[1:], m, slack)]
