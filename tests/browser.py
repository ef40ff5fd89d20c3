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
  const charts = [...document.querySelectorAll(".chart svg")].map(s => {
    const r = s.getBoundingClientRect();
    return [r.left + scrollX, r.top + scrollY, r.width, r.height];
  });
  const wide = [...document.querySelectorAll("main *")].filter(e => {
    const r = e.getBoundingClientRect();
    return r.right > document.documentElement.clientWidth + 1 && !e.closest(".scroll");
  }).map(e => e.tagName + "." + e.className);
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify({
    scrollWidth: document.documentElement.scrollWidth,
    clientWidth: document.documentElement.clientWidth,
    height: document.documentElement.scrollHeight, charts, wide});
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




def assert_charts_drawn(page: Path, charts_expected: int) -> None:
    """A full-page screenshot at 1280 px: every chart box holds a drawing, not white, not a
    solid block."""
    m = measure(page, 1280)
    charts = m["charts"]
    assert isinstance(charts, list) and len(charts) == charts_expected, m
    height = int(m["height"])  # type: ignore[call-overload]
    shot = page.with_name("report.png")
    chromium("--window-size=1280," + str(height), f"--screenshot={shot}", page.as_uri())
    img = Image.open(shot).convert("L")
    assert img.size[0] == 1280
    for left, top, w, h in charts:
        assert w > 300 and h > 150, (left, top, w, h)
        box = img.crop((int(left), int(top), int(left + w), int(top + h)))
        hist = box.histogram()
        dark = sum(hist[:200]) / (box.size[0] * box.size[1])
        # Axes, bars, markers and labels: far from a blank (white) box, not a solid block.
        assert 0.02 < dark < 0.8, (left, top, dark)


def assert_fits(page: Path, width: int) -> None:
    """Nothing on the page is wider than a window ``width`` pixels wide."""
    m = measure(page, width)
    assert m["scrollWidth"] <= m["clientWidth"] <= width, m
    assert m["wide"] == [], m
