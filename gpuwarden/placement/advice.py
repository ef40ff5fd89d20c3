"""What `placement explain` advises the user: only things they can change that differ from
what is already set (theirs, or the filter's), else one plain line that nothing helps. Pure.

Never a longer wait: the filter picks the wait, and a job holds out for fewer switches only as
long as Slurm's max_switch_wait allows anyway.
"""

from __future__ import annotations

from gpuwarden.placement.decide import (
    Decision,
    JobRequest,
    fewest_leaves,
    left_alone,
    most_nodes,
    refused,
    too_long,
    usable,
)
from gpuwarden.placement.snapshot import PartitionView, Snapshot

NOTHING = "nothing to change: "


def _leaves(n: int) -> str:
    return "one leaf switch" if n == 1 else f"{n} leaf switches"


def _count_from(job: JobRequest) -> str:
    """What makes the job as many nodes as it is, beyond its -N."""
    if job.max_nodes is not None and job.max_nodes > job.min_nodes:
        return "-N maximum"
    return "--gpus and -n" if job.gpus_per_job and job.tasks else (
        "--gpus" if job.gpus_per_job else "-n")


def _other_partitions(s: Snapshot, part: str, job: JobRequest, nodes: int,
                      better_than: int | None) -> list[str]:
    """Partitions (not the job's) whose healthy nodes hold it under fewer leaf switches than
    ``better_than`` (None: at all)."""
    out = []
    for name, v in sorted(s.partitions.items()):
        if name == part or v.policy.mode == "off" or usable(v, job) < job.min_nodes:
            continue
        k = fewest_leaves(v.capacity, nodes) if nodes <= v.healthy else None
        if k is not None and (better_than is None or k < better_than):
            out.append(f"-p {name}: its {v.healthy} healthy nodes hold {nodes} under "
                       f"{_leaves(k)}")
    return out


def _fewer_nodes(job: JobRequest, nodes: int, most: int, why: str) -> list[str]:
    """Fewer nodes, ``most``, said as what the user changes: -N when -N alone makes the job
    ``nodes``; else what else makes it more (--gpus, -n, -N's maximum)."""
    if most < 1 or most >= nodes:
        return []
    if most < job.min_nodes:
        more = "" if nodes == job.min_nodes else f", and {_count_from(job)} for as many"
        return [f"-N {most}{more}: {why}"]
    return [f"{_count_from(job)} for at most {most} nodes (they make it {nodes}): {why}"]


def _refused(s: Snapshot, view: PartitionView, job: JobRequest, part: str) -> list[str]:
    out = []
    most_gpus = view.gpus[0][0] if view.gpus else None
    if job.gpus_per_node and most_gpus is not None and job.gpus_per_node > most_gpus:
        out.append(f"--gpus-per-node={most_gpus}: the most any node of {part} has")
    elif job.min_nodes > view.size:
        out += [f"-N {view.size}: all that partition {part} has"] if view.size >= 1 else []
    else:
        able = usable(view, job)
        if 1 <= able < job.min_nodes:
            out.append(f"-N {able}: the nodes of {part} with {job.gpus_per_node} GPUs")
        out.append("fewer GPUs per node (--gpus-per-node below "
                   f"{job.gpus_per_node})")
    out += _other_partitions(s, part, job, job.min_nodes, None)
    return out or [f"{NOTHING}no partition has nodes enough for it: Slurm refuses it"]


def advise(s: Snapshot, job: JobRequest, d: Decision) -> list[str]:
    """Lines of advice for ``job`` given the filter's decision ``d``: each names a change
    that differs from what is set, or there is one line starting NOTHING."""
    part = job.partition.split(",")[0] if job.partition else s.default_partition
    view = s.partitions.get(part)
    if view is None or too_long(job) or left_alone(view, job):
        return [f"{NOTHING}the filter leaves this job alone ({d.why or 'unchanged'})"]
    if refused(view, job):
        return _refused(s, view, job, part)
    elastic = job.max_nodes is not None and job.max_nodes > job.min_nodes
    nodes = job.min_nodes if elastic else most_nodes(job)
    k = fewest_leaves(view.capacity, nodes) if nodes <= view.healthy else None
    if k is None:
        return _too_few(s, view, job, part, nodes)
    if job.req_switch is not None:
        if job.req_switch < k:
            return [f"--switches={k}: fewer than {k} leaf switches cannot hold {nodes} healthy "
                    "nodes now, so yours holds the job for its whole wait"]
        return [f"{NOTHING}your --switches is kept, and {_leaves(k)} "
                f"{'holds' if k == 1 else 'hold'} {nodes} healthy nodes now"]
    return _held(s, view, job, d, part, nodes)


def _held(s: Snapshot, view: PartitionView, job: JobRequest, d: Decision, part: str,
          nodes: int) -> list[str]:
    """Where the filter itself may set the switches."""
    if d.switches is None or d.action == "shadow" or not d.wait_s:
        why = "shadow mode: the filter only logs" if d.action == "shadow" else \
            f"the job does not wait for fewer switches ({d.why or 'unchanged'})"
        return [f"{NOTHING}{why}"]
    others = _other_partitions(s, part, job, nodes, d.switches)
    if d.switches >= nodes:
        return others or [
            f"{NOTHING}the healthy nodes sit one per leaf switch, so any placement of {nodes} "
            f"meets the {d.switches} switches set and the job waits for none; fewer network "
            "hops need healthy nodes sharing a leaf switch (an admin's: resume drained ones)"]
    out = [f"--switches={nodes}: starts at once wherever it fits (up to {nodes} leaf "
           "switches), if it can take the extra network hops"]
    if view.capacity[0] >= view.policy.min_nodes:
        out += _fewer_nodes(job, nodes, view.capacity[0], "fits under one leaf switch")
    return out + others


def _too_few(s: Snapshot, view: PartitionView, job: JobRequest, part: str,
             nodes: int) -> list[str]:
    out = _fewer_nodes(job, nodes, view.in_service,
                       f"the nodes in service in {part} now (else it waits for the rest)")
    if view.healthy < view.in_service:
        out += _fewer_nodes(job, nodes, view.healthy,
                            "keeps it off the nodes gpuwarden suspects")
    out += _other_partitions(s, part, job, nodes, None)
    return out or [f"{NOTHING}partition {part} has {view.healthy} healthy nodes of the "
                   f"{nodes} it needs, and no other partition has more: it waits for nodes "
                   "to come back, or starts on suspect ones"]
