"""Placement settings (the `[placement]` table)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpuwarden.core.configload import require

_ABS = re.compile(r"^(/[A-Za-z0-9._@+-]+)+$")


@dataclass(frozen=True)
class PartitionPolicy:
    # "required": wait (up to Slurm's max_switch_wait) for the fewest switches; "preferred":
    # wait `wait_s`, then run wherever it fits; "off": leave the partition's jobs alone.
    mode: str = "preferred"
    wait_s: int = 300
    # "limits": a "preferred" job waits only as long as the running jobs' time limits say
    # enough nodes free under its fewest leaf switches (plus a scheduling margin), at most
    # wait_s, and not at all when they say none will within wait_s; "fixed": always wait_s.
    wait_by: str = "limits"
    min_nodes: int = 2  # a gang job: at least this many nodes, and GPUs
    shadow: bool = False  # decide and log, change nothing
    exclude_suspects: bool = True
    exclude_lemons: bool = True

    def __post_init__(self) -> None:
        require(self.mode in ("required", "preferred", "off"), "mode",
                '"required", "preferred" or "off"')
        require(0 <= self.wait_s <= 7 * 86_400, "wait_s", "seconds, 0 to a week")
        require(self.wait_by in ("limits", "fixed"), "wait_by", '"limits" or "fixed"')
        require(self.min_nodes >= 2, "min_nodes", "an integer >= 2")


@dataclass(frozen=True)
class PlacementConfig:
    topology_file: str = "/etc/slurm/topology.conf"
    # Read by job_submit.lua inside slurmctld: keep it on local disk, readable by SlurmUser.
    snapshot_file: str = "/etc/slurm/gpuwarden-placement.lua"
    interval_s: float = 5.0
    # Older than this, the filter ignores the snapshot (the daemon has stopped).
    stale_after_s: int = 120
    # The partition of jobs that name none (Slurm's Default=YES); empty: the only partition.
    default_partition: str = ""
    default: PartitionPolicy = field(default_factory=PartitionPolicy)
    partitions: dict[str, PartitionPolicy] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("topology_file", "snapshot_file"):
            require(bool(_ABS.match(getattr(self, key))), key, "an absolute file path")
        require(0.5 <= self.interval_s <= 3600, "interval_s", "0.5 to 3600 seconds")
        require(self.stale_after_s >= 2 * self.interval_s, "stale_after_s",
                "at least twice interval_s")

    def policy(self, partition: str) -> PartitionPolicy:
        return self.partitions.get(partition, self.default)
