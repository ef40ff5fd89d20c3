"""The report of a simulated history as a browser shows it (Debian's headless `chromium`):
the charts are drawn where the page puts them, and nothing is wider than the window.

Skipped with the reason where chromium is not installed; a failure under CI=true
(`scripts/host-deps.sh chromium` installs it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwarden.accounting.calibrate import solve
from gpuwarden.cli import cli
from gpuwarden.config.context import Context
from gpuwarden.fleet.simulate import Fleet, write_history
from tests.browser import assert_charts_drawn, assert_fits


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("chromium")
    # A month of a 2,000-node fleet, as the issue asks the page to carry.
    write_history(solve(), Fleet(nodes=2000, days=30, seed=1), tmp / "hist")
    html = tmp / "report.html"
    res = CliRunner().invoke(cli, ["report", "--from", str(tmp / "hist" / "sacct"),
                                   "--events", str(tmp / "hist" / "events.txt"),
                                   "-o", str(html)], obj=Context())
    assert res.exit_code == 0, res.output
    return html


@pytest.mark.timeout(240)
@pytest.mark.parametrize("width", [1280, 720])
def test_nothing_overflows_the_window(page: Path, width: int) -> None:
    assert_fits(page, width)


@pytest.mark.timeout(240)
def test_the_screenshot_shows_every_chart(page: Path) -> None:
    assert_charts_drawn(page, 4)  # MTTF, one partition, ETTR, drains


@pytest.mark.timeout(240)
def test_a_chart_with_axes_but_no_data_fails_the_screenshot_check(tmp_path: Path) -> None:
    # The check passed any box that was neither blank nor solid: axes alone measured 0.034.
    from gpuwarden.report.charts import drains_chart
    from gpuwarden.report.drains import drains
    svg = drains_chart(drains([], 1767225600, 1767225600 + 30 * 86400))
    page = tmp_path / "empty.html"
    page.write_text(f"<!doctype html><html><body><main><div class=\"chart\">{svg}</div>"
                    "</main></body></html>")
    with pytest.raises(AssertionError, match="axes without data"):
        assert_charts_drawn(page, 1)
