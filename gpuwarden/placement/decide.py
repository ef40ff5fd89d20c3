"""The filter's decision, in Python: what `placement explain` shows, and the reference the Lua
filter is tested against (tests/unit/test_placement.py runs both on the same cases). Pure."""

from __future__ import annotations

import bisect
import math
import re
import time
from dataclasses import dataclass

from gpuwarden.placement.snapshot import FITS_NOW, NO_FIT, PartitionView, Snapshot

# job_submit.lua's MAX_FIELD: a longer user string is not parsed (the job is left alone), so a
# 16 MB --exclude cannot hold slurmctld's locks for seconds.
MAX_FIELD = 64 * 1024
# job_submit.lua's LIST_CHARS: node names shown per list in admin_comment and the log.
LIST_CHARS = 200


@dataclass(frozen=True)
class JobRequest:
    min_nodes: int
    gpus: bool
    partition: str = ""
    req_switch: int | None = None  # the user's --switches
    req_nodes: str = ""  # --nodelist
    exc_nodes: str = ""  # --exclude
    contiguous: bool = False
    reservation: str = ""  # --reservation
    max_nodes: int | None = None  # -N min-max; sbatch sets it to min_nodes for a plain -N
    gpus_per_job: int = 0  # --gpus (tres_per_job)
    gpus_per_node: int = 0  # --gpus-per-node (tres_per_node); 0: not given
    tasks: int = 0  # -n; 0: not given
    comment: str = ""  # --comment: the user's, never overwritten
    # Its wait clock starts after submission (--begin later, --dependency, -H): the snapshot's
    # cluster state says nothing about then.
    deferred: bool = False


@dataclass(frozen=True)
class Decision:
    action: str  # "place", "shadow", "pass"
    why: str
    switches: int | None = None
    wait_s: int | None = None
    exc_nodes: str | None = None  # the merged list to set, None: leave as it is
    user_message: str = ""
    comment: str | None = None  # the job's comment to set (users see it), None: leave it


REQUIRED_WAIT_S = 7 * 86_400  # "required": as long as Slurm's max_switch_wait allows
# On top of when the time limits free the nodes: Slurm starts a waiting job at its next
# scheduling pass (the backfill runs every 30 s by default).
SCHED_MARGIN_S = 30


def fit_at(fit: tuple[tuple[int, int], ...], nodes: int) -> int | None:
    """The snapshot's fit time for a job of ``nodes`` nodes; None without a table."""
    i = bisect.bisect_right([n for n, _ in fit], nodes) - 1
    return fit[i][1] if i >= 0 else None


def wait_for(view: PartitionView, job: JobRequest, nodes: int, now: int) -> tuple[int, str]:
    """How long a "preferred" job waits for its fewest switches, and why when the running
    jobs' time limits decided it (wait_by = "limits"): as long as they say the nodes take to
    free plus SCHED_MARGIN_S, at most wait_s; 0 when they say not within wait_s (the job
    then starts at once, in the fewest switches Slurm finds free, as with wait_s = 0)."""
    p = view.policy
    at = None if job.deferred else fit_at(view.fit, nodes)
    if at is None or at == FITS_NOW:
        return p.wait_s, ""
    if at == NO_FIT:
        return 0, f"not within {p.wait_s}s by the running jobs' time limits"
    wait = min(p.wait_s, max(0, at - now) + SCHED_MARGIN_S)
    return wait, "by the running jobs' time limits"


def fewest_leaves(capacity: tuple[int, ...], nodes: int) -> int | None:
    total = 0
    for k, c in enumerate(capacity, 1):
        total += c
        if total >= nodes:
            return k
    return None


_SEP = "\t\n ,"  # Slurm's hostlist separators (hostlist.c, hostlist_create_dims)
_NAME = re.compile(r"[^\t\n ,\[\]]*")


def _range_width(inner: str) -> int | None:
    width = 0
    for part in inner.split(","):
        lo, dash, hi = part.partition("-")
        if not _digits(lo) or (dash and not (_digits(hi) and int(hi) >= int(lo))):
            return None
        width += int(hi) - int(lo) + 1 if dash else 1
    return width


def _digits(s: str) -> bool:
    return 0 < len(s) <= 9 and s.isascii() and s.isdigit()


def count_names(expr: str) -> int | None:
    """How many node names a hostlist (``c[1-4,7] d5``) names at most; None if unreadable.

    The filter's own count (job_submit.lua's count_names, step for step): names are separated
    by runs of tab, comma, space and newline outside brackets, as Slurm's hostlist.c splits
    them. Duplicates and names outside the partition count too, which only makes the
    exclusion check stricter."""
    total, pos, n = 0, 0, len(expr)
    while True:
        while pos < n and expr[pos] in _SEP:
            pos += 1
        if pos >= n:
            return total
        count = 1
        while True:
            m = _NAME.match(expr, pos)
            pos = m.end() if m else pos
            if pos < n and expr[pos] == "]":
                return None
            if pos >= n or expr[pos] != "[":
                break
            close = expr.find("]", pos)
            if close < 0:
                return None
            width = _range_width(expr[pos + 1:close])
            if width is None:
                return None
            count *= width
            pos = close + 1
        total += count


def most_nodes(job: JobRequest) -> int:
    """The most nodes the job could be given: -N a-b may get b; without a maximum, every GPU
    or task of the job could be on a node of its own."""
    if job.max_nodes is not None:
        return max(job.min_nodes, job.max_nodes)
    most = job.min_nodes
    if job.gpus_per_job:
        most = max(most, math.ceil(job.gpus_per_job / job.gpus_per_node)
                   if job.gpus_per_node else job.gpus_per_job)
    return max(most, job.tasks)


def brief(names: list[str]) -> str:
    """``names`` joined, or a count and the first names within about LIST_CHARS: 5,000
    suspects must not put 75 KB into every gang job's record."""
    joined = ",".join(names)
    if len(joined) <= LIST_CHARS:
        return joined
    cut = joined.rfind(",", 0, LIST_CHARS + 1)
    if cut < 0:
        return f"{len(names)} nodes"
    shown = joined[:cut].count(",") + 1
    return f"{len(names)} nodes: {joined[:cut]},... ({len(names) - shown} more)"


def _exclusions(view: PartitionView, job: JobRequest, need: int, reserved: int | None,
                notes: list[str]) -> str | None:
    """The merged exc_nodes, or None: never a set that could leave the job unrunnable."""
    if "," in job.partition:
        notes.append("several partitions: suspects not excluded")
        return None
    mine = count_names(job.exc_nodes)
    if mine is None:
        notes.append("--exclude not understood: suspects not excluded")
        return None
    if reserved is None:
        notes.append("reservations not visible: suspects not excluded")
        return None
    # A group is excluded only if its kind keeps enough nodes for the most this job could
    # need, even with every node the user excluded, and every node a reservation holds, taken
    # from that kind too.
    spare = mine + reserved
    take = [n for keep, nodes in view.avoid if keep - spare >= need for n in nodes]
    kept = [n for keep, nodes in view.avoid if keep - spare < need for n in nodes]
    if kept:
        notes.append(f"not excluded {brief(kept)}: too few nodes like them")
    if not take:
        return None
    notes.append(f"exclude {brief(take)}")
    return ",".join(x for x in (job.exc_nodes, ",".join(take)) if x)


def too_long(job: JobRequest) -> str:
    """The first field the filter would not parse for its length; "" when none."""
    for name in ("exc_nodes", "req_nodes", "partition", "reservation"):
        if len(getattr(job, name)) > MAX_FIELD:
            return name
    return ""


def refused(view: PartitionView, job: JobRequest) -> str:
    """What Slurm refuses at submission, whatever the nodes' state: more nodes than the
    partition has in all, or than it has with that many GPUs per node ("" when neither, or
    when that cannot be told). Only the minimum counts: Slurm trims the rest of -N a-b."""
    part, want, per_node = view.name, job.min_nodes, job.gpus_per_node
    most_gpus = view.gpus[0][0] if view.gpus else None
    if per_node and most_gpus is not None and per_node > most_gpus:
        return (f"asks for {per_node} GPUs per node but no node of partition {part} has more "
                f"than {most_gpus}: Slurm refuses it; ask for at most {most_gpus} "
                "(--gpus-per-node)")
    if want > view.size:
        return (f"asks for {want} nodes but partition {part} has {view.size} in all: Slurm "
                f"refuses it; ask for at most {view.size} (-N), or name a larger partition (-p)")
    able = usable(view, job)
    if want > able:
        return (f"asks for {want} nodes with {per_node} GPUs each but partition {part} has "
                f"{able} such nodes in all: Slurm refuses it; ask for at most {able} (-N), or "
                "for fewer GPUs per node")
    return ""


def usable(view: PartitionView, job: JobRequest) -> int:
    """Nodes of the partition, any state, with the GPUs per node the job asks for."""
    if not (job.gpus_per_node and view.gpus):
        return view.size
    return sum(n for g, n in view.gpus if g >= job.gpus_per_node)


def too_few(view: PartitionView, job: JobRequest, nodes: int) -> str:
    """What the user is told when the job needs more than the healthy nodes (``nodes``): only
    what Slurm will do. Fewer in service than its minimum, it waits for nodes to come back;
    enough in service, it may start now on suspect nodes. When the user's --exclude may leave
    too few (Slurm would refuse), nothing: neither is promised."""
    part, want = view.name, job.min_nodes
    mine = count_names(job.exc_nodes)
    if mine is None or usable(view, job) - mine < want:
        return ""
    if view.in_service < want:
        return (f"gpuwarden: this job asks for {want} nodes and partition {part} has "
                f"{view.in_service} in service now ({view.size - view.in_service} drained or "
                "down): it waits until enough are back")
    line = (f"gpuwarden: this job asks for {nodes} nodes but partition {part} has "
            f"{view.healthy} healthy now: it may start on nodes gpuwarden suspects")
    # Advice names a change: never the -N the job already has, never "at most 0".
    if view.healthy == 0:
        return line
    if view.healthy < want:
        return f"{line}; ask for at most {view.healthy} (-N) to keep off them"
    return (f"{line}; its --gpus, -n or -N maximum make it {nodes}: ask for at most "
            f"{view.healthy} nodes' worth to keep off them")


def waits(job: JobRequest, nodes: int, switches: int, wait: int) -> tuple[str, str | None]:
    """What the user is told at submit when the job is held for fewer switches, and the
    comment to set (squeue -O comment, scontrol show job): the same line, unless the user
    set a comment of their own, which is kept. Slurm's max_switch_wait may cut any wait
    shorter, so the time is a most."""
    leaves = "one leaf switch" if switches == 1 else f"{switches} leaf switches"
    most = ("as long as the cluster's max_switch_wait allows" if wait == REQUIRED_WAIT_S
            else f"up to {wait} s")
    line = (f"gpuwarden: this job may wait {most} for {nodes} nodes under {leaves} (fewer "
            f"network hops), then runs wherever it fits; to start anywhere at once, submit "
            f"with --switches={nodes}")
    if job.comment:
        return (line + " (your --comment is kept; the decision is in AdminComment: scontrol "
                "show job)"), None
    return line, line


def left_alone(view: PartitionView, job: JobRequest) -> str:
    """Why the partition's policy leaves this job alone; "" when it does not."""
    p = view.policy
    if p.mode == "off":
        return f"placement is off for partition {view.name}"
    if job.min_nodes < p.min_nodes or not job.gpus:
        return f"not a gang job (needs >= {p.min_nodes} nodes with GPUs)"
    if job.reservation:
        # Its nodes are the reservation's: an exclusion could leave too few of them for good.
        return "--reservation kept"
    return ""


def decide(s: Snapshot, job: JobRequest, reserved: int | None = 0,
           now: int | None = None) -> Decision:
    """``reserved``: nodes held by reservations the job is not in (None: cannot tell, so no
    exclusions); the filter reads them from slurm.reservations. ``now``: the epoch second
    (the filter's os.time())."""
    long = too_long(job)
    if long:
        return Decision("pass", f"{long} is over {MAX_FIELD} bytes: left alone unparsed")
    part = (job.partition.split(",")[0] if job.partition else s.default_partition)
    view = s.partitions.get(part)
    if view is None:
        return Decision("pass", f"partition {part or '(default)'} is not in the snapshot")
    p = view.policy
    alone = left_alone(view, job)
    if alone:
        return Decision("pass", alone)
    several = "," in job.partition  # Slurm may run it in another: tell the user nothing
    larger = refused(view, job)
    if larger:
        return Decision("pass", f"Slurm refuses it in partition {part}",
                        user_message="" if several else f"gpuwarden: this job {larger}")
    need = most_nodes(job)
    # -N a-b: Slurm picks the count when it starts the job, so no switch count fits it.
    elastic = job.max_nodes is not None and job.max_nodes > job.min_nodes
    nodes = job.min_nodes if elastic else need
    notes: list[str] = []
    switches = wait = None
    k = fewest_leaves(view.capacity, nodes) if nodes <= view.healthy else None
    message = ""
    if k is None:
        notes.append(f"only {view.healthy} healthy nodes")
        message = "" if several else too_few(view, job, nodes)
    elif job.req_switch is not None:
        notes.append(f"--switches={job.req_switch} kept")
    elif job.req_nodes:
        notes.append("--nodelist kept")
    elif job.contiguous:
        notes.append("--contiguous kept")
    elif elastic:
        notes.append("-N min-max: switches left to Slurm")
    elif s.kind == "block":
        notes.append("topology/block: --segment is cli_filter.lua's")
    elif p.mode == "required":
        switches, wait = k, REQUIRED_WAIT_S
        notes.append(f"switches={k} wait={wait}s")
    else:
        wait, by = wait_for(view, job, nodes, int(time.time()) if now is None else now)
        switches = k
        notes.append(f"switches={k} wait={wait}s" + (f" ({by})" if by else ""))
    exc = None
    if view.avoid and not job.req_nodes and k is not None:
        exc = _exclusions(view, job, need, reserved, notes)
    action = "shadow" if p.shadow else "place"
    if switches is None and exc is None:
        action = "pass"
    comment = None
    # Nothing is promised where any placement meets the switches set (one healthy node per
    # leaf): the job waits for none, and its advice would be the count already set.
    if action == "place" and switches is not None and wait and switches < nodes:
        message, comment = waits(job, nodes, switches, wait)
    return Decision(action, "; ".join(notes), switches, wait, exc, message, comment)
