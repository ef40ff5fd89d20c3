"""The report of a simulated history as a browser shows it (Debian's headless `chromium`):
the charts are drawn where the page puts them, and nothing is wider than the window.

Skipped with the reason where chromium is not installed; a failure under CI=true
(`scripts/host-deps.sh chromium` installs it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwarden.cli import Context, cli
from gpuwarden.fleet.calibrate import solve
from gpuwarden.fleet.simulate import Fleet, write_history
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


def _chromium(*args: str) -> str:
    proc = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--force-device-scale-factor=1", "--no-first-run", "--disable-extensions",
         "--allow-file-access-from-files", *args],
        capture_output=True, text=True, timeout=90, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("chromium")
    write_history(solve(), Fleet(nodes=256, days=4, seed=1), tmp / "hist")
    html = tmp / "report.html"
    res = CliRunner().invoke(cli, ["report", "--from", str(tmp / "hist" / "sacct"),
                                   "--events", str(tmp / "hist" / "events.txt"),
                                   "-o", str(html)], obj=Context())
    assert res.exit_code == 0, res.output
    return html


def _measure(page: Path, width: int) -> dict[str, object]:
    probed = page.with_name(f"probed-{width}.html")
    probed.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    dom = _chromium(f"--window-size={width},900", "--virtual-time-budget=5000",
                    "--dump-dom", probed.as_uri())
    m = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert m, dom[-2000:]
    return dict(json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&")))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("width", [1280, 720])
def test_nothing_overflows_the_window(page: Path, width: int) -> None:
    m = _measure(page, width)
    assert m["scrollWidth"] <= m["clientWidth"] <= width, m
    assert m["wide"] == [], m


@pytest.mark.timeout(240)
def test_the_screenshot_shows_every_chart(page: Path) -> None:
    m = _measure(page, 1280)
    charts = m["charts"]
    assert isinstance(charts, list) and len(charts) == 4  # MTTF, one partition, ETTR, drains
    height = int(m["height"])  # type: ignore[call-overload]
    shot = page.with_name("report.png")
    _chromium("--window-size=1280," + str(height), f"--screenshot={shot}", page.as_uri())
    img = Image.open(shot).convert("L")
    assert img.size[0] == 1280
    for left, top, w, h in charts:
        assert w > 300 and h > 150, (left, top, w, h)
        box = img.crop((int(left), int(top), int(left + w), int(top + h)))
        hist = box.histogram()
        dark = sum(hist[:200]) / (box.size[0] * box.size[1])
        # Axes, bars, markers and labels: far from a blank (white) box, not a solid block.
        assert 0.02 < dark < 0.8, (left, top, dark)
