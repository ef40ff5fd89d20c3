"""The blast-radius cap's ranking, pure: which of gpuwarden's drains hold the cap's places.

Drains are ranked by slurmctld's stamp (`reason_changed_at`), then by node name: the same order
on every node, whatever its own clock says. slurmctld re-stamps a reason when it appends to it
(" : Not responding", " : reboot issued"), so such a stamp is later than the drain's own. A node
ranking itself therefore takes every other restamped drain as ahead of it (its real stamp is no
later than the one shown) and its own shown stamp as it is (no earlier than its real one): two
nodes can never both rank themselves ahead of the other, so re-stamps never let a drain past
the cap (they can only hold one back).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpuwarden.core.configload import require
from gpuwarden.slurm.models import Node, NodeView


@dataclass(frozen=True)
class BlastRadius:
    """Never more than this many nodes drained by gpuwarden, per partition and in total."""

    max_drained_pct: float = 10.0
    max_drained_nodes: int = 0
    # 0: every node gpuwarden holds drained counts, however old its drain. Set a window to let
    # drains older than it (nodes waiting for repair) stop counting.
    window_s: float = 0.0
    # Time waited after a drain before ranking it against the others (at least 1.1 s whatever
    # this says: slurmctld stamps reasons in whole seconds, see gpuwarden.slurm.drain.TIE_S).
    settle_s: float = 2.0

    def __post_init__(self) -> None:
        require(0 <= self.max_drained_pct <= 100, "max_drained_pct", "a percentage 0-100")
        require(self.max_drained_nodes >= 0, "max_drained_nodes", "an integer >= 0 (0: no limit)")
        require(self.window_s >= 0, "window_s", "seconds >= 0 (0: no window)")
        require(0 <= self.settle_s <= 30, "settle_s", "0 to 30 seconds")


def limit(members: int, cap: BlastRadius) -> int:
    # At least one node can always be drained: a single bad node is never held back.
    return max(1, math.floor(members * cap.max_drained_pct / 100))


def stamp(n: Node) -> tuple[int, str]:
    # The controller's stamp first, the name to break ties: every node computes the same order.
    return (n.reason_changed_at or 0, n.name)


def our_recent_drains(nodes: Iterable[Node], now: float, window_s: float) -> list[Node]:
    """Nodes out of service with a gpuwarden reason (drained, or down since) in the window,
    in the controller's order. ``now`` is the controller's clock too."""
    return sorted((n for n in nodes if (n.drained or n.down) and n.reason_is_ours
                   and (not window_s or n.reason_changed_at is None
                        or now - n.reason_changed_at <= window_s)), key=stamp)


def controller_now(view: NodeView) -> float:
    """The controller's clock as a read showed it; without one, the newest stamp seen (which
    makes drains look younger: they count longer, never shorter)."""
    return float(view.ctld_time or max((n.reason_changed_at or 0 for n in view.nodes), default=0))


def ahead_of(me: str, drains: list[Node]) -> list[Node]:
    """The drains that rank before ``me``'s own (all of them when ``me`` has none)."""
    mine = next((n for n in drains if n.name == me), None)
    if mine is None:
        return drains
    return [n for n in drains
            if n.name != me and (n.restamped or stamp(n) < stamp(mine))]


def allows(me: str, partitions: tuple[str, ...], out: Iterable[Node],
           sizes: Mapping[str, int], cap: BlastRadius, now: float) -> tuple[bool, str]:
    """May ``me`` (in ``partitions``) be drained, given the nodes out of service and the
    partition sizes? Drains ranked before ``me``'s own take the places first."""
    ahead = ahead_of(me, our_recent_drains(out, now, cap.window_s))
    within = f" within {cap.window_s / 3600:g} h" if cap.window_s else ""
    # A node in no partition runs no jobs: only the absolute cap applies to it.
    for part in partitions:
        # An unknown size is the smallest: the cap is never passed for want of a number.
        size = sizes.get(part, 0)
        most = limit(size, cap)
        held = sum(1 for n in ahead if part in n.partitions)
        if held >= most:
            return False, (f"blast-radius cap: {held} of {size or '?'} nodes in {part} drained "
                           f"by gpuwarden{within}, limit {most} ({cap.max_drained_pct:g}%)")
    if cap.max_drained_nodes and len(ahead) >= cap.max_drained_nodes:
        return False, (f"blast-radius cap: {len(ahead)} nodes drained by gpuwarden{within}, "
                       f"limit {cap.max_drained_nodes}")
    return True, ""
