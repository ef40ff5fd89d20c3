"""A page as Debian's headless `chromium` lays it out: for the report's tests (unit and e2e).

Importing it skips the calling test module where chromium is not installed, with the reason;
under CI=true it fails instead (`scripts/host-deps.sh chromium` installs it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import in_ci

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    if in_ci():
        raise RuntimeError("CI=true and chromium is not installed: scripts/host-deps.sh "
                           "chromium (apt-get install -y chromium)")
    pytest.skip("chromium is not installed (apt-get install -y chromium)",
                allow_module_level=True)

Image = pytest.importorskip("PIL.Image")  # Pillow comes with matplotlib

# Measures the laid-out page and writes the numbers into the DOM, for --dump-dom to read.
PROBE = """<script>
window.addEventListener("load", () => {
  const box = e => {
    const r = e.getBoundingClientRect();
    return [r.left + scrollX, r.top + scrollY, r.width, r.height];
  };
  const charts = [...document.querySelectorAll(".chart svg")].map(box);
  // Each chart's legends (matplotlib's ids end in legend_N): their swatches are coloured
  // whether or not the chart drew any data.
  const legends = [...document.querySelectorAll(".chart svg")].map(
    s => [...s.querySelectorAll('[id*="legend_"]')].map(box));
  const wide = [...document.querySelectorAll("main *")].filter(e => {
    const r = e.getBoundingClientRect();
    return r.right > document.documentElement.clientWidth + 1 && !e.closest(".scroll");
  }).map(e => e.tagName + "." + e.className);
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify({
    scrollWidth: document.documentElement.scrollWidth,
    clientWidth: document.documentElement.clientWidth,
    height: document.documentElement.scrollHeight, charts, legends, wide});
  document.body.appendChild(out);
});
</script>"""


def chromium(*args: str) -> str:
    proc = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--force-device-scale-factor=1", "--no-first-run", "--disable-extensions",
         "--allow-file-access-from-files", *args],
        capture_output=True, text=True, timeout=90, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def measure(page: Path, width: int) -> dict[str, object]:
    probed = page.with_name(f"probed-{width}.html")
    probed.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    dom = chromium(f"--window-size={width},900", "--virtual-time-budget=5000",
                    "--dump-dom", probed.as_uri())
    m = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert m, dom[-2000:]
    return dict(json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&")))




# Data marks are drawn in the Okabe-Ito colours; axes, ticks, labels, grid and hatching in
# black and greys. A pixel whose channels differ by more than this is a data mark's.
COLOURED = 60
MIN_DATA_PIXELS = 30  # a few markers; an axes-only chart has none


def data_pixels(img: object, chart: list[float], legends: list[list[float]]) -> int:
    """Coloured pixels in the chart's box outside its legends: what the data drew."""
    import numpy as np

    left, top, w, h = (int(v) for v in chart)
    rgb = np.asarray(img.crop((left, top, left + w, top + h)).convert("RGB"),  # type: ignore[attr-defined]
                     dtype=np.int16)
    coloured = (rgb.max(axis=2) - rgb.min(axis=2)) > COLOURED
    for x, y, lw, lh in legends:
        x0, y0 = max(0, int(x) - left), max(0, int(y) - top)
        coloured[y0:int(y + lh) - top + 1, x0:int(x + lw) - left + 1] = False
    return int(coloured.sum())


def assert_charts_drawn(page: Path, charts_expected: int) -> None:
    """A full-page screenshot at 1280 px: every chart box holds a drawing, not white, not a
    solid block, and data marks beside its legend (an axes-only chart fails)."""
    m = measure(page, 1280)
    charts, legends = m["charts"], m["legends"]
    assert isinstance(charts, list) and len(charts) == charts_expected, m
    assert isinstance(legends, list)
    height = int(m["height"])  # type: ignore[call-overload]
    shot = page.with_name("report.png")
    chromium("--window-size=1280," + str(height), f"--screenshot={shot}", page.as_uri())
    full = Image.open(shot)
    img = full.convert("L")
    assert img.size[0] == 1280
    for (left, top, w, h), legend in zip(charts, legends, strict=True):
        assert w > 300 and h > 150, (left, top, w, h)
        box = img.crop((int(left), int(top), int(left + w), int(top + h)))
        hist = box.histogram()
        dark = sum(hist[:200]) / (box.size[0] * box.size[1])
        # Axes, bars, markers and labels: far from a blank (white) box, not a solid block.
        assert 0.02 < dark < 0.8, (left, top, dark)
        drawn = data_pixels(full, [left, top, w, h], legend)
        assert drawn >= MIN_DATA_PIXELS, (f"chart at {left:.0f},{top:.0f}: {drawn} data "
                                          "pixels outside its legend: axes without data")


def assert_fits(page: Path, width: int) -> None:
    """Nothing on the page is wider than a window ``width`` pixels wide."""
    m = measure(page, width)
    assert m["scrollWidth"] <= m["clientWidth"] <= width, m
    assert m["wide"] == [], m
