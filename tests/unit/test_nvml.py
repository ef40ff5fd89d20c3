"""The NVML adapter, driven by a stand-in pynvml module (no GPU on these machines)."""

from __future__ import annotations

import types
from typing import Any

import pytest

from gpuwarden.health import gpuchecks
from gpuwarden.health.config import Expected
from gpuwarden.health.model import Status
from gpuwarden.health.nvml import NvmlGpuProbe
from gpuwarden.health.probe import ProbeError


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


def fake_pynvml(ecc: int = 0, links: int = 18, down_link: int | None = None,
                init_fails: bool = False, retired: Any = NVMLError_NotSupported) -> Any:
    nv: Any = types.SimpleNamespace()
    nv.NVMLError, nv.NVMLError_NotSupported = NVMLError, NVMLError_NotSupported
    nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC, nv.NVML_TEMPERATURE_GPU = 1, 0, 0
    nv.NVML_NVLINK_MAX_LINKS = 18
    nv.NVML_NVLINK_ERROR_DL_CRC_FLIT = 1
    nv.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 271

    def init() -> None:
        if init_fails:
            raise NVMLError("Driver Not Loaded")

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


def test_driver_not_loaded_is_a_probe_error_with_advice() -> None:
    with pytest.raises(ProbeError, match="nvmlInit failed.*driver"):
        NvmlGpuProbe(fake_pynvml(init_fails=True)).snapshot()


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
