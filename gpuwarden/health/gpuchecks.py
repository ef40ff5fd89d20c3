"""GPU checks: observations against what a healthy node of this class looks like. Pure."""

from __future__ import annotations

from gpuwarden.config.health import Expected
from gpuwarden.health.model import CheckResult, GpuObs, GpuSnapshot, Status

HW_SLOWDOWN, SW_THERMAL, HW_THERMAL, POWER_BRAKE = 0x8, 0x20, 0x40, 0x80
_CLOCK_NAMES = {HW_SLOWDOWN: "HW slowdown", SW_THERMAL: "SW thermal", HW_THERMAL: "HW thermal",
                POWER_BRAKE: "power brake"}
RECOVERY = {1: "GPU reset", 2: "node reboot", 3: "drain P2P", 4: "drain and reset"}


def _crit(check: str, gpu: GpuObs, what: str) -> CheckResult:
    return CheckResult(check, Status.CRITICAL, f"GPU {gpu.index}: {what}", gpu.index,
                       f"{what} on GPU {gpu.index}")


def _warn(check: str, gpu: GpuObs, what: str) -> CheckResult:
    return CheckResult(check, Status.WARNING, f"GPU {gpu.index}: {what}", gpu.index)


def check_gpu(g: GpuObs, exp: Expected) -> list[CheckResult]:
    if g.error:
        return [_crit("gpu_lost", g, f"unreadable ({g.error[:80]})")]
    out: list[CheckResult] = []
    if exp.gpu_model and g.model and exp.gpu_model not in g.model:
        out.append(_crit("gpu_model", g, f"model {g.model!r}, expected {exp.gpu_model!r}"))
    if g.ecc_uncorrected_volatile:
        out.append(_crit("ecc", g, f"{g.ecc_uncorrected_volatile} uncorrectable ECC errors"))
    if g.remapped_rows_failed:
        out.append(_crit("row_remap", g, "row remapping failed"))
    elif g.remapped_rows_pending:
        out.append(_crit("row_remap", g, "row remap pending, needs GPU reset"))
    if g.retired_pages_pending:
        out.append(_crit("retired_pages", g, "page retirement pending, needs GPU reset"))
    if exp.nvlink_links and g.nvlink_up:
        up = sum(g.nvlink_up)
        if up < exp.nvlink_links:
            out.append(_crit("nvlink", g, f"NVLink {exp.nvlink_links - up} of "
                                          f"{exp.nvlink_links} links down"))
    if g.nvlink_errors and g.nvlink_errors > 0:
        out.append(_warn("nvlink", g, f"{g.nvlink_errors} NVLink errors"))
    width_want = exp.pcie_width or g.pcie_width_max
    if g.pcie_width is not None and width_want and g.pcie_width < width_want:
        out.append(_crit("pcie", g, f"PCIe x{g.pcie_width}, expected x{width_want}"))
    # Idle GPUs lower their link generation to save power: only a configured floor warns.
    if exp.pcie_gen and g.pcie_gen is not None and g.pcie_gen < exp.pcie_gen:
        out.append(_warn("pcie", g, f"PCIe gen {g.pcie_gen}, expected {exp.pcie_gen}"))
    slow = [name for bit, name in _CLOCK_NAMES.items() if g.clock_event_reasons & bit]
    if slow:
        out.append(_warn("clocks", g, "clocks held back: " + ", ".join(slow)))
    if g.temperature_c is not None and g.temperature_c > exp.max_temperature_c:
        out.append(_warn("temperature", g, f"{g.temperature_c} C > {exp.max_temperature_c} C"))
    if exp.require_persistence_mode and g.persistence_mode is False:
        out.append(_warn("persistence", g, "persistence mode off"))
    if g.inforom_valid is False:
        out.append(_crit("inforom", g, "InfoROM corrupt"))
    if g.fabric_state is not None and g.fabric_state not in ("completed", "not_supported"):
        out.append(_crit("fabric", g, f"NVLink fabric state {g.fabric_state}"))
    if g.recovery_action:
        what = RECOVERY.get(g.recovery_action, f"action {g.recovery_action}")
        out.append(_crit("recovery", g, f"driver asks for recovery: {what}"))
    return out


def driver_unusable(snap: GpuSnapshot, exp: Expected) -> CheckResult:
    """The driver could not be opened. On a node expected to have GPUs no job can use one, so
    that is CRITICAL whatever the cause; where none are expected (gpu_count = 0) it is UNKNOWN."""
    if exp.gpu_count > 0:
        return CheckResult("gpu_driver", Status.CRITICAL,
                           f"the GPU driver cannot be opened: {snap.init_error}", None,
                           f"GPU driver unusable ({snap.init_error[:80]})")
    return CheckResult("gpu_driver", Status.UNKNOWN,
                       f"the GPU driver cannot be opened ({snap.init_error}); no GPUs expected here")


def evaluate(snap: GpuSnapshot, exp: Expected, gpus: set[int] | None = None) -> list[CheckResult]:
    """All GPU checks; ``gpus`` limits the per-GPU checks to a job's GPUs."""
    if snap.init_error:
        return [driver_unusable(snap, exp)]
    out: list[CheckResult] = []
    if exp.gpu_count and len(snap.gpus) != exp.gpu_count:
        out.append(CheckResult("gpu_count", Status.CRITICAL,
                               f"{len(snap.gpus)} GPUs visible, expected {exp.gpu_count}",
                               None, f"{len(snap.gpus)} of {exp.gpu_count} GPUs visible"))
    for g in snap.gpus:
        if gpus is None or g.index in gpus:
            out.extend(check_gpu(g, exp))
    if not out:
        scope = "all" if gpus is None else f"job's {len(gpus)}"
        out.append(CheckResult("gpu", Status.OK, f"{scope} GPUs healthy ({len(snap.gpus)} seen)"))
    return out
