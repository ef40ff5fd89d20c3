"""Drain lemons under health gating's blast-radius cap and drain rules."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpuwarden.errors import NotOurDrainError, SlurmError
from gpuwarden.health.config import BlastRadius
from gpuwarden.health.gate import drain_within_cap
from gpuwarden.lemon.scoring import NodeScore
from gpuwarden.slurm.client import SlurmClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    node: str
    action: str  # "drained", "held", "already out", "error"
    detail: str


def drain_lemons(lemons: Sequence[NodeScore], client: SlurmClient, cap: BlastRadius,
                 clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep) -> list[Outcome]:
    """Most suspicious first, so that a cap reached part-way leaves the worst ones drained."""
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
            applied = drain_within_cap(s.summary, s.node, client, cap, clock, sleep)
        except (NotOurDrainError, SlurmError) as exc:
            out.append(Outcome(s.node, "error", str(exc)))
            continue
        log.info("lemon %s: %s (%s)", s.node, applied.action, applied.detail)
        out.append(Outcome(s.node, applied.action, applied.detail))
    return out
