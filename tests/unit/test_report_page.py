"""The report page as a reader gets it: one file that fetches nothing, every figure on it in
the JSON, the charts inline; and `gpuwarden report` end to end on a simulated history."""

from __future__ import annotations

import gc
import html as htmllib
import json
import math
import os
import re
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpuwarden.accounting.calibrate import solve
from gpuwarden.accounting.history import from_files, read_events
from gpuwarden.cli import cli
from gpuwarden.config.context import Context
from gpuwarden.fleet.simulate import Fleet, write_history
from gpuwarden.lemon.scoring import ScoreConfig
from gpuwarden.report import charts
from gpuwarden.report import render as render_module
from gpuwarden.report.build import Report, as_dict, as_json, begin, build, scored
from gpuwarden.report.charts import power_label
from gpuwarden.report.collect import RunTally
from gpuwarden.report.render import render
from tests.unit.test_report_numbers import LEAVES, OPTS, history

_NOW = datetime(2026, 1, 1, tzinfo=UTC)
_SVG = re.compile(r"<svg\b.*?</svg>", re.S)
_STYLE = re.compile(r"<style\b.*?</style>", re.S)
_TAG = re.compile(r"<[^>]+>")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


@pytest.fixture(scope="module")
def page() -> tuple[str, str]:
    rep = build(history(LEAVES), OPTS, ScoreConfig())
    return render(rep), as_json(rep)


def test_nothing_is_fetched_when_the_page_is_opened(page: tuple[str, str]) -> None:
    html, _ = page
    assert not re.search(r"https?://", html)
    assert not re.search(r"(?i)@import|url\(\s*['\"]?(?!#)", html)  # CSS fetches nothing
    for attr, target in re.findall(r'\b(src|href|xlink:href)\s*=\s*"([^"]*)"', html):
        assert target.startswith("#"), (attr, target)  # in-page references only
    assert "<script" not in html


def test_every_figure_on_the_page_is_in_the_json(page: tuple[str, str]) -> None:
    html, doc = page
    text = htmllib.unescape(_TAG.sub(" ", _SVG.sub(" ", _STYLE.sub(" ", html))))
    shown = set(_NUMBER.findall(text))
    in_json = set(_NUMBER.findall(doc))
    assert shown, "no figure found on the page"
    assert shown <= in_json, sorted(shown - in_json)
    # Spot checks: the hand-computed figures are on the page itself.
    for figure in ("4.0", "1.11", "33.0", "0.7689", "0.826", "0.6119", "0.53", "50.0"):
        assert f">{figure}<" in html.replace(" ", "") or f" {figure} " in text, figure


def test_charts_are_inline_svg_with_titles_and_axis_units(page: tuple[str, str]) -> None:
    html, _ = page
    charts = _SVG.findall(html)
    # MTTF, two partitions' outcomes, ETTR, drains.
    assert len(charts) == 5
    for svg in charts:
        assert "viewBox" in svg and "<text" in svg
    for words in ("MTTF by job size", "(hours)", "runs per day (count)",
                  "ETTR (productive / wall time)", "node-hours per day", "job size (GPUs"):
        assert words in html, words
    ids = re.findall(r'\bid="(m[0-9a-f]{10}|p[0-9a-f]{10})"', html)
    assert len(ids) == len(set(ids))  # markers and clip paths never collide between charts


def test_the_mttf_charts_log_axes_are_labelled_in_plain_text(page: tuple[str, str]) -> None:
    """Powers as text a reader can search and copy (and no mathtext: its parser took half
    of the page's chart time)."""
    html, _ = page
    mttf = next(svg for svg in _SVG.findall(html) if "MTTF by job size" in svg)
    labels = set(re.findall(r">\s*((?:2|10)[\u207b\u2070-\u2079\u00b9\u00b2\u00b3]+)\s*<", mttf))
    assert {"2\u00b3", "2\u00b9\u2077"} <= labels, labels  # 8 and 131,072 GPUs
    assert any(label.startswith("10") for label in labels), labels


def _labels(lo: float, hi: float) -> list[str]:
    fig, ax = charts._figure()
    ax.set_yscale("log")
    ax.plot([1, 2], [lo, hi])
    ax.set_ylim(lo, hi)
    charts.power_axis(ax.yaxis, 10)
    svg = charts.to_svg(fig, "t")
    return re.findall(r">\s*([^<>\s][^<>]*?)\s*</text>", svg)


def test_a_log_axis_shorter_than_a_decade_still_has_a_scale() -> None:
    assert {"20", "30", "40", "60"} <= set(_labels(20, 60))
    wide = _labels(0.01, 1000)
    assert {"10\u207b\u00b2", "10\u2070", "10\u00b3"} <= set(wide)
    assert "20" not in wide and "0.02" not in wide  # only the powers where there are several


@pytest.mark.parametrize(("base", "value", "label"), [
    (2, 8.0, "2\u00b3"), (2, 131072.0, "2\u00b9\u2077"), (10, 0.01, "10\u207b\u00b2"),
    (10, 1.0, "10\u2070"), (10, 1000.0, "10\u00b3"), (10, 20.0, ""), (2, 0.0, ""),
    (10, -1.0, ""), (10, math.inf, ""), (2, 1.7e308, ""), (10, math.nan, ""),
    (10, 1e-300, "10\u207b\u00b3\u2070\u2070")])
def test_power_labels(base: int, value: float, label: str) -> None:
    assert power_label(base, value) == label


def test_the_page_drawn_beside_the_scoring_is_the_page_drawn_after_it() -> None:
    hist = history(LEAVES)
    rep = build(hist, OPTS, ScoreConfig())
    draft = begin(hist, OPTS, now=_NOW)
    got, data, html = render_module.page(draft, lambda: scored(draft, hist, ScoreConfig()))
    want = replace(rep, generated=got.generated)
    assert got == want and data == as_dict(want)
    assert html == render(want, as_dict(want))


def test_the_charts_are_drawn_while_the_lemons_are_scored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hist = history(LEAVES)
    draft = begin(hist, OPTS, now=_NOW)
    marker = tmp_path / "drawing"
    drawn = render_module.chart_svgs

    def drawing(r: Report) -> dict[str, object]:
        with marker.open("a") as f:
            f.write(f"{os.getpid()} {gc.isenabled()}\n")
        return drawn(r)

    def scoring() -> Report:
        deadline = time.monotonic() + 50
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # the chart child's start, not a fixed wait
        assert marker.exists(), "the charts were not being drawn while the lemons were scored"
        return scored(draft, hist, ScoreConfig())

    monkeypatch.setattr(render_module, "chart_svgs", drawing)
    _, _, html = render_module.page(draft, scoring)
    assert "MTTF by job size" in html
    # Drawn once, in the child, with collection off (`gcpause`), and that drawing used.
    (pid, collecting), = (line.split() for line in marker.read_text().splitlines())
    assert int(pid) != os.getpid() and collecting == "False"


def test_a_scoring_that_fails_stops_the_chart_child(monkeypatch: pytest.MonkeyPatch) -> None:
    hist = history(LEAVES)
    draft = begin(hist, OPTS, now=_NOW)
    started: list[Any] = []
    real = render_module.Aside

    def kept(*args: Any, **kwargs: Any) -> Any:
        started.append(real(*args, **kwargs))
        return started[-1]

    def scoring() -> Report:
        raise RuntimeError("scoring failed")

    monkeypatch.setattr(render_module, "Aside", kept)
    with pytest.raises(RuntimeError, match="scoring failed"):
        render_module.page(draft, scoring)
    (aside,) = started
    assert aside._proc is None or not aside._proc.is_alive()


def test_the_command_writes_the_page_and_the_json(tmp_path: Path) -> None:
    out = tmp_path / "hist"
    write_history(solve(), Fleet(nodes=128, days=2, seed=3), out)
    html, js = tmp_path / "report.html", tmp_path / "report.json"
    res = CliRunner().invoke(cli, ["report", "--from", str(out / "sacct"), "--events",
                                   str(out / "events.txt"), "-o", str(html), "--json", str(js),
                                   "--ckpt-interval", "30m"], obj=Context())
    assert res.exit_code == 0, res.output
    assert f"wrote {html} and {js}" in res.output
    doc = json.loads(js.read_text())
    assert doc["records"] > 0 and doc["ettr"]["assumptions"]["interval_h"] == 0.5
    assert doc["outcomes"]["runs"] == sum(c["runs"] for c in doc["mttf"]["classes"])
    # Every blamed run was found in the same pass's tally, and is the MTTF's failure count.
    assert doc["outcomes"]["unmatched_blames"] == 0
    assert doc["outcomes"]["totals"]["hardware"] == doc["mttf"]["failures"] > 0
    assert html.read_text().startswith("<!DOCTYPE html>")


def test_worker_processes_tally_what_one_process_does(tmp_path: Path) -> None:
    w = write_history(solve(), Fleet(nodes=128, days=3, seed=5), tmp_path)
    paths, events = [str(f) for f in w.files], read_events(str(w.events))
    one = from_files(paths, events, workers=1, collector=RunTally.factory())
    two = from_files(paths, events, workers=2, collector=RunTally.factory())
    assert isinstance(one.collected, RunTally) and isinstance(two.collected, RunTally)
    assert one.collected.cells == two.collected.cells and one.collected.cells
    assert one.collected.blamable == two.collected.blamable


def test_bad_options_say_what_is_wrong(tmp_path: Path) -> None:
    res = CliRunner().invoke(cli, ["report", "--from", str(tmp_path), "-o",
                                   str(tmp_path / "r.html"), "--ckpt-interval", "soon"],
                             obj=Context())
    assert res.exit_code == 2 and "expected a duration" in res.output
