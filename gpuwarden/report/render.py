"""The report page: one self-contained HTML file (inline CSS and SVG; nothing fetched when it
is opened). Every figure on it comes from the JSON document (`build.as_dict`)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from gpuwarden.accounting.aside import Aside
from gpuwarden.accounting.gcpause import paused
from gpuwarden.report import charts
from gpuwarden.report.build import Report, as_dict

TEMPLATES = Path(__file__).parent / "templates"
MAX_PARTITION_CHARTS = 6  # the rest are in the table (and the JSON)
EVIDENCE_SHOWN = 5


def _n(v: Any) -> str:
    """A figure as the JSON holds it; a dash for none (null in the JSON)."""
    return "\N{EN DASH}" if v is None else str(v)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True)
    env.filters["n"] = _n
    return env


def chart_svgs(r: Report) -> dict[str, Any]:
    o = r.outcomes
    return {
        "mttf": Markup(charts.mttf_chart(r.mttf)),  # noqa: S704 - SVG matplotlib wrote
        "ettr": Markup(charts.ettr_chart(r.ettr)),  # noqa: S704
        "drains": Markup(charts.drains_chart(r.drains)),  # noqa: S704
        "outcomes": [Markup(charts.outcomes_chart(p, o.bins, o.bin_days, i))  # noqa: S704
                     for i, p in enumerate(o.partitions[:MAX_PARTITION_CHARTS])],
    }


@paused()  # else its first collection walks the history just built (0.4 s at 10M records)
def render(r: Report, data: dict[str, Any] | None = None,
           svgs: dict[str, Any] | None = None) -> str:
    """``data``: `as_dict(r)` where the caller has it (for the JSON too): made once;
    ``svgs``: `chart_svgs(r)` where the caller drew them (`page`)."""
    return _environment().get_template("report.html.j2").render(
        r=as_dict(r) if data is None else data, charts=chart_svgs(r) if svgs is None else svgs,
        max_partitions=MAX_PARTITION_CHARTS, evidence_shown=EVIDENCE_SHOWN)


@paused()  # in the child: its collections would walk the history (built paused) and copy
def _drawn(r: Report) -> dict[str, Any]:  # the pages they touch
    return chart_svgs(r)


def page(draft: Report, finish: Callable[[], Report]) -> tuple[Report, dict[str, Any], str]:
    """The report ``finish`` makes of ``draft`` (`build.begin`; ``finish``: `build.scored`,
    which changes none of what the charts show), its JSON-ready data and its page. The
    draft's charts are drawn in a forked child (`accounting.aside`) on the other core while
    the lemons are scored: the scoring's fits run on one core, and the charts were a fifth of
    a month's report."""
    drawn = Aside(partial(_drawn, draft))
    try:
        r = finish()
        data = as_dict(r)
        svgs = drawn.result()
    except BaseException:
        drawn.cancel()
        raise
    return r, data, render(r, data, svgs)
