"""Drain and return: one state machine, with a blast-radius cap on gpuwarden's drains.

The functions that carry out a decision (health gating's, made in gpuwarden.health.gate, or a
lemon drain) through the Slurm client, under the pure ranking in gpuwarden.slurm.drain_cap.
Nodes decide for themselves and Slurm has no compare-and-swap, so the drains themselves are the
claims, ordered by the controller's clock (slurmctld stamps `reason_changed_at` when it sets a
reason), never by a node's own clock and never in the node comment (operators' data):

1. read the nodes out of service (only those) and the partition sizes; at the cap already,
   hold ("would drain") without touching the node; hold too when the run has too little time
   left for step 3 and the calls around it;
2. drain, re-reading the node right before (never over anyone else's drain);
3. wait until the controller's clock has left the second of that drain, so that every drain
   stamped no later than ours is visible;
4. read the nodes out of service again and rank gpuwarden's drains (see drain_cap): the same
   order on every node. Within the cap the drain stays; past it, it is undone (resumed only
   if its reason is still ours) and the node says "would drain".

Whatever fails after step 2, the drain is undone if it can be; and a health drain that was
never seen within the cap (the node's counters do not record it as kept) is ranked again at
the node's next health check, so a drain left past the cap by a failure heals itself.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpuwarden.core.errors import NotOurDrainError, SlurmError
from gpuwarden.slurm import drain_cap as ranking
from gpuwarden.slurm.client import NodeBusyError, SlurmClient, gpuwarden_reason
from gpuwarden.slurm.drain_cap import BlastRadius
from gpuwarden.slurm.models import REASON_PREFIX, Node, NodeView, own_part, same_drain
from gpuwarden.slurm.reasons import HEALTH_TAG, is_health_drain

log = logging.getLogger(__name__)

# Comments older versions posted (a claim, read by the placement snapshot); never written now.
CLAIM = "drain claim"
WOULD = "would drain"
# slurmctld stamps reasons in whole seconds: after this long past our drain's answer, its clock
# has left that second, so every drain stamped no later than ours has landed and is visible.
# A precondition, never shortened: with less time left in the run, no drain is made.
TIE_S = 1.1
# What the calls after the drain (re-read, maybe an undo and a comment) get of the run's time.
CALLS_S = 2.0

# The pure ranking, under the names callers know.
cap_allows = ranking.allows
our_recent_drains = ranking.our_recent_drains
controller_now = ranking.controller_now


class Kind(enum.Enum):
    NOTHING = "nothing"
    DRAIN = "drain"
    RESUME = "resume"
    # CRITICAL on the node's own health drain, never seen within the cap: rank it again.
    RERANK = "rerank"


@dataclass(frozen=True)
class Decision:
    kind: Kind
    why: str
    passes: int
    # A healthy node in service: any gpuwarden comment left on it (a stale claim, a
    # "would drain") is cleared.
    clear_comment: bool = False


@dataclass(frozen=True)
class Applied:
    # "drained", "held", "resumed", "kept" (a drain made earlier, ranked again within the
    # cap), "none" (nothing done, e.g. already out)
    action: str
    detail: str
    # "held" by the blast-radius cap itself (not by drain = false or a run short of time).
    by_cap: bool = False


def apply(decision: Decision, node: Node, client: SlurmClient, cap: BlastRadius,
          clock: Callable[[], float] = time.time,
          sleep: Callable[[float], None] = time.sleep,
          left: Callable[[], float] | None = None) -> Applied:
    """Carry out ``decision`` for ``node``, as read from Slurm when the decision was made.

    ``left``: seconds left in the run (None: no deadline); a drain is only made when the wait
    of step 3 and the calls after it fit. ``clock`` is accepted for callers' sake; no decision
    here reads a node's own clock."""
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
    if decision.kind is Kind.RERANK:
        return rerank(decision.why, node, client, cap)
    if decision.kind is Kind.NOTHING:
        if decision.clear_comment and health_may_clear(node.comment):
            _clear_comment(client, me)
        return Applied("none", decision.why)
    return drain_within_cap(decision.why, me, client, cap, sleep, left)


def health_may_clear(comment: str) -> bool:
    """A healthy node drops its own stale comments: a "would drain" about its health, a drain
    claim left by an older version. Not the lemon scanner's "would drain", nor anyone else's
    comment."""
    if not comment.startswith(REASON_PREFIX):
        return False
    return not comment[len(REASON_PREFIX):].lstrip().startswith(f"{WOULD}: lemon")


def _moot_comment(comment: str, full: str) -> bool:
    """Once a drain is kept, the "would drain" the same kind of drain left earlier is moot;
    the other kind's (health's about the GPUs, the lemon scanner's about the jobs) stays."""
    if is_health_drain(full):
        return health_may_clear(comment)
    return comment.startswith(REASON_PREFIX) and HEALTH_TAG not in comment


def _clear_comment(client: SlurmClient, me: str) -> None:
    # Advisory text only: failing to clear it never changes what was done.
    try:
        client.set_comment(me, "")
    except SlurmError as exc:
        log.warning("%s: comment left as it is: %s", me, exc)


def _find(view: NodeView, me: str) -> Node:
    node = view.get(me)
    if node is None:
        raise SlurmError(f"node {me} is not known to slurmctld")
    return node


def _hold(client: SlurmClient, me: str, reason: str, why: str, by_cap: bool) -> Applied:
    log.warning("%s would drain (%s) but %s", me, reason, why)
    detail = f"{WOULD}: {reason} ({why})"
    try:
        # Advisory only (the cap never depends on it), and never over an operator's comment.
        client.set_comment(me, detail)
    except SlurmError as exc:
        log.warning("%s: not saying \"would drain\" in the node comment: %s", me, exc)
    return Applied("held", detail, by_cap)


def _short_of_time(left: Callable[[], float] | None) -> str:
    if left is None or left() - CALLS_S >= TIE_S:
        return ""
    return (f"only {max(0.0, left()):.1f} s left in this run; ranking a drain needs "
            f"{TIE_S:g} s plus {CALLS_S:g} s for its calls")


def drain_within_cap(reason: str, me: str, client: SlurmClient, cap: BlastRadius,
                     sleep: Callable[[float], None] = time.sleep,
                     left: Callable[[], float] | None = None) -> Applied:
    """Drain ``me`` if the cap allows, ranked by the controller's stamps (see the module doc).
    Shared by health gating and the lemon detector, so their drains count against one cap.
    Never takes over a drain that is already there, gpuwarden's own included."""
    full = gpuwarden_reason(reason)
    short = _short_of_time(left)
    if short:
        # Nothing touched (not even the comment): the time is not there for it.
        log.warning("%s would drain (%s) but %s", me, reason, short)
        return Applied("held", f"{WOULD}: {reason} ({short})")
    view = client.out_of_service(also=(me,))
    node = _find(view, me)
    if node.drained or node.down:
        return Applied("none", f"already {node.state_text}: {node.reason} ({node.owner or '?'})")
    sizes = client.partition_sizes()
    ok, why = cap_allows(me, node.partitions, view.nodes, sizes, cap, controller_now(view))
    if not ok:
        return _hold(client, me, reason, why, by_cap=True)
    try:
        client.drain(me, full, in_service_only=True)
    except NodeBusyError as exc:
        log.warning("%s", exc)
        return Applied("none", str(exc))
    except SlurmError as exc:
        # The update may have been applied all the same (a timeout after slurmctld took it).
        raise _undone(client, me, full, exc) from exc
    try:
        short = _short_of_time(left)
        if short:
            return _undo(client, me, reason, full, short, by_cap=False)
        wait = max(cap.settle_s, TIE_S)
        sleep(wait if left is None else min(wait, left() - CALLS_S))
        return _keep_or_undo(reason, full, me, client, cap, sizes)
    except SlurmError as exc:
        raise _undone(client, me, full, exc) from exc


def _undone(client: SlurmClient, me: str, full: str, exc: SlurmError) -> SlurmError:
    """After a failure past the drain: undo it if it is there, so no drain stays that was
    never ranked within the cap. What it says goes into the error."""
    try:
        what = ("undone" if client.resume(me, expect_reason=full)
                else "not in place, nothing to undo")
    except SlurmError as again:
        what = (f"left in place ({again}): the node's next health check ranks it again, or "
                "an operator resumes it")
    log.error("%s: drain %r not ranked against the blast-radius cap (%s): %s", me, full, exc,
              what)
    return SlurmError(f"{me}: drain {full!r} not ranked against the blast-radius cap ({exc}); "
                      f"the drain was {what}")


def _undo(client: SlurmClient, me: str, reason: str, full: str, why: str,
          note: str = "drained for a moment and undone", by_cap: bool = True) -> Applied:
    try:
        client.resume(me, expect_reason=full)
    except NotOurDrainError as exc:
        log.warning("%s", exc)
        return Applied("none", str(exc))
    return _hold(client, me, reason, f"{why}; {note}", by_cap)


def _keep_or_undo(reason: str, full: str, me: str, client: SlurmClient, cap: BlastRadius,
                  sizes: Mapping[str, int]) -> Applied:
    """Steps 3-4: with every drain stamped no later than ours visible, keep ours within the cap
    or undo it."""
    view = client.out_of_service(also=(me,))
    node = _find(view, me)
    if not same_drain(node.reason, full) or not (node.drained or node.down):
        # Changed by someone else since (resumed, or drained again with their reason): theirs.
        log.warning("%s: drained, then changed by someone else to %s %r: left as it is",
                    me, node.state_text, node.reason)
        return Applied("none", f"drained, then {node.state_text} with reason {node.reason!r} "
                               f"({node.owner or 'no owner'}): left as it is")
    ok, why = cap_allows(me, node.partitions, view.nodes, sizes, cap, controller_now(view))
    if not ok:
        return _undo(client, me, reason, full, why)
    if _moot_comment(node.comment, full):
        _clear_comment(client, me)  # a "would drain" from an earlier hold is moot now
    return Applied("drained", reason)


def ranks_within(node: Node, view: NodeView, sizes: Mapping[str, int],
                 cap: BlastRadius) -> tuple[bool, str]:
    """Does ``node``'s drain, as ``view`` shows it, rank within the cap? (True, "older than the
    cap's window") for a drain the window no longer counts; else `cap_allows`'s answer."""
    clock = controller_now(view)
    if node.name not in {n.name for n in our_recent_drains(view.nodes, clock, cap.window_s)}:
        return True, "older than the cap's window"
    return cap_allows(node.name, node.partitions, view.nodes, sizes, cap, clock)


def rerank(why: str, node: Node, client: SlurmClient, cap: BlastRadius) -> Applied:
    """Step 4 again for a health drain made earlier and never seen within the cap (the run
    that made it failed or was killed before it could rank it): keep it or undo it."""
    me, full = node.name, own_part(node.reason)
    view = client.out_of_service(also=(me,))
    now = _find(view, me)
    if not same_drain(now.reason, full) or not (now.drained or now.down):
        return Applied("none", f"{now.state_text} with reason {now.reason!r}: left as it is")
    ok, over = ranks_within(now, view, client.partition_sizes(), cap)
    if ok:
        return Applied("kept", f"{full} ({over or 'within the blast-radius cap'})")
    reason = full[len(REASON_PREFIX):].lstrip()
    log.warning("%s: health drain %r is past the blast-radius cap: undoing it (%s)", me, full,
                over)
    return _undo(client, me, reason, full, over, f"drained earlier, never ranked, undone ({why})")
