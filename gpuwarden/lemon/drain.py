"""Drain lemons under health gating's blast-radius cap and drain rules."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuwarden.core.errors import NotOurDrainError, SlurmError
from gpuwarden.lemon.scoring import NodeScore
from gpuwarden.slurm.client import SlurmClient
from gpuwarden.slurm.drain import drain_within_cap
from gpuwarden.slurm.drain_cap import BlastRadius

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    node: str
    action: str  # "drained", "held", "already out", "error"
    detail: str


def drain_lemons(lemons: Sequence[NodeScore], client: SlurmClient, cap: BlastRadius,
                 sleep: Callable[[float], None] = time.sleep) -> list[Outcome]:
    """Most suspicious first, so that a cap reached part-way leaves the worst ones drained.

    A node drained meanwhile by anyone (health gating included) is left alone: the lemon drain
    never takes over another drain, so health gating never resumes a lemon drain as its own."""
    out = []
    for s in sorted(lemons, key=lambda s: (s.q_value, -s.failures)):
        try:
            node = client.node(s.node)
        except SlurmError as exc:
            out.append(Outcome(s.node, "error", str(exc)))
            continue
        if node.drained or node.down:
            # Out of service already: never replace anyone's reason, ours included (a health
            # drain says more about the node than a statistical verdict does).
            out.append(Outcome(s.node, "already out", f"{node.state_text}: {node.reason} "
                                                      f"({node.owner})"))
            continue
        try:
            applied = drain_within_cap(s.summary, s.node, client, cap, sleep)
        except (NotOurDrainError, SlurmError) as exc:
            out.append(Outcome(s.node, "error", str(exc)))
            continue
        log.info("lemon %s: %s (%s)", s.node, applied.action, applied.detail)
        action = "already out" if applied.action == "none" else applied.action
        out.append(Outcome(s.node, action, applied.detail))
    return out
