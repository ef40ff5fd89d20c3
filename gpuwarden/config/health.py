"""Health-gating settings: what a healthy node looks like per class, deadlines, and caps."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gpuwarden.core.configload import require
from gpuwarden.slurm.drain_cap import BlastRadius

_ABS = re.compile(r"^(/[A-Za-z0-9._@+-]+)+/?$|^/$")


@dataclass(frozen=True)
class MountSpec:
    path: str
    # Read within the deadline when set; "{node}" becomes the node's name.
    canary: str = ""

    def __post_init__(self) -> None:
        require(bool(_ABS.match(self.path)), "path", "an absolute path")
        require(".." not in self.canary.split("/") and not self.canary.startswith("/"),
                "canary", "a relative file name under the mount, without '..'")


@dataclass(frozen=True)
class Expected:
    """What a healthy node of one class looks like. 0 or empty means "do not check"."""

    gpu_count: int = 8
    gpu_model: str = ""
    nvlink_links: int = 0
    pcie_gen: int = 0
    pcie_width: int = 0
    max_temperature_c: int = 90
    require_persistence_mode: bool = True
    mounts: tuple[MountSpec, ...] = ()
    scratch_path: str = "/tmp"  # noqa: S108 - a path to check, not to write
    scratch_min_free_gb: float = 1.0
    min_available_memory_mb: int = 0
    ib_ports: tuple[str, ...] = ()
    ib_rate_gbps: int = 0

    def __post_init__(self) -> None:
        require(0 <= self.gpu_count <= 64, "gpu_count", "an integer from 0 to 64")
        require(0 <= self.nvlink_links <= 64, "nvlink_links", "an integer from 0 to 64")
        require(0 <= self.pcie_gen <= 7, "pcie_gen", "an integer from 0 to 7")
        require(self.pcie_width in (0, 1, 2, 4, 8, 16, 32), "pcie_width", "0, 1, 2, 4, 8, 16 or 32")
        require(20 <= self.max_temperature_c <= 120, "max_temperature_c", "20 to 120")
        require(self.scratch_path == "" or bool(_ABS.match(self.scratch_path)), "scratch_path",
                "an absolute path or empty")
        require(self.scratch_min_free_gb >= 0, "scratch_min_free_gb", "a number >= 0")
        require(self.min_available_memory_mb >= 0, "min_available_memory_mb", "an integer >= 0")
        for port in self.ib_ports:
            require(bool(re.fullmatch(r"[A-Za-z0-9_]+:\d{1,2}", port)), "ib_ports",
                    'entries like "mlx5_0:1" (device:port)')
        require(self.ib_rate_gbps >= 0, "ib_rate_gbps", "an integer >= 0")


@dataclass(frozen=True)
class NodeClass:
    nodes: str
    expected: Expected = field(default_factory=Expected)


@dataclass(frozen=True)
class HealthConfig:
    state_dir: str = "/var/lib/gpuwarden"
    prom_dir: str = ""
    gpu_probe: str = "nvml"
    fake_gpu_file: str = "/etc/gpuwarden/fakegpu.json"
    kernel_log: str = "/dev/kmsg"
    xid_window_s: float = 3600.0
    check_timeout_s: float = 5.0
    prolog_budget_s: float = 15.0
    epilog_budget_s: float = 60.0
    periodic_budget_s: float = 60.0
    verdict_max_age_s: float = 600.0
    timeout_is_failure: bool = True
    resume_after_passes: int = 3
    drain: bool = True
    expected: Expected = field(default_factory=Expected)
    classes: dict[str, NodeClass] = field(default_factory=dict)
    blast_radius: BlastRadius = field(default_factory=BlastRadius)

    def __post_init__(self) -> None:
        require(bool(_ABS.match(self.state_dir)), "state_dir", "an absolute directory")
        require(self.prom_dir == "" or bool(_ABS.match(self.prom_dir)), "prom_dir",
                "an absolute directory (node_exporter textfile dir) or empty")
        require(self.gpu_probe in ("nvml", "fake", "none"), "gpu_probe", '"nvml", "fake" or "none"')
        require(bool(_ABS.match(self.fake_gpu_file)), "fake_gpu_file", "an absolute path")
        require(bool(_ABS.match(self.kernel_log)), "kernel_log", "/dev/kmsg or an absolute path")
        require(self.xid_window_s > 0, "xid_window_s", "a positive number of seconds")
        require(0 < self.check_timeout_s <= 300, "check_timeout_s", "a number in (0, 300]")
        for key in ("prolog_budget_s", "epilog_budget_s", "periodic_budget_s"):
            require(0 < getattr(self, key) <= 3600, key, "a number in (0, 3600]")
        require(self.verdict_max_age_s > 0, "verdict_max_age_s", "a positive number of seconds")
        require(1 <= self.resume_after_passes <= 100, "resume_after_passes", "1 to 100")

    def expected_for(self, node: str) -> Expected:
        from gpuwarden.slurm.hostlist import expand  # noqa: PLC0415

        for cls in self.classes.values():
            if node in expand(cls.nodes):
                return cls.expected
        return self.expected
