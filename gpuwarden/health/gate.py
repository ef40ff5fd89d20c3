"""Health gating's decision: what a verdict means for the node, given its Slurm state.

Pure; gpuwarden.slurm.drain carries the decision out under the blast-radius cap.
"""

from __future__ import annotations

from gpuwarden.health.model import Status, Verdict
from gpuwarden.slurm.drain import Decision, Kind
from gpuwarden.slurm.models import Node, same_drain
from gpuwarden.slurm.reasons import is_health_drain


def decide(verdict: Verdict, node: Node, passes: int, resume_after: int,
           own_reason: str, kept: bool = False) -> Decision:
    """What the verdict means for this node, given its Slurm state and its passing streak.

    ``own_reason`` is the reason of the drain health gating made on this node; only that drain
    (with or without what slurmctld appended to it since) is ever resumed here (not a
    `gpuwarden drain` by hand, not a lemon drain, not an operator's). ``kept``: the node's
    counters record that drain as kept within the cap; until then a CRITICAL node ranks it
    again on every run.
    """
    status = verdict.status
    ours = bool(own_reason) and (node.drained or node.down) and same_drain(node.reason,
                                                                           own_reason)
    if status == Status.CRITICAL:
        return _critical(verdict, node, ours and not kept and is_health_drain(node.reason))
    if status == Status.UNKNOWN:
        # Uncertainty never drains and never resumes; it breaks the passing streak.
        return Decision(Kind.NOTHING, "verdict unknown: no action", 0)
    passes += 1
    if ours:
        # A stamp slurmctld moved later (" : reboot issued") still precedes the reboot itself.
        rebooted = bool(node.boot_time and node.reason_changed_at
                        and node.boot_time > node.reason_changed_at)
        if passes >= resume_after or rebooted:
            why = "rebooted since the drain" if rebooted else f"{passes} passing checks in a row"
            return Decision(Kind.RESUME, why, passes)
        return Decision(Kind.NOTHING, f"{passes} of {resume_after} passing checks", passes)
    return Decision(Kind.NOTHING, "healthy", passes, clear_comment=True)


def _critical(verdict: Verdict, node: Node, unranked: bool) -> Decision:
    if unranked:
        return Decision(Kind.RERANK, verdict.reason(), 0)
    if node.drained or node.down:
        owner = "gpuwarden" if node.reason_is_ours else (node.reason_set_by or "slurm")
        return Decision(Kind.NOTHING, f"already {node.state_text} ({owner})", 0)
    return Decision(Kind.DRAIN, verdict.reason(), 0)
