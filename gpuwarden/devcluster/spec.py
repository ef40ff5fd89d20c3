"""The test cluster's shape: one description, overridable from the environment."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, replace

from gpuwarden.config import ClusterConfig
from gpuwarden.devcluster.image import DEFAULT_SLURM, VARIANTS
from gpuwarden.errors import ConfigError

LABEL = "gpuwarden.testcluster"
PREFIX = "gpuwarden"


@dataclass(frozen=True)
class Spec:
    cluster: ClusterConfig
    subnet: str = "172.29.0.0/16"
    # The Slurm release the cluster runs: one image per release (image.VARIANTS).
    slurm: str = DEFAULT_SLURM

    def __post_init__(self) -> None:
        if self.slurm not in VARIANTS:
            raise ConfigError("environment", "GPUWARDEN_SLURM",
                              f"one of {', '.join(VARIANTS)}, got {self.slurm!r}")

    @property
    def node_names(self) -> list[str]:
        return [f"{self.cluster.node_prefix}{i}" for i in range(1, self.cluster.nodes + 1)]

    @property
    def services(self) -> list[str]:
        return ["slurmdbd", "slurmctld", "s3"]

    def container_name(self, host: str) -> str:
        return f"{PREFIX}-{host}"

    def addresses(self) -> dict[str, str]:
        """Fixed addresses, so a restarted node comes back where slurmctld expects it."""
        net = ipaddress.ip_network(self.subnet)
        base = net.network_address
        out = {name: str(base + 10 + i) for i, name in enumerate(self.services)}
        for i, node in enumerate(self.node_names):
            out[node] = str(base + 256 + i + 1)
        return out


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment {name}", name, f"expected an integer, got {raw!r}") from None


def from_env() -> Spec:
    """GPUWARDEN_NODES, GPUWARDEN_NODES_PER_LEAF, GPUWARDEN_GPUS, GPUWARDEN_SUBNET, GPUWARDEN_SLURM."""
    base = ClusterConfig(gpu_device_dir="/opt/fakegpu", cpus_per_node=16, real_memory_mb=64000)
    try:
        cluster = replace(
            base,
            nodes=_env_int("GPUWARDEN_NODES", 8),
            nodes_per_leaf=_env_int("GPUWARDEN_NODES_PER_LEAF", 4),
            gpus_per_node=_env_int("GPUWARDEN_GPUS", 8),
        )
    except ValueError as exc:
        raise ConfigError("environment", "GPUWARDEN_*", str(exc)) from None
    if cluster.nodes > 250:
        raise ConfigError("environment", "GPUWARDEN_NODES", "at most 250 containers on one host")
    return Spec(cluster=cluster, subnet=os.environ.get("GPUWARDEN_SUBNET", "172.29.0.0/16"),
                slurm=os.environ.get("GPUWARDEN_SLURM") or DEFAULT_SLURM)
