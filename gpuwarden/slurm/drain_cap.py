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

from gpuwarden.config.health import BlastRadius
from gpuwarden.slurm.models import Node, NodeView


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
