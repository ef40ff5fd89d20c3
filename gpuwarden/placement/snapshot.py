"""What the job_submit filter needs, computed by the daemon and written as a Lua table.

Pure apart from `write`. The filter runs inside slurmctld under its locks, so everything slow
(Slurm calls, hostlists, sorting) happens here; the filter only looks things up.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpuwarden.health.gate import CLAIM, WOULD
from gpuwarden.health.store import atomic_write
from gpuwarden.placement.config import PartitionPolicy, PlacementConfig
from gpuwarden.placement.topology import Topology
from gpuwarden.slurm.models import REASON_PREFIX, Node

VERSION = 1


@dataclass(frozen=True)
class PartitionView:
    name: str
    policy: PartitionPolicy
    capacity: tuple[int, ...]  # healthy nodes per leaf, most first (leaves with none left out)
    healthy: int
    exclude: tuple[str, ...]  # suspect nodes of this partition that Slurm would still use


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


def build(cfg: PlacementConfig, topo: Topology, nodes: list[Node],
          partitions: Mapping[str, tuple[str, ...]], lemons: Mapping[str, str] | Iterable[str],
          generation: int,
          now: float) -> Snapshot:
    by_name = {n.name: n for n in nodes}
    why = suspects(nodes, lemons)
    leaf_of = topo.leaf_of()
    views: dict[str, PartitionView] = {}
    for part, members in sorted(partitions.items()):
        policy = cfg.policy(part)
        excluded = {n: w for n, w in why.items() if n in set(members) and (
            (w == "lemon" and policy.exclude_lemons)
            or (w != "lemon" and policy.exclude_suspects))}
        per_leaf: dict[str, int] = {}
        for name in members:
            node = by_name.get(name)
            if node is None or node.drained or node.down or name in excluded:
                continue
            leaf = leaf_of.get(name)
            if leaf is not None:
                per_leaf[leaf] = per_leaf.get(leaf, 0) + 1
        capacity = tuple(sorted(per_leaf.values(), reverse=True))
        views[part] = PartitionView(part, policy, capacity, sum(capacity),
                                    tuple(sorted(excluded)))
    default = cfg.default_partition or (next(iter(views)) if len(views) == 1 else "")
    return Snapshot(generation, now, cfg.stale_after_s, default, topo.kind, views, why)


def _lua_str(s: str) -> str:
    # %q-style quoting: node and partition names are validated, reasons are ours; escape anyway.
    out = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{out}"'


def render(s: Snapshot) -> str:
    """The Lua file. Its first line carries the generation (changes with the content) and the
    time it was written (every time), so the filter reads one line to know whether to reload
    and whether the daemon is alive."""
    lines = [
        f"-- gpuwarden placement snapshot generation {s.generation} written {int(s.generated_at)}",
        "-- Written by `gpuwarden placement daemon`; do not edit: it is replaced every few s.",
        "return {",
        f"  version = {VERSION},",
        f"  generation = {s.generation},",
        f"  generated_at = {int(s.generated_at)},",
        f"  stale_after = {s.stale_after_s},",
        f"  default_partition = {_lua_str(s.default_partition)},",
        f"  kind = {_lua_str(s.kind)},",
        "  partitions = {",
    ]
    for v in s.partitions.values():
        p = v.policy
        lines.append(
            f"    [{_lua_str(v.name)}] = {{ mode = {_lua_str(p.mode)}, wait = {p.wait_s}, "
            f"min_nodes = {p.min_nodes}, shadow = {'true' if p.shadow else 'false'}, "
            f"healthy = {v.healthy}, capacity = {{{', '.join(map(str, v.capacity))}}}, "
            f"exclude = {_lua_str(','.join(v.exclude))} }},")
    lines.append("  },")
    lines.append("  why = {")
    for node, w in sorted(s.why.items()):
        lines.append(f"    [{_lua_str(node)}] = {_lua_str(w)},")
    lines += ["  },", "}", ""]
    return "\n".join(lines)


def write(path: str, text: str) -> None:
    """Atomically, world-readable: slurmctld's SlurmUser reads it."""
    directory, name = os.path.split(path)
    atomic_write(directory, name, text.encode(), mode=0o644)
