"""Node checks that touch the system: mounts, scratch space, memory, InfiniBand ports.

Each function returns CheckResults and may block (a hung mount); callers run them under
gpuwarden.core.deadline. Parsing is split out into pure helpers.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpuwarden.config.health import Expected, MountSpec
from gpuwarden.health import mountprobe
from gpuwarden.health.model import CheckResult, Status

mount_points = mountprobe.mount_points  # where tests and callers have always found it


def check_mount(spec: MountSpec, node: str) -> CheckResult:
    name = f"mount:{spec.path}"
    problem = mountprobe.probe(spec.path, spec.canary, node)
    path = spec.path.rstrip("/") or "/"
    if problem:
        return CheckResult(name, Status.CRITICAL, problem, None, f"{path} not mounted")
    return CheckResult(name, Status.OK, f"{path} mounted and answering")


def check_scratch(exp: Expected) -> CheckResult:
    st = os.statvfs(exp.scratch_path)
    free_gb = st.f_bavail * st.f_frsize / 1e9
    if free_gb < exp.scratch_min_free_gb:
        # WARNING, never CRITICAL: any user's job can fill scratch, and nothing one user does
        # may drain a node (docs/health.md, "What a user cannot do").
        return CheckResult("scratch", Status.WARNING,
                           f"{exp.scratch_path}: {free_gb:.1f} GB free < "
                           f"{exp.scratch_min_free_gb:g} GB (a job can cause this: not drain "
                           "evidence)")
    return CheckResult("scratch", Status.OK, f"{exp.scratch_path}: {free_gb:.1f} GB free")


def available_memory_mb(meminfo: str) -> int:
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    raise ValueError("no MemAvailable line in /proc/meminfo")


def check_memory(exp: Expected) -> CheckResult:
    avail = available_memory_mb(Path("/proc/meminfo").read_text())
    if avail < exp.min_available_memory_mb:
        # WARNING for the same reason as scratch: a user's processes can hold the memory.
        return CheckResult("memory", Status.WARNING,
                           f"{avail} MB available < {exp.min_available_memory_mb} MB (a job "
                           "can cause this: not drain evidence)")
    return CheckResult("memory", Status.OK, f"{avail} MB available")


def ib_port_result(port: str, state: str, rate: str, want_gbps: int) -> CheckResult:
    """Pure: sysfs `state` ("4: ACTIVE") and `rate` ("200 Gb/sec (4X HDR)") of one port."""
    name = f"ib:{port}"
    if "ACTIVE" not in state:
        return CheckResult(name, Status.CRITICAL, f"{port} is {state.strip() or 'unknown'}",
                           None, f"IB {port} {state.strip().rsplit(':', 1)[-1].strip().lower()}")
    try:
        gbps = float(rate.split(maxsplit=1)[0])
    except (ValueError, IndexError):
        return CheckResult(name, Status.UNKNOWN, f"{port}: unreadable rate {rate!r}")
    if want_gbps and gbps < want_gbps:
        return CheckResult(name, Status.CRITICAL, f"{port} at {gbps:g} Gb/s < {want_gbps} Gb/s",
                           None, f"IB {port} at {gbps:g} Gb/s")
    return CheckResult(name, Status.OK, f"{port} active at {gbps:g} Gb/s")


def check_ib_port(port: str, want_gbps: int, root: str = "/sys/class/infiniband") -> CheckResult:
    dev, num = port.split(":")
    base = Path(root) / dev / "ports" / num
    try:
        state = (base / "state").read_text()
        rate = (base / "rate").read_text()
    except FileNotFoundError:
        return CheckResult(f"ib:{port}", Status.CRITICAL, f"{port} not present", None,
                           f"IB {port} missing")
    return ib_port_result(port, state, rate, want_gbps)
