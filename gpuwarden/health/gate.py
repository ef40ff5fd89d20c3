"""Drain and return: one state machine, with a blast-radius cap on gpuwarden's drains.

Pure decisions (`decide`, `cap_allows`) and the functions that apply them through the Slurm
client. Nodes decide for themselves and Slurm has no compare-and-swap, so the drains themselves
are the claims, ordered by the controller's clock (slurmctld stamps `reason_changed_at` when it
sets a reason), never by a node's own clock and never in the node comment (operators' data):

1. read the nodes out of service (only those) and the partition sizes; at the cap already,
   hold ("would drain") without touching the node;
2. drain, re-reading the node right before (never over anyone else's drain);
3. wait until the controller's clock has left the second of that drain, so that every drain
   stamped no later than ours is visible;
4. read the nodes out of service again and rank gpuwarden's drains by (stamp, node name): the
   same order on every node. Within the cap the drain stays; past it, it is undone (resumed only
   if its reason is still ours) and the node says "would drain".
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from gpuwarden.errors import NotOurDrainError, SlurmError
from gpuwarden.health.config import BlastRadius
from gpuwarden.health.model import Status, Verdict
from gpuwarden.slurm.client import NodeBusyError, SlurmClient, gpuwarden_reason
from gpuwarden.slurm.models import REASON_PREFIX, Node, NodeView

log = logging.getLogger(__name__)

# Comments older versions posted (a claim, read by the placement snapshot); never written now.
CLAIM = "drain claim"
WOULD = "would drain"
# slurmctld stamps reasons in whole seconds: after this long past our drain's answer, its clock
# has left that second, so every drain stamped no later than ours has landed and is visible.
TIE_S = 1.1


class Kind(enum.Enum):
    NOTHING = "nothing"
    DRAIN = "drain"
    RESUME = "resume"


@dataclass(frozen=True)
class Decision:
    kind: Kind
    why: str
    passes: int
    # A healthy node in service: any gpuwarden comment left on it (a stale claim, a
    # "would drain") is cleared.
    clear_comment: bool = False


def decide(verdict: Verdict, node: Node, passes: int, resume_after: int,
           own_reason: str) -> Decision:
    """What the verdict means for this node, given its Slurm state and its passing streak.

    ``own_reason`` is the reason of the drain health gating made on this node; only a drain
    with exactly that reason is ever resumed here (not a `gpuwarden drain` by hand, not a
    lemon drain, not an operator's).
    """
    status = verdict.status
    if status == Status.CRITICAL:
        if node.drained or node.down:
            owner = "gpuwarden" if node.reason_is_ours else (node.reason_set_by or "slurm")
            return Decision(Kind.NOTHING, f"already {node.state_text} ({owner})", 0)
        return Decision(Kind.DRAIN, verdict.reason(), 0)
    if status == Status.UNKNOWN:
        # Uncertainty never drains and never resumes; it breaks the passing streak.
        return Decision(Kind.NOTHING, "verdict unknown: no action", 0)
    passes += 1
    if (node.drained or node.down) and own_reason and node.reason == own_reason:
        rebooted = bool(node.boot_time and node.reason_changed_at
                        and node.boot_time > node.reason_changed_at)
        if passes >= resume_after or rebooted:
            why = "rebooted since the drain" if rebooted else f"{passes} passing checks in a row"
            return Decision(Kind.RESUME, why, passes)
        return Decision(Kind.NOTHING, f"{passes} of {resume_after} passing checks", passes)
    return Decision(Kind.NOTHING, "healthy", passes, clear_comment=True)


def _limit(members: int, cap: BlastRadius) -> int:
    # At least one node can always be drained: a single bad node is never held back.
    return max(1, math.floor(members * cap.max_drained_pct / 100))


def _stamp(n: Node) -> tuple[int, str]:
    # The controller's stamp first, the name to break ties: every node computes the same order.
    return (n.reason_changed_at or 0, n.name)


def our_recent_drains(nodes: Iterable[Node], now: float, window_s: float) -> list[Node]:
    """Nodes out of service with a gpuwarden reason (drained, or down since) in the window,
    in the controller's order. ``now`` is the controller's clock too."""
    return sorted((n for n in nodes if (n.drained or n.down) and n.reason_is_ours
                   and (not window_s or n.reason_changed_at is None
                        or now - n.reason_changed_at <= window_s)), key=_stamp)


def controller_now(view: NodeView) -> float:
    """The controller's clock as a read showed it; without one, the newest stamp seen (which
    makes drains look younger: they count longer, never shorter)."""
    return float(view.ctld_time or max((n.reason_changed_at or 0 for n in view.nodes), default=0))


def cap_allows(me: str, partitions: tuple[str, ...], out: Iterable[Node],
               sizes: Mapping[str, int], cap: BlastRadius, now: float) -> tuple[bool, str]:
    """Pure: may ``me`` (in ``partitions``) be drained, given the nodes out of service and the
    partition sizes? Drains ranked before ``me``'s own (all of them when ``me`` is not drained
    yet) take the places first."""
    drains = our_recent_drains(out, now, cap.window_s)
    names = [n.name for n in drains]
    ahead = drains[:names.index(me)] if me in names else drains
    within = f" within {cap.window_s / 3600:g} h" if cap.window_s else ""
    # A node in no partition runs no jobs: only the absolute cap applies to it.
    for part in partitions:
        # An unknown size is the smallest: the cap is never passed for want of a number.
        size = sizes.get(part, 0)
        limit = _limit(size, cap)
        held = sum(1 for n in ahead if part in n.partitions)
        if held >= limit:
            return False, (f"blast-radius cap: {held} of {size or '?'} nodes in {part} drained "
                           f"by gpuwarden{within}, limit {limit} ({cap.max_drained_pct:g}%)")
    if cap.max_drained_nodes and len(ahead) >= cap.max_drained_nodes:
        return False, (f"blast-radius cap: {len(ahead)} nodes drained by gpuwarden{within}, "
                       f"limit {cap.max_drained_nodes}")
    return True, ""


@dataclass(frozen=True)
class Applied:
    action: str  # "drained", "held", "resumed", "none" (nothing done, e.g. already out)
    detail: str


def apply(decision: Decision, node: Node, client: SlurmClient, cap: BlastRadius,
          clock: Callable[[], float] = time.time,
          sleep: Callable[[float], None] = time.sleep) -> Applied:
    """Carry out ``decision`` for ``node``, as read from Slurm when the decision was made.

    ``clock`` is accepted for callers' sake; no decision here reads a node's own clock."""
    del clock
    me = node.name
    if decision.kind is Kind.RESUME:
        try:
            # Only the very drain the decision was about: re-checked at the update.
            client.resume(me, expect_reason=node.reason)
        except NotOurDrainError as exc:
            log.warning("%s", exc)
            return Applied("none", str(exc))
        if health_may_clear(node.comment):
            _clear_comment(client, me)
        return Applied("resumed", decision.why)
    if decision.kind is Kind.NOTHING:
        if decision.clear_comment and health_may_clear(node.comment):
            _clear_comment(client, me)
        return Applied("none", decision.why)
    return drain_within_cap(decision.why, me, client, cap, sleep)


def health_may_clear(comment: str) -> bool:
    """A healthy node drops its own stale comments: a "would drain" about its health, a drain
    claim left by an older version. Not the lemon scanner's "would drain", nor anyone else's
    comment."""
    if not comment.startswith(REASON_PREFIX):
        return False
    return not comment[len(REASON_PREFIX):].lstrip().startswith(f"{WOULD}: lemon")


def _clear_comment(client: SlurmClient, me: str) -> None:
    with contextlib.suppress(NotOurDrainError):
        client.set_comment(me, "")


def _find(view: NodeView, me: str) -> Node:
    node = view.get(me)
    if node is None:
        raise SlurmError(f"node {me} is not known to slurmctld")
    return node


def _hold(client: SlurmClient, me: str, reason: str, why: str) -> Applied:
    log.warning("%s would drain (%s) but %s", me, reason, why)
    detail = f"{WOULD}: {reason} ({why})"
    try:
        # Advisory only (the cap never depends on it), and never over an operator's comment.
        client.set_comment(me, detail)
    except NotOurDrainError as exc:
        log.warning("%s: not saying \"would drain\" in the node comment: %s", me, exc)
    return Applied("held", detail)


def drain_within_cap(reason: str, me: str, client: SlurmClient, cap: BlastRadius,
                     sleep: Callable[[float], None] = time.sleep) -> Applied:
    """Drain ``me`` if the cap allows, ranked by the controller's stamps (see the module doc).
    Shared by health gating and the lemon detector, so their drains count against one cap.
    Never takes over a drain that is already there, gpuwarden's own included."""
    full = gpuwarden_reason(reason)
    view = client.out_of_service(also=(me,))
    node = _find(view, me)
    if node.drained or node.down:
        return Applied("none", f"already {node.state_text}: {node.reason} ({node.owner or '?'})")
    sizes = client.partition_sizes()
    ok, why = cap_allows(me, node.partitions, view.nodes, sizes, cap, controller_now(view))
    if not ok:
        return _hold(client, me, reason, why)
    try:
        client.drain(me, full, in_service_only=True)
    except NodeBusyError as exc:
        log.warning("%s", exc)
        return Applied("none", str(exc))
    sleep(max(cap.settle_s, TIE_S))
    return _keep_or_undo(reason, full, me, client, cap, sizes)


def _keep_or_undo(reason: str, full: str, me: str, client: SlurmClient, cap: BlastRadius,
                  sizes: Mapping[str, int]) -> Applied:
    """Steps 3-4: with every drain stamped no later than ours visible, keep ours within the cap
    or undo it."""
    view = client.out_of_service(also=(me,))
    node = _find(view, me)
    if node.reason != full or not (node.drained or node.down):
        # Changed by someone else since (resumed, or drained again with their reason): theirs.
        log.warning("%s: drained, then changed by someone else to %s %r: left as it is",
                    me, node.state_text, node.reason)
        return Applied("none", f"drained, then {node.state_text} with reason {node.reason!r} "
                               f"({node.owner or 'no owner'}): left as it is")
    ok, why = cap_allows(me, node.partitions, view.nodes, sizes, cap, controller_now(view))
    if ok:
        if node.comment.startswith(REASON_PREFIX):
            _clear_comment(client, me)  # a "would drain" from an earlier hold is moot now
        return Applied("drained", reason)
    try:
        client.resume(me, expect_reason=full)
    except NotOurDrainError as exc:
        log.warning("%s", exc)
        return Applied("none", str(exc))
    return _hold(client, me, reason, f"{why}; drained for a moment and undone")
