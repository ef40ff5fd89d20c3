"""The windows of several `sacct --json` exports read together, checked so that no run counts
twice. Pure.

sacct lists a run in every window it overlaps, so a reader counts each run only in the window
it ended in (`lemon.history`). That holds only when the windows do not overlap, and when each
has its end:
- before 26.05.2 Slurm drops argv's last element from ``meta.command``; an export made with
  ``--endtime`` last names its start and no end. Its end is then the next export's start (the
  runs that ended after it are that export's): taken, and said;
- two exports whose windows overlap (weekly and daily exports of the same days, a copy of a
  file under another name) would count every run in the overlap twice: refused, naming both
  files and the overlap.
An export without a window (no ``meta``, or a command without an absolute --starttime) counts
every run it lists, said. Beside other exports it is checked once read (`check_ends`): where
the span its runs ended in meets another export's window or runs, a run listed in both counts
twice, which the log says (exports split by partition or user meet that way too, and are
right).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

Window = tuple[float | None, float | None]


class OverlapError(ValueError):
    """Two exports' windows overlap."""


@dataclass(frozen=True)
class Planned:
    windows: list[Window]  # one per export, in the order given
    notes: list[str]  # what was inferred, for the log


def _iso(t: float) -> str:
    try:
        return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    except (ValueError, OverflowError, OSError):
        # A time no calendar holds (a malformed export): said as the number it is.
        return f"epoch second {t:.0f}"


def _shown(w: Window) -> str:
    lo, hi = w
    return (f"{_iso(lo) if lo is not None else 'the beginning'} to "
            f"{_iso(hi) if hi is not None else 'its export'}")


def plan(paths: Sequence[str], windows: Sequence[Window]) -> Planned:
    """Each export's window with a lost end filled in; OverlapError when two overlap."""
    starts = sorted(lo for lo, _ in windows if lo is not None)
    out: list[Window] = []
    notes: list[str] = []
    for path, (lo, hi) in zip(paths, windows, strict=True):
        end = hi
        if lo is not None and hi is None:
            later = [s for s in starts if s > lo]
            if later:
                end = min(later)
                notes.append(f"{path}: its window names no end that can be read (an end "
                             f"such as 'now', or one Slurm before 26.05.2 dropped as the "
                             f"command's last argument: put --json last); taken as the next "
                             f"export's start, {_iso(end)}")
        out.append((lo, end))
    spans = sorted((-math.inf if lo is None else lo, math.inf if hi is None else hi, i)
                   for i, (lo, hi) in enumerate(out) if (lo, hi) != (None, None))
    reach, a = -math.inf, -1  # the latest end so far, and whose
    for lo, hi, b in spans:
        if lo < reach:
            raise OverlapError(
                f"{paths[a]} ({_shown(out[a])}) and {paths[b]} ({_shown(out[b])}) overlap: "
                f"the runs that ended in both would count twice; give exports whose windows "
                f"(sacct --starttime/--endtime) do not overlap")
        if hi > reach:
            reach, a = hi, b
    return Planned(out, notes)


Span = tuple[float, float]


def windowless(paths: Sequence[str], windows: Sequence[Window]) -> list[str]:
    """Notes, one per export that named no window once read (its "meta" may be found only
    at its end, so this is said after reading, not before)."""
    then = ("and the span is its runs'" if len(paths) == 1
            else "checked against the other exports' runs")
    return [f"{path}: names no window (no \"meta\", or no absolute --starttime): every run "
            f"it lists counts, {then}"
            for path, w in zip(paths, windows, strict=True) if w == (None, None)]


def check_ends(paths: Sequence[str], windows: Sequence[Window],
               ends: Sequence[Span | None]) -> list[str]:
    """Warnings, one per pair of an export without a window (``windows[i]`` is (None, None))
    whose runs ended (``ends[i]``: first and last end of the runs counted, None for none) in a
    span that meets another export's counted runs': a run sacct listed in both ends in both
    spans, and counts twice. (A windowed export's counted runs ended inside its window.)"""
    out: list[str] = []
    for i, (w, span) in enumerate(zip(windows, ends, strict=True)):
        if w != (None, None) or span is None:
            continue
        a, b = span
        for j, (other, theirs) in enumerate(zip(windows, ends, strict=True)):
            # Two window-less exports: said once, on the first (every pair it meets).
            if j == i or theirs is None or (other == (None, None) and j < i):
                continue
            if a <= theirs[1] and theirs[0] <= b:
                what = f"runs that ended {_iso(theirs[0])} to {_iso(theirs[1])}"
                if other != (None, None):
                    what = f"{_shown(other)}, its {what}"
                out.append(
                    f"{paths[i]} names no window and lists runs that ended {_iso(a)} to "
                    f"{_iso(b)}, which meets {paths[j]} ({what}): a run listed in both counts "
                    f"twice (right only if they list other jobs: other partitions or users); "
                    f"export each with absolute --starttime/--endtime that do not overlap")
    return out


def merged(spans: Sequence[Span]) -> tuple[Span, ...]:
    """The spans sorted, overlapping and touching ones joined: what was read, once each."""
    out: list[Span] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def covered_s(spans: Sequence[Span]) -> float:
    """Seconds the merged spans cover (a day missing between two exports is not covered)."""
    return sum(hi - lo for lo, hi in merged(spans))


def inside(at: float, spans: Sequence[Span], slack: float = 0.0) -> bool:
    return any(lo - slack <= at <= hi + slack for lo, hi in spans)


def hull(spans: Sequence[Span]) -> Span | None:
    return (min(lo for lo, _ in spans), max(hi for _, hi in spans)) if spans else None
