"""The filter's decision, in Python: what `placement explain` shows, and the reference the Lua
filter is tested against (tests/unit/test_placement.py runs both on the same cases). Pure."""

from __future__ import annotations

from dataclasses import dataclass

from gpuwarden.placement.snapshot import Snapshot


@dataclass(frozen=True)
class JobRequest:
    min_nodes: int
    gpus: bool
    partition: str = ""
    req_switch: int | None = None  # the user's --switches
    req_nodes: str = ""  # --nodelist
    exc_nodes: str = ""  # --exclude
    contiguous: bool = False


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
    if view.exclude and not job.req_nodes and k is not None:
        exc = ",".join(x for x in (job.exc_nodes, ",".join(view.exclude)) if x)
        notes.append(f"exclude {','.join(view.exclude)}")
    action = "shadow" if p.shadow else "place"
    if switches is None and exc is None:
        action = "pass"
    return Decision(action, "; ".join(notes), switches, wait, exc, message)
