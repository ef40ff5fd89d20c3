"""The test cluster's shape: one description, overridable from the environment."""

from __future__ import annotations

import ipaddress
import os
import re
import zlib
from dataclasses import dataclass, replace

from devcluster.image import DEFAULT_SLURM, VARIANTS
from gpuwarden.config import ClusterConfig
from gpuwarden.core.errors import ConfigError

# The default cluster (`make cluster-up`, a plain `pytest tests/e2e`): its containers, network,
# volume and label are named exactly as before clusters had names, so a checkout of any age
# finds and removes it.
DEFAULT_NAME = "gpuwarden"
DEFAULT_SUBNET = "172.29.0.0/16"
# The default cluster's label key; older checkouts list "their" cluster by this key alone, so
# other clusters never carry it (an old `down()` would remove them).
LABEL = "gpuwarden.testcluster"
# Every cluster's containers carry NAME_LABEL=<name>; other clusters are listed by it.
NAME_LABEL = "gpuwarden.cluster"
# Other clusters get a /23 each (services at .10, nodes from .257: 250 nodes fit) out of
# 172.31.0.0/16: 128 slots. The e2e workers' clusters gw<t..y><n> (n < 16) own slots 0-95,
# one each, their objstore clusters gw<t..y><n>o 96-111; any other name takes one of slots
# 112-127 by its CRC-32, where two names can meet (docker then refuses the second network and
# GPUWARDEN_SUBNET picks one by hand).
NAMED_POOL = "172.31.0.0/16"
NAMED_SLOTS = 128
_NAME_RE = re.compile(r"[a-z][a-z0-9]{0,15}")
# What the e2e tests' pytest-xdist workers name their clusters: gw0 -> gwt0 (or <base>0 with
# GPUWARDEN_CLUSTER_NAME=<base>); `make test` runs each other release's tests on gwv<n>,
# gww<n>, ... Cleanup (`down --workers`) removes the clusters with such names.
WORKER_BASE = "gwt"
SITES = ("fsx", "objstore")
WORKER_NAME_RE = re.compile(r"gw([t-y])([0-9]{1,2})(o?)")
# A worker's objstore cluster (`objstore_name`): its name and "o".
OBJSTORE_SUFFIX = "o"


def check_name(name: str) -> str:
    """``name`` if it can name a cluster's containers and hosts, else ConfigError."""
    if not _NAME_RE.fullmatch(name):
        raise ConfigError("environment", "GPUWARDEN_CLUSTER_NAME",
                          f"a lowercase letter, then up to 15 lowercase letters or digits, "
                          f"got {name!r}")
    return name


def slot(name: str) -> int:
    """The number (0..NAMED_SLOTS-1) of a named cluster's address block: the workers' clusters
    0-95, their objstore clusters 96-111 (workers 0-3 of each release), any other 112-127."""
    worker = WORKER_NAME_RE.fullmatch(name)
    if worker and int(worker[2]) < 16 and not worker[3]:
        return (ord(worker[1]) - ord("t")) * 16 + int(worker[2])
    if worker and int(worker[2]) < 4:
        return 96 + ((ord(worker[1]) - ord("t")) * 4 + int(worker[2])) % 16
    return 112 + zlib.crc32(name.encode()) % 16


def objstore_name(name: str) -> str:
    """The objstore-site cluster that goes with cluster ``name`` (tests/e2e's
    `objstore_cluster`): gwt1 -> gwt1o."""
    return check_name(name + OBJSTORE_SUFFIX)


def subnet_for(name: str) -> str:
    """The default cluster's subnet, or a named cluster's own /23 out of NAMED_POOL."""
    if check_name(name) == DEFAULT_NAME:
        return DEFAULT_SUBNET
    pool = ipaddress.ip_network(NAMED_POOL)
    return str(ipaddress.ip_network((int(pool.network_address) + slot(name) * 512, 23)))


def name_for_worker(worker: str, base: str | None) -> str:
    """The cluster xdist worker ``worker`` ("gw3") owns: ``base`` + its number ("gwt3")."""
    if not re.fullmatch(r"gw[0-9]+", worker):
        raise ConfigError("environment", "PYTEST_XDIST_WORKER", f"gw<n>, got {worker!r}")
    return check_name(f"{base or WORKER_BASE}{worker[2:]}")


@dataclass(frozen=True)
class Spec:
    cluster: ClusterConfig
    subnet: str = DEFAULT_SUBNET
    # The Slurm release the cluster runs: one image per release (image.VARIANTS).
    slurm: str = DEFAULT_SLURM
    # Which of the clusters on this host (GPUWARDEN_CLUSTER_NAME): every docker object and
    # the rendered state are named after it, so clusters run side by side.
    name: str = DEFAULT_NAME
    # The site's storage (GPUWARDEN_SITE): "fsx", a shared filesystem at /fsx beside S3; or
    # "objstore", node memory, peers and S3 only: no /fsx volume, checkpoints keyed from the
    # site secret (docs/design/object-store-sites.md).
    site: str = "fsx"
    # How often slurmctld has every node run gpuwarden's periodic check (HealthCheckInterval,
    # GPUWARDEN_HEALTHCHECK_INTERVAL). The e2e tests set it long: each runs the check itself
    # where it wants one, and a check on Slurm's own timer falling in the seconds between a
    # fault a test makes and the hook it watches drained the node first (a CI run).
    health_check_interval_s: int = 300

    def __post_init__(self) -> None:
        if self.slurm not in VARIANTS:
            raise ConfigError("environment", "GPUWARDEN_SLURM",
                              f"one of {', '.join(VARIANTS)}, got {self.slurm!r}")
        check_name(self.name)
        if not 1 <= self.health_check_interval_s <= 65535:  # slurm.conf's uint16
            raise ConfigError("environment", "GPUWARDEN_HEALTHCHECK_INTERVAL",
                              f"seconds from 1 to 65535, got {self.health_check_interval_s}")
        if self.site not in SITES:
            raise ConfigError("environment", "GPUWARDEN_SITE",
                              f"one of {', '.join(SITES)}, got {self.site!r}")

    @property
    def is_default(self) -> bool:
        return self.name == DEFAULT_NAME

    @property
    def network(self) -> str:
        return f"{self.name}-net"

    @property
    def fsx_volume(self) -> str:
        return f"{self.name}-fsx"

    @property
    def state_dir_name(self) -> str:
        """Under docker-cluster/: where the cluster's keys and rendered config live."""
        return ".state" if self.is_default else f".state-{self.name}"

    @property
    def site_name(self) -> str:
        """The admin-guide test's plain site (devcluster/site.py) that goes with this cluster."""
        return "gwsite" if self.is_default else f"{self.name}site"

    @property
    def site_subnet(self) -> str:
        """172.30.0.0/24 for the default cluster's site; 172.30.<slot + 1>.0/24 for the others."""
        return "172.30.0.0/24" if self.is_default else f"172.30.{slot(self.name) + 1}.0/24"

    @property
    def labels(self) -> dict[str, str]:
        """What this cluster's containers and network carry."""
        own = {NAME_LABEL: self.name}
        return {LABEL: "1", **own} if self.is_default else own

    @property
    def label_filter(self) -> str:
        """The docker label filter that lists this cluster's containers and no other's (the
        default one's containers made before clusters had names carry only LABEL=1)."""
        return f"{LABEL}=1" if self.is_default else f"{NAME_LABEL}={self.name}"

    @property
    def node_names(self) -> list[str]:
        return [f"{self.cluster.node_prefix}{i}" for i in range(1, self.cluster.nodes + 1)]

    @property
    def services(self) -> list[str]:
        return ["slurmdbd", "slurmctld", "s3"]

    def container_name(self, host: str) -> str:
        return f"{self.name}-{host}"

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
    """GPUWARDEN_NODES, GPUWARDEN_NODES_PER_LEAF, GPUWARDEN_GPUS, GPUWARDEN_SUBNET, GPUWARDEN_SLURM,
    GPUWARDEN_CLUSTER_NAME, GPUWARDEN_SITE, GPUWARDEN_HEALTHCHECK_INTERVAL."""
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
    name = check_name(os.environ.get("GPUWARDEN_CLUSTER_NAME") or DEFAULT_NAME)
    return Spec(cluster=cluster, subnet=os.environ.get("GPUWARDEN_SUBNET") or subnet_for(name),
                slurm=os.environ.get("GPUWARDEN_SLURM") or DEFAULT_SLURM, name=name,
                site=os.environ.get("GPUWARDEN_SITE") or "fsx",
                health_check_interval_s=_env_int("GPUWARDEN_HEALTHCHECK_INTERVAL", 300))
