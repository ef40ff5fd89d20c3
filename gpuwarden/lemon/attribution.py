"""Which failures count against which node. Pure; every rule is documented here and tested.

Rules (one accounting record = one run of a job; requeued jobs have several):

1. NODE_FAIL and BOOT_FAIL: Slurm itself saw the node fail. Blame every node of the run,
   1/k each for a k-node run.
2. REQUEUED: Slurm requeues a batch job by itself only after a node failure or a failed
   launch/prolog (for example a health-gating prolog on a bad node). Blame as in rule 1.
3. FAILED on k > 1 nodes: a gang job died; the cause is on one of its nodes, so blame is
   spread, 1/k each. A node that causes many such failures accumulates blame quickly.
4. FAILED on one node: the user's, unless health gating drained that node (a `gpuwarden:`
   reason other than a lemon drain) while the job ran or within `grace_s` after it ended;
   then the node takes the whole blame.
5. A health-gating drain not already explained by a run blamed under rules 1-4 on the same node
   within `grace_s` counts as one failure of its own.
6. Never blamed on a node: COMPLETED, CANCELLED, TIMEOUT, OUT_OF_MEMORY, PREEMPTED, DEADLINE
   (the user's or the scheduler's doing), nor any state not named above.

Exposure: every run with nodes and start/end times adds one job and its hours to each node.
Records that are malformed or partial are counted as skipped, with why, and never stop the scan.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from gpuwarden.slurm.hostlist import HostlistError, expand
from gpuwarden.slurm.models import REASON_PREFIX, AcctJob, NodeEvent

NODE_STATES = frozenset({"NODE_FAIL", "BOOT_FAIL"})
LEMON_PREFIX = f"{REASON_PREFIX} lemon"


@dataclass(frozen=True)
class Blame:
    node: str
    weight: float
    job_id: int | None
    at: float
    reason: str


@dataclass
class Exposure:
    jobs: int = 0
    hours: float = 0.0


@dataclass
class Attribution:
    blames: list[Blame] = field(default_factory=list)
    exposure: dict[str, Exposure] = field(default_factory=lambda: defaultdict(Exposure))
    skipped: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class HealthDrain:
    node: str
    at: float
    reason: str


def health_drains(events: Iterable[NodeEvent]) -> list[HealthDrain]:
    """Drains set by health gating, from `sacctmgr show events` (lemon drains excluded)."""
    out = []
    for e in events:
        if not e.node or not e.reason.startswith(REASON_PREFIX) or e.reason.startswith(LEMON_PREFIX):
            continue
        try:
            at = datetime.fromisoformat(e.start).timestamp()
        except ValueError:
            continue
        out.append(HealthDrain(e.node, at, e.reason))
    return out


def _nodes(job: AcctJob) -> list[str]:
    if not job.nodes or job.nodes in ("None assigned", "(null)"):
        return []
    return expand(job.nodes)


def attribute(jobs: Iterable[AcctJob], drains: Iterable[HealthDrain] = (),
              grace_s: float = 3600.0) -> Attribution:
    result = Attribution()
    by_node: dict[str, list[HealthDrain]] = defaultdict(list)
    for d in drains:
        by_node[d.node].append(d)
    blamed_at: dict[str, list[float]] = defaultdict(list)
    for job in jobs:
        try:
            nodes = _nodes(job)
        except HostlistError:
            result.skipped["unreadable node list"] += 1
            continue
        if not nodes:
            if job.state not in ("PENDING", "CANCELLED"):
                result.skipped["no nodes"] += 1
            continue
        if job.start_time is None or job.end_time is None or job.end_time < job.start_time:
            result.skipped["no start or end time"] += 1
            continue
        hours = (job.end_time - job.start_time) / 3600
        for n in nodes:
            result.exposure[n].jobs += 1
            result.exposure[n].hours += hours
        reason = _rule(job, nodes, by_node, grace_s)
        if reason is None:
            continue
        weight = 1.0 / len(nodes) if len(nodes) > 1 else 1.0
        for n in nodes:
            result.blames.append(Blame(n, weight, job.job_id, float(job.end_time), reason))
            blamed_at[n].append(float(job.end_time))
    for node, ds in by_node.items():
        for d in ds:
            if any(abs(d.at - t) <= grace_s for t in blamed_at[node]):
                continue  # the drain explains a run already blamed: count it once
            result.blames.append(Blame(node, 1.0, None, d.at, f"health drain: {d.reason}"))
    return result


def _rule(job: AcctJob, nodes: list[str], drains: dict[str, list[HealthDrain]],
          grace_s: float) -> str | None:
    if job.state in NODE_STATES:
        return f"node failure ({job.state})"
    if job.state == "REQUEUED":
        return "requeued after a node or prolog failure"
    if job.state != "FAILED":
        return None
    if len(nodes) > 1:
        return f"{len(nodes)}-node job failed (exit {job.exit_code})"
    assert job.start_time is not None and job.end_time is not None
    for d in drains.get(nodes[0], ()):
        if job.start_time <= d.at <= job.end_time + grace_s:
            return f"failed on a node health gating drained ({d.reason})"
    return None
