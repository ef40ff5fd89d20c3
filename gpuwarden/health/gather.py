"""Gather observations under deadlines and turn them into one Verdict."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gpuwarden.config.health import Expected, HealthConfig
from gpuwarden.core.deadline import Outcome, run_all
from gpuwarden.health import fastgate, gpuchecks, nodechecks, xid
from gpuwarden.health.model import CheckResult, GpuSnapshot, Status, Verdict
from gpuwarden.health.probe import FakeGpuProbe, GpuProbe

_KMSG_TAIL_BYTES = 4 << 20
GPU_PROBE_ALLOWANCE_S = 20.0


def make_probe(cfg: HealthConfig) -> GpuProbe | None:
    if cfg.gpu_probe == "fake":
        return FakeGpuProbe(cfg.fake_gpu_file)
    if cfg.gpu_probe == "nvml":
        from gpuwarden.health.nvml import NvmlGpuProbe  # noqa: PLC0415 - pynvml only here

        return NvmlGpuProbe()
    return None


def boot_time() -> float:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


def read_kernel_log(path: str) -> tuple[str, float]:
    """/dev/kmsg (every buffered record, non-blocking) or a saved log in any rendering kernlog
    reads (its tail). A file must be one only root (or this user) can write: anyone else could
    write an Xid into it."""
    if path == "/dev/kmsg":
        return _read_kmsg(path), boot_time()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        _check_log_file(path, st)
        offset = max(0, st.st_size - _KMSG_TAIL_BYTES)
        f.seek(offset)
        data = f.read(_KMSG_TAIL_BYTES)
    if offset:
        data = data.split(b"\n", 1)[-1]  # the first line is cut: not a record
    return data.decode("utf-8", errors="replace"), boot_time()


def _check_log_file(path: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise OSError(f"kernel_log {path}: not a regular file")
    if st.st_uid not in (0, os.geteuid()):
        raise OSError(f"kernel_log {path}: owned by uid {st.st_uid}, not root")
    if st.st_mode & 0o022:
        raise OSError(f"kernel_log {path}: writable by group or others "
                      f"(mode {stat.S_IMODE(st.st_mode):04o}); anyone could forge an Xid")


def _read_kmsg(path: str) -> str:
    return "\n".join(r.decode("utf-8", errors="replace").rstrip("\n")
                     for r in fastgate.kmsg_records(path))


def _tasks(cfg: HealthConfig, exp: Expected, node: str, probe: GpuProbe | None,
           node_checks: str) -> dict[str, Callable[[], Any]]:
    tasks: dict[str, Callable[[], Any]] = {"kernel log": lambda: read_kernel_log(cfg.kernel_log)}
    if probe is not None:
        tasks["gpu"] = probe.snapshot
    if node_checks in ("all", "mounts"):
        for m in exp.mounts:
            tasks[f"mount:{m.path}"] = lambda m=m: nodechecks.check_mount(m, node)  # type: ignore[misc]
    if node_checks == "all":
        if exp.scratch_path:
            tasks["scratch"] = lambda: nodechecks.check_scratch(exp)
        if exp.min_available_memory_mb:
            tasks["memory"] = lambda: nodechecks.check_memory(exp)
        for port in exp.ib_ports:
            tasks[f"ib:{port}"] = lambda p=port: nodechecks.check_ib_port(p, exp.ib_rate_gbps)  # type: ignore[misc]
    return tasks


def _not_answered(o: Outcome, cfg: HealthConfig, deadline: float) -> CheckResult:
    if o.timed_out:
        status = Status.CRITICAL if cfg.timeout_is_failure else Status.UNKNOWN
        return CheckResult(o.name, status, f"check {o.name} timed out after {deadline:g} s", None,
                           f"check {o.name} timed out after {deadline:g} s")
    if o.name.startswith("mount:"):
        # A mount that errors (stale handle, EIO, missing canary) fails jobs: that is evidence.
        return CheckResult(o.name, Status.CRITICAL, f"check {o.name} failed: {o.error}", None,
                           f"{o.name} failed: {o.error[:60]}")
    return CheckResult(o.name, Status.UNKNOWN, f"{_COULD_NOT_RUN.format(o.name)}{o.error}")


_COULD_NOT_RUN = "check {} could not run: "
# The message of the result that says XID drains are off for a forgeable kernel_log.
FORGEABLE = "XID drains off: "
_FIX_KLOG = ("set [health] kernel_log to /dev/kmsg, or to a file written by "
             "`journalctl -k -o json`")


def _forgeable(results: list[CheckResult], path: str, renderings: frozenset[str]
               ) -> list[CheckResult]:
    """XID results from a rendering any user can write kernel-looking lines into (syslog,
    dmesg): never drain evidence, and gating says it is degraded."""
    why = (f"kernel_log {path} is in a rendering ({', '.join(sorted(renderings))}) in which any "
           f"user can forge a kernel line; {_FIX_KLOG}")
    out = [replace(r, status=Status.WARNING, message=f"{r.message} (not drain evidence: {why})")
           if r.status == Status.CRITICAL else r for r in results]
    return [*out, CheckResult("kernel log", Status.WARNING, FORGEABLE + why)]


def gating_gaps(verdict: Verdict, exp: Expected) -> list[str]:
    """What in ``verdict`` means part of health gating is off on this node (an install or
    config problem: loud, but never a drain, or one mistake would drain the whole cluster)."""
    gaps: list[str] = []
    for r in verdict.results:
        if r.check == "gpu" and r.status == Status.UNKNOWN and exp.gpu_count > 0 and \
                r.message.startswith(_COULD_NOT_RUN.format("gpu")):
            gaps.append(f"GPU gating off on a node that expects {exp.gpu_count} GPUs: "
                        f"{r.message}")
        elif r.check == "kernel log" and r.status == Status.UNKNOWN and \
                r.message.startswith(_COULD_NOT_RUN.format("kernel log")):
            gaps.append(f"XID detection off: {r.message}")
        elif r.check == "kernel log" and r.message.startswith(FORGEABLE):
            gaps.append(r.message)
    return gaps


def gather(cfg: HealthConfig, node: str, context: str, budget_s: float,
           gpus: set[int] | None = None, node_checks: str = "all",
           probe: GpuProbe | None = None, now: Callable[[], float] = time.time) -> Verdict:
    exp = cfg.expected_for(node)
    deadline = min(cfg.check_timeout_s, budget_s)
    probe = probe if probe is not None else make_probe(cfg)
    # nvmlInit without persistence mode initialises every GPU (seconds each): slow is not
    # broken, so the probe may use the budget up to GPU_PROBE_ALLOWANCE_S.
    gpu_deadline = max(deadline, min(budget_s, GPU_PROBE_ALLOWANCE_S))
    outcomes = run_all(_tasks(cfg, exp, node, probe, node_checks), deadline,
                       limits={"gpu": gpu_deadline})
    results: list[CheckResult] = []
    snapshot: GpuSnapshot | None = None
    for name, o in outcomes.items():
        if o.timed_out or o.error:
            results.append(_not_answered(o, cfg, o.seconds if o.timed_out else deadline))
        elif name == "gpu":
            snapshot = o.value
            results.extend(gpuchecks.evaluate(o.value, exp, gpus))
        elif name != "kernel log":
            results.append(o.value)
    klog = outcomes["kernel log"]
    if not (klog.timed_out or klog.error):
        text, booted = klog.value
        log = xid.parse_kernel_log(text, booted, now())
        bus = snapshot.by_bus_id() if snapshot else {}
        found = xid.evaluate(log, bus, now(), cfg.xid_window_s, gpus)
        if log.forgeable and cfg.kernel_log != "/dev/kmsg":
            found = _forgeable(found, cfg.kernel_log, log.forgeable)
        results.extend(found)
    return Verdict(node=node, at=now(), context=context, results=tuple(results))
