"""A short machine-readable health marker each node keeps in its Slurm node `Extra` field.

Slurm is the one channel every host shares, so `gpuwarden nodes` on an admin host reads from it
when each node last ran its health check and whether gating is off there. The marker is one key
of a JSON object; anything else an operator keeps in a JSON `Extra` is preserved, and an `Extra`
holding other text is never overwritten. Pure: encoding, decoding and deciding when to post.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KEY = "gpuwarden_health"
# Posted when something changes, else at most once per REFRESH_S per node: slurmctld is shared.
REFRESH_S = 1800.0
# A marker older than this means the periodic check has not run (or could not post) since.
STALE_S = 2 * REFRESH_S + 600.0
_MAX_OFF = 40
# What slurmd runs (gpuwarden.slurmconf.needs.HOOKS, the admin guide's path); a test holds them equal.
HEALTHCHECK = "/opt/gpuwarden/prolog/gpuwarden-healthcheck"
NO_MARKER_HEAD = "no health marker: gating has never reported from this node"
# Right after the slurm.conf step every node is here until its first HealthCheckInterval:
# say how to report now instead of leaving the admin to wait or guess.
NO_MARKER = (f"{NO_MARKER_HEAD}; to report now, run its HealthCheckProgram as root there "
             f"({HEALTHCHECK}), else Slurm runs it within HealthCheckInterval")


@dataclass(frozen=True)
class Marker:
    at: int  # when the periodic check last ran to the end
    status: str  # the verdict then: OK, WARNING, CRITICAL, UNKNOWN
    off: str = ""  # why gating is off or failing ("" when it works), e.g. "config", "state"
    since: int = 0  # since when `off` has held

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "st": self.status, "off": self.off[:_MAX_OFF], "since": self.since}


def decode(extra: str) -> Marker | None:
    """The marker in a node's Extra, or None when there is none (or it is not ours)."""
    doc = _object(extra)
    item = doc.get(KEY) if doc else None
    if not isinstance(item, dict):
        return None
    try:
        return Marker(int(item["at"]), str(item["st"]), str(item.get("off", "")),
                      int(item.get("since", 0)))
    except (KeyError, TypeError, ValueError):
        return None


def encode_into(extra: str, marker: Marker) -> str | None:
    """``extra`` with the marker set; None when Extra holds someone's non-JSON text."""
    if extra.strip() and _object(extra) is None:
        return None
    doc = _object(extra) or {}
    doc[KEY] = marker.to_json()
    return json.dumps(doc, separators=(",", ":"), sort_keys=True)


def carry_since(previous: Marker | None, off: str, now: float) -> int:
    """When the current `off` began: kept from the last marker while the reason is the same."""
    if not off:
        return 0
    if previous is not None and previous.off == off and previous.since:
        return previous.since
    return int(now)


def due(previous: Marker | None, new: Marker) -> bool:
    """Post when the status or the off reason changed, or the posted one is getting old."""
    if previous is None:
        return True
    if (previous.status, previous.off) != (new.status, new.off):
        return True
    return new.at - previous.at >= REFRESH_S


def describe(marker: Marker | None, now: float) -> str:
    """What `gpuwarden nodes` adds for a node; "" when its gating is on and current."""
    if marker is None:
        # Never a silent "healthy": gating may never have run here (not installed, config
        # broken before the first post, Extra holding other text).
        return NO_MARKER
    if marker.off:
        return f"health gating off since {_when(marker.since or marker.at)}: {marker.off}"
    if now - marker.at > STALE_S:
        return f"health verdict stale: last check {_when(marker.at)} ({(now - marker.at) / 3600:.1f} h ago)"
    return ""


def _when(ts: float) -> str:
    import time  # noqa: PLC0415 - only `gpuwarden nodes` formats times

    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _object(extra: str) -> dict[str, Any] | None:
    if not extra.strip():
        return None
    try:
        doc = json.loads(extra)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None
