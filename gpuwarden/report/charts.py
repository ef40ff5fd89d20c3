"""The report's charts as inline SVG, drawn with matplotlib's SVG backend (no pyplot, no
display). Colours are the Okabe-Ito palette (distinct for the common colour-vision
deficiencies), and every series also has its own hatch or marker, so a chart reads in grey
print too. Text stays text (svg.fonttype none): smaller, and searchable on the page.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence

import matplotlib
from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.backends.backend_svg import FigureCanvasSVG
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from gpuwarden.report.bins import tick_labels, unit
from gpuwarden.report.drains import OWNERS, Drains
from gpuwarden.report.ettr import EttrSection
from gpuwarden.report.mttfview import MttfSection
from gpuwarden.report.outcomes import CLASSES, PartitionSeries
from gpuwarden.report.text import clean

OKABE_ITO = {"black": "#000000", "orange": "#E69F00", "sky": "#56B4E9", "green": "#009E73",
             "yellow": "#F0E442", "blue": "#0072B2", "vermillion": "#D55E00",
             "purple": "#CC79A7"}
CLASS_STYLE = {"hardware": ("vermillion", "xx"), "user": ("blue", "//"),
               "timeout": ("orange", ".."), "cancelled": ("sky", "\\\\"),
               "preempted": ("purple", "++")}
OWNER_STYLE = {"health": ("green", "//"), "lemon": ("vermillion", "xx"),
               "operator": ("blue", ".."), "slurm": ("orange", "\\\\")}
_PROLOG = re.compile(r"^.*?(?=<svg)", re.S)
_NS = re.compile(r'\s+xmlns(:\w+)?="[^"]*"')
_SIZE = re.compile(r'<svg([^>]*?) width="[^"]*" height="[^"]*"')
_ID = re.compile(r'\bid="([^"]+)"')


def _figure(width: float = 8.0, height: float = 3.6) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasSVG(fig)
    return fig, fig.add_subplot()


def to_svg(fig: Figure, name: str) -> str:
    """Inline SVG: no XML prolog or DOCTYPE, no namespace URLs (HTML's parser needs none),
    sized by its viewBox; ``name`` salts the ids so that charts on one page never share one."""
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": name, "svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", metadata={"Creator": None, "Date": None,
                                                  "Format": None, "Type": None})
    svg = _NS.sub("", _PROLOG.sub("", buf.getvalue(), count=1))
    svg = _SIZE.sub(rf'<svg\1 role="img" aria-label="{name}"', svg, count=1)
    return _own_ids(svg, name).strip()


def _own_ids(svg: str, name: str) -> str:
    """Every element id (and each reference to one) prefixed with the chart's name: the salt
    alone leaves ids matplotlib names itself (figure_1, axes_1, patch_1...) the same in
    every chart, and one page holds them all."""
    ids = set(_ID.findall(svg))
    if not ids:
        return svg

    def one(m: re.Match[str]) -> str:
        key = m.group(2)
        return f"{m.group(1)}{name}-{key}" if key in ids else m.group(0)
    svg = re.sub(r'(\bid=")([^"]+)(?=")', one, svg)
    # References only (url(#..), href="#.."): a "#" in text (a partition's name) is text.
    return re.sub(r'((?:url\(|href=")#)([A-Za-z_][\w.-]*)', one, svg)


def _colour(name: str) -> str:
    return OKABE_ITO[name]


def _bars(v: float, lo: float | None, hi: float | None) -> tuple[float, float]:
    """Error-bar lengths below and above ``v`` (no upper bound: drawn to 10x)."""
    return v - (lo if lo is not None else v), (hi if hi is not None else 10 * v) - v


Point = tuple[int, float, float, float]  # x, y, error below, error above


def _points(m: MttfSection) -> dict[str, list[Point]]:
    out: dict[str, list[Point]] = {"site": [], "paper": [], "r_f": [], "history": []}
    for c in m.classes:
        if c.mttf_h is not None:
            out["site"].append((c.gpus, c.mttf_h, *_bars(c.mttf_h, c.mttf_low_h, c.mttf_high_h)))
        if c.paper_mttf_h is not None:
            out["paper"].append((c.gpus, c.paper_mttf_h, 0.0, 0.0))
    for p in m.projections:
        if p.paper_h is not None:
            out["paper"].append((p.gpus, p.paper_h, 0.0, 0.0))
        if p.from_node_rate_h is not None:
            out["r_f"].append((p.gpus, p.from_node_rate_h, *_bars(
                p.from_node_rate_h, p.from_node_rate_low_h, p.from_node_rate_high_h)))
        if p.from_history_h is not None:
            out["history"].append((p.gpus, p.from_history_h, 0.0, 0.0))
    return out


_SUPERSCRIPT = str.maketrans("-0123456789",
                             "\u207b\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079")


def power_label(base: int, v: float) -> str:
    """A log axis's tick at a power of ``base`` as plain text (2\u00b9\u2070, 10\u207b\u00b9); "" between
    powers. matplotlib's own labels are mathtext, whose parser took half of the page's chart
    time (`mttf_chart`)."""
    if not (v > 0 and math.isfinite(v)):
        return ""
    e = round(math.log(v, base))
    try:
        power = float(base) ** e
    except OverflowError:
        return ""
    return f"{base}{str(e).translate(_SUPERSCRIPT)}" if math.isclose(v, power) else ""


def powers_in_view(axis: Axis, base: int) -> int:
    """How many powers of ``base`` the axis shows."""
    lo, hi = sorted(axis.get_view_interval())
    if not (lo > 0 and math.isfinite(hi)):
        return 0
    return max(0, math.floor(math.log(hi, base) + 1e-9) - math.ceil(math.log(lo, base) - 1e-9)
               + 1)


def power_axis(axis: Axis, base: int) -> None:
    """Powers labelled as `power_label` writes them; on an axis that shows fewer than two,
    the ticks between them too (plain figures), as matplotlib does, so that it has a scale."""
    def minor(v: float, _pos: int | None) -> str:
        return f"{v:g}" if powers_in_view(axis, base) < 2 and math.isfinite(v) else ""
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: power_label(base, v)))
    axis.set_minor_formatter(FuncFormatter(minor))


def mttf_chart(m: MttfSection) -> str:
    fig, ax = _figure(8.0, 4.2)
    styles = {"site": ("o", "blue", "this site, with 95% interval"),
              "paper": ("D", "vermillion", "Meta (paper)"),
              "r_f": ("^", "green", "1/N projection from r_f, with 95% interval"),
              "history": ("s", "black", "1/N projection from job failures")}
    for key, pts in _points(m).items():
        if not pts:
            continue
        marker, colour, label = styles[key]
        xs, ys, below, above = zip(*pts, strict=True)
        ax.errorbar(xs, ys, yerr=[below, above], fmt=marker, color=_colour(colour),
                    mfc="none" if key in ("paper", "history") else _colour(colour),
                    markersize=7, capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    power_axis(ax.xaxis, 2)
    power_axis(ax.yaxis, 10)
    ax.set_xlabel("job size (GPUs)")
    ax.set_ylabel("mean time to failure (hours)")
    ax.set_title("MTTF by job size, projected to 16,384 and 131,072 GPUs")
    ax.grid(True, which="major", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    return to_svg(fig, "mttf")


def _stacked(ax: Axes, labels: Sequence[str], series: dict[str, list[float]],
             styles: dict[str, tuple[str, str]]) -> None:
    x = list(range(len(labels)))
    bottom = [0.0] * len(labels)
    for key, values in series.items():
        colour, hatch = styles[key]
        ax.bar(x, values, bottom=bottom, color=_colour(colour), hatch=hatch,
               edgecolor="#333333", linewidth=0.4, label=key)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    step = max(1, len(labels) // 10)
    ticks, _ = tick_labels(labels)
    ax.set_xticks(x[::step], ticks[::step])
    _legend_below(ax, len(series))


def _time_axis(ax: Axes, labels: Sequence[str], what: str) -> None:
    ax.set_xlabel(f"{what} ({tick_labels(labels)[1]})")


def _legend_below(ax: Axes, columns: int) -> None:
    """Under the plot, so that it never hides a bar."""
    fig = ax.get_figure()
    assert isinstance(fig, Figure)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=columns,
               fontsize=8, frameon=False)


def outcomes_chart(p: PartitionSeries, bins: Sequence[str], bin_days: int, index: int) -> str:
    fig, ax = _figure()
    _stacked(ax, bins, {c: [float(v) for v in p.counts[c]] for c in CLASSES}, CLASS_STYLE)
    _time_axis(ax, bins, f"UTC {unit(bin_days)} the run ended")
    ax.set_ylabel(f"runs per {unit(bin_days)} (count)")
    # The partition name is the site's text: never read as mathtext ($...$).
    ax.set_title(f"Runs that did not complete, by class: partition {clean(p.partition)}",
                 parse_math=False)
    return to_svg(fig, f"outcomes-{index}")


def ettr_chart(e: EttrSection) -> str:
    fig, ax = _figure()
    width = 0.27
    x = list(range(len(e.rows)))
    k = e.assumptions.spares
    for i, (label, key, colour, hatch) in enumerate((
            ("today's interval", "ettr_now", "sky", "//"),
            ("Young/Daly interval", "ettr_daly", "blue", ".."),
            (f"Young/Daly + {k} spare node(s)", "ettr_spares", "orange", "xx"))):
        # A missing value (no Daly interval without a failure) is no bar, not a 0 bar.
        shown = [(xi + (i - 1) * width, v) for xi, r in zip(x, e.rows, strict=True)
                 if (v := getattr(r, key)) is not None]
        ax.bar([p for p, _ in shown], [v for _, v in shown], width, color=_colour(colour),
               hatch=hatch, edgecolor="#333333", linewidth=0.4, label=label)
    ax.set_xticks(x, [f"≤{r.gpus}" for r in e.rows])
    ax.set_ylim(0, 1.15)
    ax.set_xlabel("job size (GPUs, class upper bound)")
    ax.set_ylabel("ETTR (productive / wall time)")
    ax.set_title("Effective training time ratio by job size")
    _legend_below(ax, 3)
    return to_svg(fig, "ettr")


def drains_chart(d: Drains) -> str:
    fig, ax = _figure()
    _stacked(ax, d.days, {o: d.node_hours[o] for o in OWNERS}, OWNER_STYLE)
    _time_axis(ax, d.days, f"UTC {unit(d.bin_days)}")
    ax.set_ylabel(f"nodes out of service (node-hours per {unit(d.bin_days)})")
    ax.set_title("Drained or down nodes by who took them out of service")
    return to_svg(fig, "drains")
