"""Node drains and downs over time, by who set them, from `sacctmgr show events`. Pure.

Owner: lemon (a `gpuwarden: lemon` reason), health (a reason health gating wrote, tagged
`[health]`: `health.reasons.is_health_drain`), slurm (one of slurmctld's own reasons,
`attribution.SLURM_DOWN_REASONS`), operator (anything else, a hand `gpuwarden drain --reason`
included). Each event counts for the node-hours it overlaps the history's window; an
event still open ("Unknown" end) counts up to the window's end. A node is out of service once
at a time: where its events overlap, each moment counts once, for the event that began first.
One cluster: slurmdbd may hold several, with the same node names; the events of the cluster
with the most node events are counted, the others' are counted apart (`other_clusters`).
Bars per day, per week past `bins.WEEKLY_OVER_DAYS`, as the failures over time.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from gpuwarden.accounting.attribution import LEMON_PREFIX, SLURM_DOWN_REASONS, event_time
from gpuwarden.report.bins import DAY, bin_days, day_label
from gpuwarden.report.mttfview import r
from gpuwarden.slurm.models import NodeEvent
from gpuwarden.slurm.reasons import is_health_drain

OWNERS = ("health", "lemon", "operator", "slurm")


def owner(reason: str) -> str:
    if reason.startswith(LEMON_PREFIX):
        return "lemon"
    if is_health_drain(reason):
        return "health"  # a hand `gpuwarden drain` falls through: an operator's
    if reason.startswith(SLURM_DOWN_REASONS):
        return "slurm"
    return "operator"


@dataclass(frozen=True)
class Drains:
    bin_days: int  # 1: per day, 7: per week
    days: list[str]  # the first UTC day of each bin
    node_hours: dict[str, list[float]]  # owner -> node-hours out of service per bin
    events: dict[str, int]  # owner -> events that overlap the window
    total_node_hours: dict[str, float]
    open_events: int  # of those, still open when exported: counted to the window's end
    cluster: str  # the cluster counted ("" when the events name none)
    other_clusters: dict[str, int]  # node events of other clusters, not counted


Span = tuple[float, float, str]  # start, end, owner


def _cluster(events: Sequence[NodeEvent]) -> str:
    seen = Counter(e.cluster for e in events if e.node)
    return min(seen, key=lambda c: (-seen[c], c)) if seen else ""


def _spans(events: Sequence[NodeEvent], cluster: str, lo: float,
           hi: float) -> tuple[dict[str, list[Span]], Counter[str], int]:
    """Per node, its events clipped to [lo, hi]; events per owner; still open."""
    per: dict[str, list[Span]] = defaultdict(list)
    count: Counter[str] = Counter()
    still_open = 0
    for e in events:
        start = event_time(e.start)
        if not e.node or start is None or e.cluster != cluster:
            continue  # the cluster's own events (TRES registration), unreadable times
        end = event_time(e.end)
        a, b = max(start, lo), min(hi if end is None else end, hi)
        if b <= a:
            continue
        who = owner(e.reason)
        count[who] += 1
        still_open += end is None
        per[e.node].append((a, b, who))
    return per, count, still_open


def _once(spans: list[Span]) -> list[Span]:
    """The spans of one node with overlaps removed: each moment goes to the earliest start."""
    out: list[Span] = []
    covered = float("-inf")
    for start, b, who in sorted(spans):
        a = max(start, covered)
        if b > a:
            out.append((a, b, who))
            covered = b
    return out


def drains(events: Sequence[NodeEvent], lo: float, hi: float) -> Drains:
    first = int(lo // DAY)
    ndays = max(0, int(-(-hi // DAY)) - first) if hi > lo else 0
    step = bin_days(ndays)
    nbins = -(-ndays // step)
    hours = {o: [0.0] * nbins for o in OWNERS}
    cluster = _cluster(events)
    per, count, still_open = _spans(events, cluster, lo, hi)
    for spans in per.values():
        for start, b, who in _once(spans):
            a, day = start, int(start // DAY)
            while a < b:
                cut = min(b, (day + 1) * DAY)
                hours[who][(day - first) // step] += (cut - a) / 3600
                a, day = cut, day + 1
    others = Counter(e.cluster for e in events if e.node and e.cluster != cluster)
    return Drains(step, [day_label(first + i * step) for i in range(nbins)],
                  {o: [r(h) or 0.0 for h in v] for o, v in hours.items()},
                  {o: count[o] for o in OWNERS},
                  {o: r(sum(v)) or 0.0 for o, v in hours.items()}, still_open, cluster,
                  dict(sorted(others.items())))
