"""The span of accounting really read: the window asked (`--since`, an export's own), bounded
below by the first thing the cluster is seen to have recorded. Pure.

`--since 30d` on a cluster registered four hours ago reads four hours: counted as 30 days,
node-days and "no failure in N days" would be 180 times too long. The first thing seen is the
earliest of: the cluster's registration (a `sacctmgr show events` line without a node,
"Cluster Registered TRES"), any node event, a run's start. sacctmgr lists the events that
overlap the window asked, so on a cluster older than the window the registration (still open)
began before it and the window asked is the window read. Without node events the first run
stands in: a cluster idle at the start of its export is then read from its first run, a span
too short (said, where it is shown) rather than one too long.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from gpuwarden.accounting.attribution import event_time
from gpuwarden.accounting.windows import Span, merged
from gpuwarden.slurm.models import NodeEvent

REGISTRATION = "the cluster's registration"
NODE_EVENT = "a node event"
FIRST_RUN = "the first run"


@dataclass(frozen=True)
class FirstSeen:
    at: float  # epoch seconds
    what: str  # REGISTRATION, NODE_EVENT or FIRST_RUN


def first_seen(first_start: float, events: Iterable[NodeEvent]) -> FirstSeen | None:
    """The earliest thing recorded: an event's start or the first run's (``first_start``,
    infinite when no run was read); None when nothing was."""
    seen: list[FirstSeen] = []
    for e in events:
        at = event_time(e.start)
        if at is not None:
            seen.append(FirstSeen(at, NODE_EVENT if e.node else REGISTRATION))
    if first_start != float("inf"):
        seen.append(FirstSeen(first_start, FIRST_RUN))
    # On a tie the registration names it (the runs and events came with it).
    order = (REGISTRATION, NODE_EVENT, FIRST_RUN)
    return min(seen, key=lambda s: (s.at, order.index(s.what))) if seen else None


def bounded(spans: Sequence[Span], seen: FirstSeen | None) -> tuple[Span, ...]:
    """``spans`` with nothing before ``seen``; () when nothing was seen (nothing was read)."""
    if seen is None:
        return ()
    return merged([(max(lo, seen.at), hi) for lo, hi in spans if hi > seen.at])


def human_span(seconds: float) -> str:
    """A span as people say it: minutes, hours up to two days, then days."""
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 2 * 86_400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86_400:.1f} days"


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def window_note(asked: Span | None, spans: Sequence[Span], seen: FirstSeen | None) -> str:
    """One line saying the window read, its length, the days missing between exports, and,
    where it began later than asked, why."""
    if not spans:
        if asked is not None and seen is None:
            return (f"history read: nothing recorded from {iso(asked[0])} to {iso(asked[1])} "
                    "(no run ended, no node event)")
        return "history read: the runs' own span (the accounting named no window)"
    lo, hi = spans[0][0], spans[-1][1]
    read = sum(b - a for a, b in spans)
    out = f"history read: {iso(lo)} to {iso(hi)} ({human_span(read)}"
    if hi - lo > read:
        out += f" read; {human_span(hi - lo - read)} missing between exports"
    out += ")"
    if asked is not None and seen is not None and seen.at > asked[0]:
        out += (f"; asked for {human_span(asked[1] - asked[0])} from {iso(asked[0])}, but "
                f"the first thing recorded is {seen.what} at {iso(seen.at)}")
        if seen.what == FIRST_RUN:
            out += " (no node event before it)"
    return out
