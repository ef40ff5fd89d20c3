"""Node checks that touch the system: mounts, scratch space, memory, InfiniBand ports.

Each function returns CheckResults and may block (a hung mount); callers run them under
gpuwarden.health.deadline. Parsing is split out into pure helpers.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gpuwarden.health.config import Expected, MountSpec
from gpuwarden.health.model import CheckResult, Status


def mount_points(mountinfo: str) -> set[str]:
    """Mount points from /proc/self/mountinfo (field 5, octal escapes decoded)."""
    points = set()
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4:
            points.add(fields[4].encode().decode("unicode_escape"))
    return points


def check_mount(spec: MountSpec, node: str) -> CheckResult:
    name = f"mount:{spec.path}"
    points = mount_points(Path("/proc/self/mountinfo").read_text())
    path = spec.path.rstrip("/") or "/"
    if path not in points:
        return CheckResult(name, Status.CRITICAL, f"{path} is not mounted", None,
                           f"{path} not mounted")
    os.statvfs(path)  # blocks on a hung server: the deadline turns that into a verdict
    if spec.canary:
        canary = os.path.join(path, spec.canary.replace("{node}", node))
        # Root reads this: never through a link that leaves the mount, never a device. A FIFO
        # is allowed: opening one only blocks, and the deadline bounds that.
        real = os.path.realpath(os.path.dirname(canary))
        if real != path and not real.startswith(path.rstrip("/") + "/"):
            raise OSError(f"canary directory resolves outside {path} (to {real})")
        mode = os.lstat(canary).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            raise OSError(f"canary {canary} is not a regular file")
        fd = os.open(canary, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.read(fd, 4096)
        finally:
            os.close(fd)
    return CheckResult(name, Status.OK, f"{path} mounted and answering")


def check_scratch(exp: Expected) -> CheckResult:
    st = os.statvfs(exp.scratch_path)
    free_gb = st.f_bavail * st.f_frsize / 1e9
    if free_gb < exp.scratch_min_free_gb:
        return CheckResult("scratch", Status.CRITICAL,
                           f"{exp.scratch_path}: {free_gb:.1f} GB free < {exp.scratch_min_free_gb:g} GB",
                           None, f"{exp.scratch_path} {free_gb:.1f} GB free")
    return CheckResult("scratch", Status.OK, f"{exp.scratch_path}: {free_gb:.1f} GB free")


def available_memory_mb(meminfo: str) -> int:
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    raise ValueError("no MemAvailable line in /proc/meminfo")


def check_memory(exp: Expected) -> CheckResult:
    avail = available_memory_mb(Path("/proc/meminfo").read_text())
    if avail < exp.min_available_memory_mb:
        return CheckResult("memory", Status.CRITICAL,
                           f"{avail} MB available < {exp.min_available_memory_mb} MB", None,
                           f"only {avail} MB memory available")
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
