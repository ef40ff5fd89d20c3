"""What the job_submit filter needs, computed by the daemon and written as a line-based file.

Pure apart from `write`. The filter runs inside slurmctld under its locks, so everything slow
(Slurm calls, hostlists, sorting) happens here; the filter only looks things up.

The file is data, never code: the filter parses it with anchored string patterns under a byte
and an item cap, so loading any file, however hostile, allocates a bounded amount of memory
(executing a snapshot as Lua could not be bounded: one concatenation instruction can grow a
string 190-fold between two hook checks).
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpuwarden.config.placement import PartitionPolicy, PlacementConfig
from gpuwarden.core import safefs
from gpuwarden.core.errors import GpuwardenError
from gpuwarden.slurm import hostlist
from gpuwarden.slurm.drain import CLAIM, WOULD
from gpuwarden.slurm.models import REASON_PREFIX, Job, Node
from gpuwarden.slurm.topology import Topology

FORMAT = 4
# job_submit.lua's caps (MAX_BYTES, MAX_ITEMS): the daemon refuses to write what it would refuse.
MAX_BYTES = 4 << 20
MAX_ITEMS = 100_000
# One token of the file: what the filter's patterns accept in a name (%S without '=' or ',').
_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@+\-]*")


class SnapshotError(GpuwardenError):
    """A snapshot cannot be rendered (a name the filter could not read back) or written."""


@dataclass(frozen=True)
class PartitionView:
    name: str
    policy: PartitionPolicy
    capacity: tuple[int, ...]  # healthy nodes per leaf, most first (leaves with none left out)
    healthy: int
    # What Slurm checks a job against at submission, whatever the nodes' state: a job asking
    # for more than this is refused, not queued, so the filter must not promise it a wait.
    size: int  # every node of the partition
    in_service: int  # nodes neither drained nor down: fewer than a job needs, and it waits
    # (GPUs per node, how many nodes have that many), most GPUs first; () when a node's gres
    # cannot be read (then the filter checks no GPU count against it).
    gpus: tuple[tuple[int, int], ...]
    exclude: tuple[str, ...]  # suspect nodes of this partition that Slurm would still use
    # The suspects again, grouped by node kind (gres and features: what a job can ask for per
    # node), each with how many nodes of that kind the partition keeps once they are excluded
    # (drained and down ones included: they come back, and exc_nodes is for the job's life).
    # The filter excludes a group only if a job that could run on that kind still can.
    avoid: tuple[tuple[int, tuple[str, ...]], ...] = ()
    # When a job of N nodes fits under its fewest leaf switches by the running jobs' time
    # limits (policy wait_by = "limits"): (from N, at) runs, N ascending, each holding up to
    # the next; at is FITS_NOW, an epoch second, or NO_FIT (not within wait_s).
    fit: tuple[tuple[int, int], ...] = ()


FITS_NOW, NO_FIT = 0, -1
# Buckets of the fit times: at most this many per partition, each at least _STEP_MIN_S long.
# Times are rounded up to a bucket's end (a fit is never promised early), on the epoch, so the
# table (and the generation) changes when jobs start or end, not every round.
_STEPS, _STEP_MIN_S = 64, 10
# An IDLE node is free for a new job now unless a flag says otherwise (dynamic, cloud and
# powered-down idle nodes are allocatable: a powered-down one boots for the job).
_NOT_FREE = frozenset({
    "COMPLETING", "PLANNED", "RESERVED", "MAINTENANCE", "REBOOT_REQUESTED", "REBOOT_ISSUED",
    "NOT_RESPONDING", "POWERING_DOWN", "POWER_DOWN", "INVALID_REG", "BLOCKED", "DRAIN",
    "DOWN", "FAIL", "FAILING", "FUTURE", "UNKNOWN", "ERROR"})


@dataclass(frozen=True)
class Snapshot:
    generation: int
    generated_at: float
    stale_after_s: int
    default_partition: str
    kind: str
    partitions: Mapping[str, PartitionView]
    why: Mapping[str, str]  # excluded node -> why, for the audit trail and `explain`


def suspects(nodes: Iterable[Node], lemons: Mapping[str, str] | Iterable[str]) -> dict[str, str]:
    """Nodes still in service that gang jobs should avoid, and why.

    ``lemons``: node -> what `lemon scan --drain` did. A lemon it drained that is back in
    service was resumed by an operator after repair: no longer a suspect."""
    out: dict[str, str] = {}
    actions = dict(lemons) if isinstance(lemons, Mapping) else dict.fromkeys(lemons, "")
    for n in nodes:
        if n.drained or n.down:
            continue  # Slurm keeps jobs off these already
        if n.name in actions and actions[n.name] != "drained":
            out[n.name] = "lemon"
        elif n.comment.startswith(f"{REASON_PREFIX} {WOULD}"):
            out[n.name] = "suspect (would drain)"
        elif n.comment.startswith(f"{REASON_PREFIX} {CLAIM}"):
            out[n.name] = "suspect (draining)"
    return out


def releases(nodes: Iterable[Node], jobs: Iterable[Job], now: float) -> dict[str, float]:
    """When each node is free for a new job at the latest, as the controller knows it: 0 for
    a free node, else the end (start + time limit) of the last running job on it; math.inf
    when that cannot be told: a node busy for another reason, a suspended job, or one past
    its end (OverTimeLimit, or an unlimited job, which Slurm dates a year on, after a year).
    A running job whose node list cannot be read makes every busy node unknown."""
    end: dict[str, float] = {}
    unreadable = False
    for j in jobs:
        if not {"RUNNING", "SUSPENDED", "COMPLETING"} & set(j.state):
            continue
        at = float(j.end_time) if j.end_time and "SUSPENDED" not in j.state else math.inf
        if at < now:
            at = math.inf
        try:
            names = hostlist.expand(j.nodes) if j.nodes else []
        except ValueError:
            unreadable = True
            continue
        for name in names:
            end[name] = max(end.get(name, 0.0), at)
    out: dict[str, float] = {}
    for n in nodes:
        if "IDLE" in n.state and not _NOT_FREE & set(n.state):
            out[n.name] = 0.0
        else:
            out[n.name] = math.inf if unreadable else end.get(n.name, math.inf)
    return out


def fit_table(per_leaf: Sequence[Sequence[float]], wait_s: int,
              now: float) -> tuple[tuple[int, int], ...]:
    """``per_leaf``: each leaf's healthy nodes, as when each is free (releases()). For every
    job size N up to their count, when N nodes are free under the fewest leaves whose healthy
    nodes can hold N (as the filter picks req_switch), as (from N, at) runs."""
    total = sum(len(leaf) for leaf in per_leaf)
    if total == 0:
        return ()
    capacity = sorted((len(leaf) for leaf in per_leaf), reverse=True)
    step = max(_STEP_MIN_S, math.ceil(wait_s / _STEPS))

    def bucket(t: float) -> float:  # a release counts at its bucket's end: never early
        return t if t == 0 or math.isinf(t) else math.ceil(t / step) * step

    leaves = [sorted(bucket(t) for t in leaf) for leaf in per_leaf]
    horizon = now + wait_s + step
    moments = sorted({t for leaf in leaves for t in leaf if 0 < t <= horizon})
    tops: list[tuple[int, list[int]]] = []
    for m in [0, *moments]:
        free = sorted((bisect.bisect_right(leaf, m) for leaf in leaves), reverse=True)
        tops.append((int(m), list(itertools.accumulate(free, initial=0))))
    runs: list[tuple[int, int]] = []
    k, held = 0, 0
    for n in range(1, total + 1):
        while held < n:
            held += capacity[k]
            k += 1
        value = next((m for m, prefix in tops if prefix[k] >= n), NO_FIT)
        if not runs or runs[-1][1] != value:
            runs.append((n, value))
    return tuple(runs)


def build(cfg: PlacementConfig, topo: Topology, nodes: list[Node],
          partitions: Mapping[str, tuple[str, ...]], lemons: Mapping[str, str] | Iterable[str],
          generation: int,
          now: float, jobs: Sequence[Job] | None = ()) -> Snapshot:
    """``jobs``: the running jobs, for the fit tables; None when they could not be read (no
    fit tables: every job waits the policy's wait_s, as with wait_by = "fixed")."""
    by_name = {n.name: n for n in nodes}
    why = suspects(nodes, lemons)
    leaf_of = topo.leaf_of()
    free_at = releases(nodes, jobs or (), now)
    views: dict[str, PartitionView] = {}
    for part, members in sorted(partitions.items()):
        policy = cfg.policy(part)
        excluded = {n: w for n, w in why.items() if n in set(members) and (
            (w == "lemon" and policy.exclude_lemons)
            or (w != "lemon" and policy.exclude_suspects))}
        per_leaf: dict[str, list[float]] = {}
        for name in members:
            node = by_name.get(name)
            if node is None or node.drained or node.down or name in excluded:
                continue
            leaf = leaf_of.get(name)
            if leaf is not None:
                per_leaf.setdefault(leaf, []).append(free_at.get(name, math.inf))
        capacity = tuple(sorted((len(v) for v in per_leaf.values()), reverse=True))
        fit = (fit_table(list(per_leaf.values()), policy.wait_s, now)
               if policy.mode == "preferred" and policy.wait_by == "limits"
               and jobs is not None else ())
        known = [by_name[n] for n in members if n in by_name]
        in_service = sum(1 for n in known if not (n.drained or n.down))
        views[part] = PartitionView(part, policy, capacity, sum(capacity), len(members),
                                    in_service, _gpu_sizes(members, by_name),
                                    tuple(sorted(excluded)),
                                    _avoid_groups(members, by_name, set(excluded)), fit)
    default = cfg.default_partition or (next(iter(views)) if len(views) == 1 else "")
    return Snapshot(generation, now, cfg.stale_after_s, default, topo.kind, views, why)


def gpus_per_node(gres: str) -> int | None:
    """GPUs a node has by its gres ("gpu:h100:8(S:0-1),shard:16"): every gpu type counts, as
    Slurm counts them for an untyped --gpus-per-node; None when a gpu entry cannot be read."""
    total = 0
    for entry in re.sub(r"\([^)]*\)", "", gres).split(","):
        name, *rest = entry.strip().split(":")
        if name != "gpu":
            continue
        if rest and rest[-1].isascii() and rest[-1].isdigit() and len(rest) <= 2:
            total += int(rest[-1])
        elif len(rest) <= 1 and all(r and not r.isdigit() for r in rest):
            total += 1  # "gpu" or "gpu:h100": one
        else:
            return None
    return total


def _gpu_sizes(members: Iterable[str], by_name: Mapping[str, Node]) -> tuple[tuple[int, int], ...]:
    per: dict[int, int] = {}
    for name in members:
        node = by_name.get(name)
        gpus = gpus_per_node(node.gres) if node is not None else None
        if gpus is None:
            return ()  # one node we cannot read could have any number: claim nothing
        per[gpus] = per.get(gpus, 0) + 1
    return tuple(sorted(per.items(), reverse=True))


def _avoid_groups(members: Iterable[str], by_name: Mapping[str, Node],
                  excluded: set[str]) -> tuple[tuple[int, tuple[str, ...]], ...]:
    kinds: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for name in members:
        node = by_name.get(name)
        if node is not None:  # a member Slurm did not list counts as absent: the stricter way
            kinds.setdefault((node.gres, tuple(sorted(node.features))), []).append(name)
    groups = []
    for names in kinds.values():
        out = sorted(n for n in names if n in excluded)
        if out:
            groups.append((len(names) - len(out), tuple(out)))
    return tuple(sorted(groups, key=lambda g: g[1]))


def _token(s: str, what: str) -> str:
    if not _TOKEN.fullmatch(s):
        raise SnapshotError(f"{what} {s!r} cannot be written to the snapshot (the filter reads "
                            "names of letters, digits and _.@+- only)")
    return s


def render(s: Snapshot) -> str:
    """The file. Its first line carries the generation (changes with the content) and the time
    it was written (every time), so the filter reads one line to know whether to reload and
    whether the daemon is alive. Then one record per line; "end" marks a complete file."""
    lines = [
        f"-- gpuwarden placement snapshot generation {s.generation} written {int(s.generated_at)}",
        "-- Written by `gpuwarden placement daemon`; do not edit: it is replaced every few s.",
        f"format {FORMAT}",
        f"stale_after {s.stale_after_s}",
        f"default_partition {_token(s.default_partition, 'partition') if s.default_partition else '-'}",
        f"kind {_token(s.kind, 'topology kind')}",
    ]
    for v in s.partitions.values():
        p = v.policy
        lines.append(
            f"partition {_token(v.name, 'partition')} mode={p.mode} wait={p.wait_s} "
            f"min_nodes={p.min_nodes} shadow={1 if p.shadow else 0} size={v.size} "
            f"in_service={v.in_service} healthy={v.healthy} "
            f"gpus={','.join(f'{g}:{n}' for g, n in v.gpus)} "
            f"capacity={','.join(map(str, v.capacity))}")
        for keep, nodes in v.avoid:
            names = ",".join(_token(n, "node") for n in nodes)
            lines.append(f"avoid {v.name} keep={keep} nodes={names}")
        if v.fit:
            lines.append(f"fit {v.name} {' '.join(f'{n}:{at}' for n, at in v.fit)}")
    for node, w in sorted(s.why.items()):
        lines.append(f"why {_token(node, 'node')} {' '.join(w.split())}")
    lines += ["end", ""]
    text = "\n".join(lines)
    items = sum(1 + len(v.capacity) + len(v.gpus) + len(v.avoid) + len(v.fit)
                for v in s.partitions.values())
    if len(text.encode()) > MAX_BYTES or items > MAX_ITEMS:
        raise SnapshotError(f"the snapshot would be {len(text.encode())} bytes and {items} "
                            f"items, over the filter's caps ({MAX_BYTES} bytes, {MAX_ITEMS} "
                            "items): it would refuse it")
    return text


def write(path: str, text: str) -> None:
    """Atomically, world-readable (slurmctld's SlurmUser reads it), and only into a directory
    no one but us can write: the filter trusts whatever is there."""
    try:
        safefs.write_admin_file(path, text.encode())
    except safefs.UnsafePathError as exc:
        raise SnapshotError(str(exc)) from None


def written_at(path: str) -> float | None:
    """When the snapshot at ``path`` was written, from its first line, as the filter reads
    it; None when it is missing, unreadable, or where the filter refuses it (a link, a
    directory others can write)."""
    if safefs.admin_file_problem(path):
        return None
    try:
        return float(read_head(path)[0])
    except (OSError, ValueError):
        return None


def read_head(path: str) -> tuple[int, list[str]]:
    """When the snapshot at ``path`` was written (its first line's time, as the filter reads
    it) and its first lines (up to 1 KiB). Raises OSError, or ValueError for a first line
    without its time."""
    lines = safefs.read_head(path, 1024).decode("utf-8", "replace").split("\n")
    try:
        return int(lines[0].rsplit(" written ", 1)[1]), lines
    except (IndexError, ValueError):
        raise ValueError(f"{path}: its first line has no written time") from None
