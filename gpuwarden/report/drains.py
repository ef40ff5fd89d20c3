"""Node drains and downs over time, by who set them, from `sacctmgr show events`. Pure.

Owner: lemon (a `gpuwarden: lemon` reason), health (any other `gpuwarden:` reason: health
gating), slurm (one of slurmctld's own reasons, `attribution.SLURM_DOWN_REASONS`), operator
(anything else). Each event counts for the node-hours it overlaps the history's window; an
event still open ("Unknown" end) counts up to the window's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from gpuwarden.lemon.attribution import LEMON_PREFIX, SLURM_DOWN_REASONS, event_time
from gpuwarden.report.collect import DAY
from gpuwarden.slurm.models import REASON_PREFIX, NodeEvent

OWNERS = ("health", "lemon", "operator", "slurm")


def owner(reason: str) -> str:
    if reason.startswith(LEMON_PREFIX):
        return "lemon"
    if reason.startswith(REASON_PREFIX):
        return "health"
    if reason.startswith(SLURM_DOWN_REASONS):
        return "slurm"
    return "operator"


@dataclass(frozen=True)
class Drains:
    days: list[str]  # the UTC days of the window
    node_hours: dict[str, list[float]]  # owner -> node-hours out of service per day
    events: dict[str, int]  # owner -> events that overlap the window
    total_node_hours: dict[str, float]
    open_events: int  # still open when exported: counted to the window's end


def drains(events: list[NodeEvent] | tuple[NodeEvent, ...], lo: float, hi: float) -> Drains:
    first = int(lo // DAY)
    ndays = max(0, int(-(-hi // DAY)) - first) if hi > lo else 0
    hours = {o: [0.0] * ndays for o in OWNERS}
    count = dict.fromkeys(OWNERS, 0)
    still_open = 0
    for e in events:
        start = event_time(e.start)
        if not e.node or start is None:
            continue  # the cluster's own events (TRES registration), unreadable times
        end = event_time(e.end)
        if end is None:
            still_open += 1
        a, b = max(start, lo), min(hi if end is None else end, hi)
        if b <= a:
            continue
        who = owner(e.reason)
        count[who] += 1
        day = int(a // DAY)
        while a < b:
            cut = min(b, (day + 1) * DAY)
            hours[who][day - first] += (cut - a) / 3600
            a, day = cut, day + 1
    return Drains([datetime.fromtimestamp((first + i) * DAY, UTC).strftime("%Y-%m-%d")
                   for i in range(ndays)],
                  {o: [round(h, 1) for h in v] for o, v in hours.items()}, count,
                  {o: round(sum(v), 1) for o, v in hours.items()}, still_open)
