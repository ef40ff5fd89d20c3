"""The placement daemon's series (`gpuwarden_placement.prom`, in the admin host's `[health]
prom_dir`), from what the daemon already reads each round. Pure apart from `write`.

- when the snapshot the filter reads was written (0: none the filter would read), and the
  daemon's rounds by outcome;
- the gang-sized jobs (pending or running, in a partition placement is on for, at least its
  min_nodes) by what the filter, or the daemon, did to them, read from their AdminComment
  (which users cannot set) and their --switches:
  - relaxed: requeued, its switch wait set to 0 by the daemon (requeue.py);
  - placed: the filter set its leaf switches and wait;
  - excluded: the filter changed only its excluded nodes (suspects, lemons);
  - user_set: its --switches, --nodelist or --contiguous was the user's, kept;
  - shadow: its partition's policy is shadow (decide and log only);
  - unchanged: the filter set nothing. A gang job it would have placed when the snapshot was
    stale or unreadable (it failed open) lands here, and so do multi-node jobs it left alone
    by rule (no GPUs, a --reservation, a size Slurm refuses): the filter records nothing on
    a job it passes, so the two cannot be told apart from the job. The snapshot's age is the
    series that says the filter is failing open.
- the nodes `gpuwarden launch` lost in jobs Slurm lists (their Comment: the jobs' own word),
  by the job's state;
- Slurm's nodes by state class, gpuwarden's drains by owner (health gating, the lemon
  scanner: gpuwarden.slurm.reasons) since Slurm's reason time, and one series per node that
  is up (`should_report`: the nodes whose textfiles the alert on missing ones expects).

No label value comes from a job or a reason's text: every one is from a fixed set or is a
Slurm node name (gpuwarden.core.metrics refuses anything else).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence

from gpuwarden.config.placement import PlacementConfig
from gpuwarden.core import metrics
from gpuwarden.core.metrics import (
    JOB_OUTCOMES,
    LOST_JOB_STATES,
    NODE_STATES,
    ROUND_OUTCOMES,
    Metric,
    Sample,
)
from gpuwarden.placement import requeue
from gpuwarden.slurm import lostnote
from gpuwarden.slurm.models import Job, Node
from gpuwarden.slurm.reasons import drain_owner

log = logging.getLogger(__name__)

FILE = "gpuwarden_placement.prom"
# What job_submit.lua's apply() writes first (the decision follows); only the filter writes
# admin_comment of a job it changed.
_NOTE = re.compile(r"gpuwarden placement \(snapshot \d{1,20}\): ")
_KEPT = re.compile(r"--switches=\d{1,9} kept|--nodelist kept|--contiguous kept")
_MAX_TEXT = 64 * 1024  # as requeue.py: longer text is not parsed
_LIVE = ("PENDING", "RUNNING")


def node_state(n: Node) -> str:
    """The node's class (one of metrics.NODE_STATES): a drain by its owner first (a drained
    node that also went down is still the drain of whoever drained it), then down, then the
    base state."""
    if n.drained:
        owner = drain_owner(n.reason)
        return f"drained_{owner}" if owner else "drained_other"
    if n.down:
        return "down"
    for base in ("MIXED", "ALLOCATED", "IDLE"):
        if base in n.state:
            return base.lower()
    return "other"  # FUTURE, UNKNOWN, a state a later Slurm adds


# Power states (Slurm's power saving) and a node not yet built: none of them runs checks.
_ASLEEP = frozenset({"POWERED_DOWN", "POWERING_DOWN", "POWER_DOWN", "POWERING_UP", "FUTURE"})


def should_report(n: Node) -> bool:
    """Is ``n`` up, so its node_exporter should serve a gpuwarden verdict (not down, not
    powered off by power saving, not a FUTURE node)?"""
    return not n.down and not _ASLEEP & set(n.state)


def job_outcome(job: Job, cfg: PlacementConfig) -> str | None:
    """What was done to ``job`` (one of metrics.JOB_OUTCOMES); None for a job the filter
    never considers (not pending or running, too few nodes, placement off there)."""
    if not any(s in job.state for s in _LIVE):
        return None
    policy = cfg.policy(job.partition.split(",", 1)[0] or cfg.default_partition)
    if policy.mode == "off" or job.num_nodes < policy.min_nodes:
        return None
    return _done(job.admin_comment if len(job.admin_comment) <= _MAX_TEXT else "",
                 job.req_switch, policy.shadow)


def _done(text: str, req_switch: int, shadow: bool) -> str:
    if requeue.RELAXED in text:
        return "relaxed"
    if requeue.placed(text) is not None:
        return "placed"
    note = _NOTE.search(text)
    if note is not None:
        return "user_set" if _KEPT.search(text, note.end()) else "excluded"
    if req_switch > 0:
        return "user_set"  # --switches without a filter note: the user's own
    return "shadow" if shadow else "unchanged"


def lost_nodes(jobs: Iterable[Job], known: Iterable[str] | None = None) -> dict[str, int]:
    """The distinct nodes the launchers' notes (gpuwarden.slurm.lostnote, in the job's Comment)
    name lost, by the job's state (running: on spares now; pending: requeued), at most the
    job's own node count each and, with ``known``, only nodes Slurm knows. The Comment is the
    job's owner's to write: a figure for the dashboard, never for an alert."""
    names: dict[str, set[str]] = {s: set() for s in LOST_JOB_STATES}
    for j in jobs:
        state = "running" if "RUNNING" in j.state else "pending" if "PENDING" in j.state else ""
        if state:
            lost = sorted(lostnote.lost_in(j.comment))
            names[state].update(lost[:max(0, j.num_nodes)])
    fleet = set(known) if known is not None else None
    return {s: len(n if fleet is None else n & fleet) for s, n in names.items()}


def samples(snapshot_at: float | None, rounds: Mapping[str, int], jobs: Sequence[Job] | None,
            nodes: Sequence[Node] | None, cfg: PlacementConfig) -> dict[Metric, list[Sample]]:
    """The file's series. ``jobs`` or ``nodes`` None: not read recently enough, their series
    left out (absent, never made up)."""
    out: dict[Metric, list[Sample]] = {
        metrics.SNAPSHOT_TIMESTAMP: [((), snapshot_at or 0.0)],
        metrics.ROUNDS: [((o,), float(rounds.get(o, 0))) for o in ROUND_OUTCOMES],
    }
    if jobs is not None:
        by = dict.fromkeys(JOB_OUTCOMES, 0.0)
        for j in jobs:
            outcome = job_outcome(j, cfg)
            if outcome is not None:
                by[outcome] += 1
        out[metrics.JOBS] = [((o,), n) for o, n in by.items()]
        known = [n.name for n in nodes] if nodes is not None else None
        out[metrics.LAUNCH_NODES_LOST] = [((st,), float(n))
                                          for st, n in lost_nodes(jobs, known).items()]
    if nodes is not None:
        named = list(_named(nodes))
        classes = dict.fromkeys(NODE_STATES, 0.0)
        since: list[Sample] = []
        for n in named:
            classes[node_state(n)] += 1
            owner = drain_owner(n.reason)
            if owner and (n.drained or n.down) and n.reason_changed_at is not None:
                since.append(((n.name, owner), float(n.reason_changed_at)))
        out[metrics.SLURM_NODES] = [((s,), c) for s, c in classes.items()]
        out[metrics.DRAINED_SINCE] = since
        out[metrics.NODE_INFO] = [((n.name,), 1.0) for n in named if should_report(n)]
    return out


def _named(nodes: Iterable[Node]) -> Iterable[Node]:
    for n in nodes:
        if metrics.node_label(n.name):
            yield n
        else:
            log.warning("node %r: not a Slurm node name, left out of %s", n.name[:80], FILE)


def write(prom_dir: str, series: Mapping[Metric, Iterable[Sample]]) -> None:
    """Raises OSError or a GpuwardenError."""
    metrics.write(prom_dir, FILE, series)
