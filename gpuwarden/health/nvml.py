"""The NVML probe (`import pynvml`, from the nvidia-ml-py distribution).

NVML errors are translated here: "not supported" on this part becomes None (the check is
skipped), anything else a ProbeError naming the call and the GPU. NVML is initialised once per
snapshot, inside the deadline-guarded child process.

A driver that cannot be opened (nvmlInit fails: module not loaded, library/driver version
mismatch after an upgrade, no permission on /dev/nvidia*) is an observation, not a probe
failure: the snapshot carries ``init_error`` and the GPU checks judge it. Only a missing NVML
library (pynvml or libnvidia-ml.so.1 absent: software not installed) stays a ProbeError.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from gpuwarden.health.model import GpuObs, GpuSnapshot
from gpuwarden.health.probe import ProbeError

T = TypeVar("T")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _opt_bool(value: Any) -> bool | None:
    return None if value is None else bool(value)


_LIBRARY_NOT_FOUND = 12  # NVML_ERROR_LIBRARY_NOT_FOUND


def _is(nv: Any, exc: BaseException, name: str, code: int) -> bool:
    cls = getattr(nv, name, None)
    return (isinstance(cls, type) and isinstance(exc, cls)) or getattr(exc, "value", None) == code


def _named(exc: BaseException) -> str:
    """pynvml raises one subclass per return code: its name says more than the text alone."""
    name = type(exc).__name__
    text = str(exc) or "no message"
    return text if name == "NVMLError" else f"{name}: {text}"


class NvmlGpuProbe:
    def __init__(self, nvml: Any = None) -> None:
        self._nvml = nvml

    def _lib(self) -> Any:
        if self._nvml is None:
            try:
                import pynvml  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415
            except ImportError:
                raise ProbeError(
                    "pynvml is not installed: pip install 'gpuwarden[nvml]' (nvidia-ml-py), "
                    "or set [health] gpu_probe = \"none\" on nodes without GPUs") from None
            self._nvml = pynvml
        return self._nvml

    def _init(self, nv: Any) -> str:
        """"" when NVML is up; else the error, named ("NVMLError_DriverNotLoaded: ...")."""
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            if _is(nv, exc, "NVMLError_LibraryNotFound", _LIBRARY_NOT_FOUND):
                raise ProbeError(f"nvmlInit: the NVML library libnvidia-ml.so.1 is not installed "
                                 f"({exc}); set [health] gpu_probe = \"none\" on nodes without "
                                 "GPUs") from None
            return _named(exc)
        return ""

    @contextlib.contextmanager
    def _session(self) -> Iterator[tuple[Any, str]]:
        nv = self._lib()
        problem = self._init(nv)
        try:
            yield nv, problem
        finally:
            if not problem:
                with contextlib.suppress(Exception):
                    nv.nvmlShutdown()

    def _call(self, nv: Any, gpu: int, what: str, fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except nv.NVMLError as exc:
            if isinstance(exc, getattr(nv, "NVMLError_NotSupported", ())) or \
                    "Not Supported" in str(exc):
                return None
            raise ProbeError(f"GPU {gpu}: {what} failed: {exc}") from None

    def snapshot(self) -> GpuSnapshot:
        with self._session() as (nv, problem):
            if problem:
                return GpuSnapshot((), init_error=f"nvmlInit: {problem}")
            try:
                count = nv.nvmlDeviceGetCount()
            except nv.NVMLError as exc:
                # Initialised but cannot enumerate: the driver is no more usable than unloaded.
                return GpuSnapshot((), init_error=f"nvmlDeviceGetCount: {_named(exc)}")
            driver = _text(self._call(nv, -1, "driver version", nv.nvmlSystemGetDriverVersion) or "")
            return GpuSnapshot(tuple(self._gpu_or_lost(nv, i) for i in range(count)), driver)

    def _gpu_or_lost(self, nv: Any, i: int) -> GpuObs:
        # One unreadable GPU is evidence against the node, not a reason to see nothing.
        try:
            return self._gpu(nv, i)
        except ProbeError as exc:
            return GpuObs(index=i, error=str(exc))
        except nv.NVMLError as exc:
            return GpuObs(index=i, error=f"NVML: {exc}")

    def _nvlinks(self, nv: Any, i: int, h: Any) -> tuple[tuple[bool, ...], int | None]:
        links: list[bool] = []
        errors = 0
        for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                state = nv.nvmlDeviceGetNvLinkState(h, link)
            except nv.NVMLError:
                break  # past the last link this part has
            links.append(bool(state))
            for counter in ("NVML_NVLINK_ERROR_DL_CRC_FLIT", "NVML_NVLINK_ERROR_DL_REPLAY"):
                if hasattr(nv, counter):
                    n = self._call(nv, i, "NVLink error counter",
                                   lambda c=counter, k=link: nv.nvmlDeviceGetNvLinkErrorCounter(  # type: ignore[misc]
                                       h, k, getattr(nv, c)))
                    errors += int(n or 0)
        return tuple(links), errors

    def _gpu(self, nv: Any, i: int) -> GpuObs:
        h = nv.nvmlDeviceGetHandleByIndex(i)
        c = self._call
        remap = c(nv, i, "remapped rows", lambda: nv.nvmlDeviceGetRemappedRows(h))
        links, link_errors = self._nvlinks(nv, i, h)
        get_reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nv.nvmlDeviceGetCurrentClocksThrottleReasons
        inforom_ok: bool | None = True
        try:
            nv.nvmlDeviceValidateInforom(h)
        except nv.NVMLError as exc:
            inforom_ok = None if "Not Supported" in str(exc) else False
        return GpuObs(
            index=i,
            pci_bus_id=_text(nv.nvmlDeviceGetPciInfo(h).busId),
            model=_text(nv.nvmlDeviceGetName(h)),
            ecc_uncorrected_volatile=c(nv, i, "ECC errors", lambda: int(nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC))),
            remapped_rows_pending=bool(remap[2]) if remap else None,
            remapped_rows_failed=bool(remap[3]) if remap else None,
            retired_pages_pending=self._retired_pending(nv, i, h),
            nvlink_up=links,
            nvlink_errors=link_errors,
            pcie_gen=c(nv, i, "PCIe gen", lambda: int(nv.nvmlDeviceGetCurrPcieLinkGeneration(h))),
            pcie_gen_max=c(nv, i, "PCIe max gen", lambda: int(nv.nvmlDeviceGetMaxPcieLinkGeneration(h))),
            pcie_width=c(nv, i, "PCIe width", lambda: int(nv.nvmlDeviceGetCurrPcieLinkWidth(h))),
            pcie_width_max=c(nv, i, "PCIe max width", lambda: int(nv.nvmlDeviceGetMaxPcieLinkWidth(h))),
            clock_event_reasons=int(c(nv, i, "clock event reasons", lambda: get_reasons(h)) or 0),
            temperature_c=c(nv, i, "temperature", lambda: int(nv.nvmlDeviceGetTemperature(
                h, nv.NVML_TEMPERATURE_GPU))),
            persistence_mode=_opt_bool(
                c(nv, i, "persistence mode", lambda: nv.nvmlDeviceGetPersistenceMode(h))),
            inforom_valid=inforom_ok,
            fabric_state=self._fabric(nv, i, h),
            recovery_action=self._recovery(nv, i, h),
        )

    def _retired_pending(self, nv: Any, i: int, h: Any) -> bool | None:
        # Pre-Ampere parts retire pages; Ampere and later remap rows instead.
        v = self._call(nv, i, "retired pages", lambda: nv.nvmlDeviceGetRetiredPagesPendingStatus(h))
        return None if v is None else bool(v)

    def _fabric(self, nv: Any, i: int, h: Any) -> str | None:
        getter = getattr(nv, "nvmlDeviceGetGpuFabricInfoV", None) or \
            getattr(nv, "nvmlDeviceGetGpuFabricInfo", None)
        if getter is None:
            return None
        try:
            info = getter(h)
        except (nv.NVMLError, TypeError):
            return None
        names = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}
        return names.get(int(getattr(info, "state", 0)), f"state_{getattr(info, 'state', '?')}")

    def _recovery(self, nv: Any, i: int, h: Any) -> int | None:
        field = getattr(nv, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field is None:
            return None
        values = self._call(nv, i, "recovery action", lambda: nv.nvmlDeviceGetFieldValues(h, [field]))
        if not values or getattr(values[0], "nvmlReturn", 0) != 0:
            return None
        return int(values[0].value.uiVal)
