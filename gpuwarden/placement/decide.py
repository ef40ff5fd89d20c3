"""The filter's decision, in Python: what `placement explain` shows, and the reference the Lua
filter is tested against (tests/unit/test_placement.py runs both on the same cases). Pure."""

from __future__ import annotations

from dataclasses import dataclass

from gpuwarden.placement.snapshot import PartitionView, Snapshot


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


@dataclass(frozen=True)
class Decision:
    action: str  # "place", "shadow", "pass"
    why: str
    switches: int | None = None
    wait_s: int | None = None
    exc_nodes: str | None = None  # the merged list to set, None: leave as it is
    user_message: str = ""


REQUIRED_WAIT_S = 7 * 86_400  # "required": as long as Slurm's max_switch_wait allows


def fewest_leaves(capacity: tuple[int, ...], nodes: int) -> int | None:
    total = 0
    for k, c in enumerate(capacity, 1):
        total += c
        if total >= nodes:
            return k
    return None


def count_names(expr: str) -> int | None:
    """How many node names a hostlist (``c[1-4,7],d5``) names at most; None if unreadable.

    The filter's own count (job_submit.lua's count_names, line for line): duplicates and names
    outside the partition count too, which only makes the exclusion check stricter."""
    total, pos, n = 0, 0, len(expr)
    while pos < n:
        count, seen = 1, False
        while pos < n and expr[pos] != ",":
            seen = True
            if expr[pos] == "]":
                return None
            if expr[pos] != "[":
                pos += 1
                continue
            close = expr.find("]", pos)
            if close < 0:
                return None
            width = 0
            for part in expr[pos + 1:close].split(","):
                lo, dash, hi = part.partition("-")
                if not (lo.isascii() and lo.isdigit()) or (
                        dash and not (hi.isascii() and hi.isdigit() and int(hi) >= int(lo))):
                    return None
                width += int(hi) - int(lo) + 1 if dash else 1
            count *= width
            pos = close + 1
        if not seen:
            return None
        total += count
        pos += 1
    return total


def _exclusions(view: PartitionView, job: JobRequest, notes: list[str]) -> str | None:
    """The merged exc_nodes, or None: never a set that could leave the job unrunnable."""
    if "," in job.partition:
        notes.append("several partitions: suspects not excluded")
        return None
    mine = count_names(job.exc_nodes)
    if mine is None:
        notes.append("--exclude not understood: suspects not excluded")
        return None
    # A group is excluded only if its kind keeps enough nodes for this job, even with every
    # node the user excluded taken from that kind too.
    take = [n for keep, nodes in view.avoid if keep - mine >= job.min_nodes for n in nodes]
    kept = [n for keep, nodes in view.avoid if keep - mine < job.min_nodes for n in nodes]
    if kept:
        notes.append(f"not excluded {','.join(kept)}: too few nodes like them")
    if not take:
        return None
    notes.append(f"exclude {','.join(take)}")
    return ",".join(x for x in (job.exc_nodes, ",".join(take)) if x)


def decide(s: Snapshot, job: JobRequest) -> Decision:
    part = (job.partition.split(",")[0] if job.partition else s.default_partition)
    view = s.partitions.get(part)
    if view is None:
        return Decision("pass", f"partition {part or '(default)'} is not in the snapshot")
    p = view.policy
    if p.mode == "off":
        return Decision("pass", f"placement is off for partition {part}")
    if job.min_nodes < p.min_nodes or not job.gpus:
        return Decision("pass", f"not a gang job (needs >= {p.min_nodes} nodes with GPUs)")
    if job.reservation:
        # Its nodes are the reservation's: an exclusion could leave too few of them for good.
        return Decision("pass", "--reservation kept")
    notes = []
    switches = wait = None
    k = fewest_leaves(view.capacity, job.min_nodes)
    message = ""
    if k is None:
        message = (f"gpuwarden: this job asks for {job.min_nodes} nodes but partition {part} has "
                   f"{view.healthy} healthy nodes now; it waits for repairs")
        notes.append(f"only {view.healthy} healthy nodes")
    elif job.req_switch is not None:
        notes.append(f"--switches={job.req_switch} kept")
    elif job.req_nodes:
        notes.append("--nodelist kept")
    elif job.contiguous:
        notes.append("--contiguous kept")
    elif s.kind == "block":
        notes.append("topology/block: --segment is cli_filter.lua's")
    else:
        switches = k
        wait = REQUIRED_WAIT_S if p.mode == "required" else p.wait_s
        notes.append(f"switches={k} wait={wait}s")
    exc = None
    if view.avoid and not job.req_nodes and k is not None:
        exc = _exclusions(view, job, notes)
    action = "shadow" if p.shadow else "place"
    if switches is None and exc is None:
        action = "pass"
    return Decision(action, "; ".join(notes), switches, wait, exc, message)
