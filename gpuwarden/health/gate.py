"""Drain and return: one state machine, with a blast-radius cap on gpuwarden's drains.

Pure decisions (`decide`, `cap_allows`) and one function that applies them through the Slurm
client. Nodes decide for themselves, so concurrent drains are serialised through Slurm: a node
first posts a claim in its node comment, waits `settle_s` for other claims to show, and drains
only if its claim ranks within the cap. Past the cap the node says "would drain" instead.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpuwarden.errors import NotOurDrainError
from gpuwarden.health.config import BlastRadius
from gpuwarden.health.model import Status, Verdict
from gpuwarden.slurm.client import SlurmClient
from gpuwarden.slurm.models import REASON_PREFIX, Node

log = logging.getLogger(__name__)

CLAIM = "drain claim"
WOULD = "would drain"


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


def our_recent_drains(nodes: Iterable[Node], now: float, window_s: float) -> list[Node]:
    """Nodes out of service with a gpuwarden reason (drained, or down since) in the window."""
    return [n for n in nodes if (n.drained or n.down) and n.reason_is_ours
            and (not window_s or n.reason_changed_at is None
                 or now - n.reason_changed_at <= window_s)]


CLAIM_TTL_S = 60.0


def claims(nodes: Iterable[Node], now: float) -> list[tuple[float, str]]:
    """Pending drain claims, oldest first; a claim left by a crashed check expires."""
    out = []
    prefix = f"{REASON_PREFIX} {CLAIM} "
    for n in nodes:
        if n.comment.startswith(prefix) and not n.drained:
            try:
                ts = float(n.comment[len(prefix):].split()[0])
            except (ValueError, IndexError):
                continue
            if now - ts <= CLAIM_TTL_S:
                out.append((ts, n.name))
    return sorted(out)


def cap_allows(me: str, nodes: list[Node], cap: BlastRadius, now: float) -> tuple[bool, str]:
    """Pure: may ``me`` drain, given every node's state and the pending claims?"""
    by_name = {n.name: n for n in nodes}
    mine = by_name[me]
    drained = our_recent_drains(nodes, now, cap.window_s)
    ahead = [name for _, name in claims(nodes, now)]
    rank = ahead.index(me) if me in ahead else len(ahead)
    for part in mine.partitions or ("(none)",):
        members = [n for n in nodes if part in n.partitions] if mine.partitions else nodes
        limit = _limit(len(members), cap)
        held = sum(1 for n in drained if n in members)
        queued = sum(1 for name in ahead[:rank] if by_name[name] in members)
        if held + queued >= limit:
            within = f" within {cap.window_s / 3600:g} h" if cap.window_s else ""
            return False, (f"blast-radius cap: {held} of {len(members)} nodes in {part} drained "
                           f"by gpuwarden{within}, limit {limit} ({cap.max_drained_pct:g}%)")
    if cap.max_drained_nodes and len(drained) + rank >= cap.max_drained_nodes:
        return False, (f"blast-radius cap: {len(drained)} nodes drained by gpuwarden, "
                       f"limit {cap.max_drained_nodes}")
    return True, ""


@dataclass(frozen=True)
class Applied:
    action: str  # "drained", "held", "resumed", "none"
    detail: str


def apply(decision: Decision, node: Node, client: SlurmClient, cap: BlastRadius,
          clock: Callable[[], float] = time.time,
          sleep: Callable[[float], None] = time.sleep) -> Applied:
    """Carry out ``decision`` for ``node``, as read from Slurm when the decision was made."""
    me = node.name
    if decision.kind is Kind.RESUME:
        client.resume(me)
        _clear_comment(client, me)
        return Applied("resumed", decision.why)
    if decision.kind is Kind.NOTHING:
        if decision.clear_comment and health_may_clear(node.comment, clock()):
            _clear_comment(client, me)
        return Applied("none", decision.why)
    return drain_within_cap(decision.why, me, client, cap, clock, sleep)


def health_may_clear(comment: str, now: float) -> bool:
    """A healthy node drops its own stale comments: a "would drain" about its health, a drain
    claim past its TTL. Not the lemon scanner's "would drain", nor a fresh claim (the scanner
    may be mid-claim for this node), nor anyone else's comment."""
    if not comment.startswith(REASON_PREFIX):
        return False
    body = comment[len(REASON_PREFIX):].lstrip()
    if body.startswith(f"{WOULD}: lemon"):
        return False
    if body.startswith(CLAIM):
        try:
            return now - float(body[len(CLAIM):].split()[0]) > CLAIM_TTL_S
        except (ValueError, IndexError):
            return True
    return True


def _clear_comment(client: SlurmClient, me: str) -> None:
    with contextlib.suppress(NotOurDrainError):
        client.set_comment(me, "")


def drain_within_cap(reason: str, me: str, client: SlurmClient, cap: BlastRadius,
                     clock: Callable[[], float] = time.time,
                     sleep: Callable[[float], None] = time.sleep) -> Applied:
    """Claim a place under the cap, let other claims show, then drain or say "would drain".
    Shared by health gating and the lemon detector, so their drains count against one cap."""
    ok, why = cap_allows(me, client.nodes(), cap, clock())
    if ok:
        try:
            client.set_comment(me, f"{CLAIM} {clock():.6f}")
        except NotOurDrainError:
            # Without a visible claim other nodes cannot see us coming: the cap could be passed.
            log.warning("%s would drain (%s) but its node comment belongs to someone else, so "
                        "it cannot claim a place under the blast-radius cap", me, reason)
            return Applied("held", f"would drain: {reason} (cannot post a drain claim: the node "
                                   "comment was set by someone else)")
        sleep(cap.settle_s)
        ok, why = cap_allows(me, client.nodes(), cap, clock())
    if not ok:
        log.warning("%s would drain (%s) but %s", me, reason, why)
        try:
            client.set_comment(me, f"{WOULD}: {reason} ({why})")
        except NotOurDrainError as exc:
            log.warning("%s", exc)
        return Applied("held", f"would drain: {reason} ({why})")
    client.drain(me, reason)
    _clear_comment(client, me)
    return Applied("drained", reason)
