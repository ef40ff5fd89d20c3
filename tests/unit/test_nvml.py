"""The NVML adapter, driven by a stand-in pynvml module (no GPU on these machines)."""

from __future__ import annotations

import time
import types
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.config.health import Expected, HealthConfig
from gpuwarden.health import gpuchecks
from gpuwarden.health.gather import GPU_PROBE_ALLOWANCE_S, gather
from gpuwarden.health.model import Status
from gpuwarden.health.nvml import NvmlGpuProbe
from gpuwarden.health.probe import ProbeError


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    value = 3


# The subclasses pynvml raises from nvmlInit, with their NVML return codes.
class NVMLError_NoPermission(NVMLError):
    value = 4


class NVMLError_DriverNotLoaded(NVMLError):
    value = 9


class NVMLError_LibraryNotFound(NVMLError):
    value = 12


class NVMLError_LibRmVersionMismatch(NVMLError):
    value = 18


def fake_pynvml(ecc: int = 0, links: int = 18, down_link: int | None = None,
                init_error: Exception | None = None, init_delay_s: float = 0.0,
                retired: Any = NVMLError_NotSupported) -> Any:
    nv: Any = types.SimpleNamespace()
    nv.NVMLError, nv.NVMLError_NotSupported = NVMLError, NVMLError_NotSupported
    nv.NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC, nv.NVML_TEMPERATURE_GPU = 1, 0, 0
    nv.NVML_NVLINK_MAX_LINKS = 18
    nv.NVML_NVLINK_ERROR_DL_CRC_FLIT = 1
    nv.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 271

    def init() -> None:
        if init_delay_s:
            time.sleep(init_delay_s)  # stands in for a driver initialising its GPUs
        if init_error is not None:
            raise init_error

    def link_state(h: int, link: int) -> int:
        if link >= links:
            raise NVMLError("Invalid Argument")
        return 0 if link == down_link else 1

    def retired_pending(h: int) -> int:
        if isinstance(retired, type):
            raise retired("Not Supported" if retired is NVMLError_NotSupported else "Unknown Error")
        return int(retired)

    nv.nvmlInit, nv.nvmlShutdown = init, lambda: None
    nv.nvmlDeviceGetCount = lambda: 2
    nv.nvmlSystemGetDriverVersion = lambda: b"550.54.15"
    nv.nvmlDeviceGetHandleByIndex = lambda i: i
    nv.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=f"00000000:{0x18 + h:02X}:00.0".encode())
    nv.nvmlDeviceGetName = lambda h: "NVIDIA H200"
    nv.nvmlDeviceGetTotalEccErrors = lambda h, t, c: ecc if h == 1 else 0
    nv.nvmlDeviceGetRemappedRows = lambda h: (0, 0, 0, 0)
    nv.nvmlDeviceGetRetiredPagesPendingStatus = retired_pending
    nv.nvmlDeviceGetNvLinkState = link_state
    nv.nvmlDeviceGetNvLinkErrorCounter = lambda h, link, c: 0
    nv.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: 5
    nv.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: 5
    nv.nvmlDeviceGetCurrPcieLinkWidth = lambda h: 16
    nv.nvmlDeviceGetMaxPcieLinkWidth = lambda h: 16
    nv.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0
    nv.nvmlDeviceGetTemperature = lambda h, s: 41
    nv.nvmlDeviceGetPersistenceMode = lambda h: 1
    nv.nvmlDeviceValidateInforom = lambda h: None
    nv.nvmlDeviceGetGpuFabricInfoV = lambda h: types.SimpleNamespace(state=3)
    nv.nvmlDeviceGetFieldValues = lambda h, f: [types.SimpleNamespace(
        nvmlReturn=0, value=types.SimpleNamespace(uiVal=0))]
    return nv


def test_healthy_parts_map_to_observations() -> None:
    snap = NvmlGpuProbe(fake_pynvml()).snapshot()
    assert snap.driver == "550.54.15" and len(snap.gpus) == 2
    g = snap.gpus[1]
    assert g.pci_bus_id == "00000000:19:00.0" and g.model == "NVIDIA H200"
    assert len(g.nvlink_up) == 18 and all(g.nvlink_up)
    assert g.retired_pages_pending is None  # not supported on Hopper: skipped, not failed
    assert g.fabric_state == "completed" and g.recovery_action == 0 and g.persistence_mode
    exp = Expected(gpu_count=2, nvlink_links=18)
    assert [r.status for r in gpuchecks.evaluate(snap, exp)] == [Status.OK]


def test_faults_reach_the_checks() -> None:
    snap = NvmlGpuProbe(fake_pynvml(ecc=4, down_link=3)).snapshot()
    evid = [r.evidence for r in gpuchecks.evaluate(snap, Expected(gpu_count=2, nvlink_links=18))
            if r.status == Status.CRITICAL]
    assert "4 uncorrectable ECC errors on GPU 1" in evid
    assert "NVLink 1 of 18 links down on GPU 0" in evid


INIT_FAILURES = [
    NVMLError_DriverNotLoaded("Driver Not Loaded"),
    NVMLError_LibRmVersionMismatch("RM has detected an NVML/RM version mismatch."),
    NVMLError_NoPermission("Insufficient Permissions"),
    NVMLError("Unknown Error"),
]


def node_config(tmp_path: Path, gpu_count: int = 2, check_timeout_s: float = 30.0) -> HealthConfig:
    klog = tmp_path / "kmsg"
    klog.write_text("")
    return HealthConfig(kernel_log=str(klog), check_timeout_s=check_timeout_s,
                        expected=Expected(gpu_count=gpu_count, scratch_path=""))


@pytest.mark.parametrize("error", INIT_FAILURES, ids=lambda e: type(e).__name__)
def test_a_driver_nvml_cannot_open_is_critical_on_a_gpu_node(tmp_path: Path,
                                                             error: Exception) -> None:
    """Reproduced: nvmlInit failing was UNKNOWN, and UNKNOWN never drains."""
    probe = NvmlGpuProbe(fake_pynvml(init_error=error))
    verdict = gather(node_config(tmp_path), "c1", "health check", 30.0, node_checks="none",
                     probe=probe)
    assert verdict.status == Status.CRITICAL
    (failure,) = verdict.failures
    assert failure.check == "gpu_driver"
    assert str(error) in failure.message
    named = str(error) if type(error) is NVMLError else type(error).__name__
    assert named in failure.evidence


def test_a_driver_that_cannot_enumerate_its_gpus_is_critical_too() -> None:
    nv = fake_pynvml()

    def count() -> int:
        raise NVMLError_DriverNotLoaded("Driver Not Loaded")

    nv.nvmlDeviceGetCount = count
    (r,) = gpuchecks.evaluate(NvmlGpuProbe(nv).snapshot(), Expected(gpu_count=8))
    assert r.status == Status.CRITICAL and "nvmlDeviceGetCount" in r.evidence


def test_nvml_failing_where_no_gpus_are_expected_stays_unknown() -> None:
    snap = NvmlGpuProbe(fake_pynvml(init_error=INIT_FAILURES[0])).snapshot()
    (r,) = gpuchecks.evaluate(snap, Expected(gpu_count=0))
    assert r.status == Status.UNKNOWN and "Driver Not Loaded" in r.message


def test_an_absent_nvml_library_is_unknown_even_where_gpus_are_expected(tmp_path: Path) -> None:
    # Software not installed is an install problem, not evidence against the hardware.
    probe = NvmlGpuProbe(fake_pynvml(init_error=NVMLError_LibraryNotFound(
        "NVML Shared Library Not Found")))
    with pytest.raises(ProbeError, match="libnvidia-ml.so.1 is not installed"):
        probe.snapshot()
    verdict = gather(node_config(tmp_path), "c1", "health check", 30.0, node_checks="none",
                     probe=probe)
    assert verdict.status == Status.UNKNOWN


# The per-check deadline of the two tests below. The kernel log check gathered beside the probe
# must answer within it on a loaded machine, so it is seconds, not a fraction of one; what
# the tests show is that the probe's own deadline is not this one.
CHECK_S = 2.0


def test_a_slow_nvml_init_is_not_a_failure_by_itself(tmp_path: Path) -> None:
    """Reproduced: without persistence mode nvmlInit takes seconds; the probe shared the
    per-check deadline, so a slow but healthy driver timed out and counted as CRITICAL."""
    # nvmlInit outlasts the per-check deadline (it starts after the deadline's clock does),
    # and ends far within the probe's own, min(budget, GPU_PROBE_ALLOWANCE_S).
    probe = NvmlGpuProbe(fake_pynvml(init_delay_s=1.5 * CHECK_S))
    verdict = gather(node_config(tmp_path, check_timeout_s=CHECK_S), "c1", "prolog job 1", 60.0,
                     node_checks="none", probe=probe)
    assert verdict.status == Status.OK, verdict.results


def test_an_nvml_init_that_never_returns_still_times_out_within_the_budget(
        tmp_path: Path) -> None:
    budget = 1.5 * CHECK_S  # more than the per-check deadline, far less than the allowance
    assert budget < GPU_PROBE_ALLOWANCE_S / 4
    probe = NvmlGpuProbe(fake_pynvml(init_delay_s=600))  # never returns: killed at the budget
    t0 = time.monotonic()
    verdict = gather(node_config(tmp_path, check_timeout_s=CHECK_S), "c1", "prolog job 1",
                     budget, node_checks="none", probe=probe)
    assert time.monotonic() - t0 < GPU_PROBE_ALLOWANCE_S  # killed at the budget, not later
    (failure,) = verdict.failures
    assert failure.check == "gpu" and f"timed out after {budget:g} s" in failure.message


def test_other_nvml_errors_name_the_call_and_gpu() -> None:
    class Broken(NVMLError):
        pass

    snap = NvmlGpuProbe(fake_pynvml(retired=Broken)).snapshot()
    assert snap.gpus[0].error is not None and "GPU 0: retired pages failed" in snap.gpus[0].error


def test_a_lost_gpu_is_critical_evidence_not_an_unknown_snapshot() -> None:
    nv = fake_pynvml()

    def handle(i: int) -> int:
        if i == 1:
            raise NVMLError("GPU is lost")
        return i

    nv.nvmlDeviceGetHandleByIndex = handle
    snap = NvmlGpuProbe(nv).snapshot()
    evid = [r.evidence for r in gpuchecks.evaluate(snap, Expected(gpu_count=2, nvlink_links=18))
            if r.status == Status.CRITICAL]
    assert evid == ["unreadable (NVML: GPU is lost) on GPU 1"]
