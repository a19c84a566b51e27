"""PNG copies of plotly figures without kaleido: the figure's self-contained HTML rendered by
a headless Chromium (the one the browser tests use). Where no Chromium is found the PNG is
skipped with a message; the HTML is always there."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def html_to_png(figure, png: Path, timeout_s: float = 60.0) -> bool:
    """Render a plotly figure to `png` at its layout's size; False (and a message) if no
    browser could do it."""
    browser = find_browser()
    if browser is None:
        print(f"no Chromium found: {png.name} not written (the HTML next to it has the figure)", file=sys.stderr)
        return False
    width, height = figure.layout.width or 800, figure.layout.height or 500
    with tempfile.TemporaryDirectory(prefix="specui-png-") as tmp:
        html = Path(tmp) / "figure.html"
        figure.write_html(html, include_plotlyjs=True, config={"staticPlot": True})
        cmd = [browser, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
               f"--user-data-dir={tmp}/profile", f"--window-size={width},{height}",
               f"--screenshot={png.resolve()}", "--virtual-time-budget=3000", html.as_uri()]
        try:
            subprocess.run(cmd, check=True, capture_output=True, timeout=timeout_s)
        except (OSError, subprocess.SubprocessError) as e:
            print(f"{png.name} not written: the browser failed ({e})", file=sys.stderr)
            return False
    return png.is_file()


def command_line(module: str, argv: list[str] | None) -> str:
    """The command that reproduces a bench run (what results.json records)."""
    return f"python -m {module} " + " ".join(argv if argv is not None else sys.argv[1:])


def save_figure(figure, out: Path, stem: str) -> list[Path]:
    """A figure as `stem`.html (plotly from its CDN) and `stem`.png (where a Chromium renders
    it); the paths written."""
    html = out / f"{stem}.html"
    figure.write_html(html, include_plotlyjs="cdn")
    return [html] + ([out / f"{stem}.png"] if html_to_png(figure, out / f"{stem}.png") else [])


def save_results(out: Path, stem: str, results: dict, figure) -> None:
    """A bench's outputs: results.json, and the figure as `stem`.html and `stem`.png."""
    (out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    save_figure(figure, out, stem)
    print(f"wrote {out}/results.json and {stem}.html/png")
