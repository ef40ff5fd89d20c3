"""Where GPU observations come from: a Protocol, and a fake that reads a JSON file.

The fake stands in for NVML in the test cluster and in unit tests; faults are injected by
editing its file. The NVML implementation lives in gpuwarden.health.nvml.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from typing import Any, Protocol

from gpuwarden.core.errors import GpuwardenError
from gpuwarden.health.model import GpuObs, GpuSnapshot

_MAX_FAKE_BYTES = 1 << 20


class ProbeError(GpuwardenError):
    """The GPU probe could not observe (driver missing, NVML error, bad fake file)."""


class GpuProbe(Protocol):
    def snapshot(self) -> GpuSnapshot: ...


_TYPES: dict[str, tuple[type, ...]] = {
    "index": (int,), "pci_bus_id": (str,), "model": (str,),
    "ecc_uncorrected_volatile": (int, type(None)), "remapped_rows_pending": (bool, type(None)),
    "remapped_rows_failed": (bool, type(None)), "retired_pages_pending": (bool, type(None)),
    "nvlink_up": (list,), "nvlink_errors": (int, type(None)), "pcie_gen": (int, type(None)),
    "pcie_gen_max": (int, type(None)), "pcie_width": (int, type(None)),
    "pcie_width_max": (int, type(None)), "clock_event_reasons": (int,),
    "temperature_c": (int, type(None)), "persistence_mode": (bool, type(None)),
    "inforom_valid": (bool, type(None)), "fabric_state": (str, type(None)),
    "recovery_action": (int, type(None)), "error": (str, type(None)),
}


def gpu_from_json(item: Any, where: str) -> GpuObs:
    if not isinstance(item, dict):
        raise ProbeError(f"{where}: expected an object, got {type(item).__name__}")
    known = {f.name for f in fields(GpuObs)}
    unknown = sorted(set(item) - known)
    if unknown:
        raise ProbeError(f"{where}: unknown field {unknown[0]!r}")
    if "index" not in item:
        raise ProbeError(f"{where}: missing 'index'")
    for key, value in item.items():
        ok = isinstance(value, _TYPES[key]) and not (
            isinstance(value, bool) and bool not in _TYPES[key])
        if not ok:
            raise ProbeError(f"{where}.{key}: unexpected value {value!r}")
    kwargs = dict(item)
    if "nvlink_up" in kwargs:
        links = kwargs["nvlink_up"]
        if not all(isinstance(x, bool) for x in links):
            raise ProbeError(f"{where}.nvlink_up: expected a list of true/false")
        kwargs["nvlink_up"] = tuple(links)
    return GpuObs(**kwargs)


def parse_fake(text: str, source: str) -> GpuSnapshot:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProbeError(f"{source}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("gpus"), list):
        raise ProbeError(f"{source}: expected an object with a 'gpus' list")
    gpus = tuple(gpu_from_json(g, f"{source}: gpus[{i}]") for i, g in enumerate(doc["gpus"]))
    if len({g.index for g in gpus}) != len(gpus):
        raise ProbeError(f"{source}: duplicate GPU index")
    if doc.get("hang"):
        # Test hook standing in for a wedged driver: the caller's deadline must fire.
        import time  # noqa: PLC0415

        time.sleep(float(doc["hang"]))
    init_error = doc.get("init_error", "")
    if not isinstance(init_error, str):
        raise ProbeError(f"{source}: init_error: expected a string (the NVML error to stand in for)")
    if init_error:
        # Test hook standing in for an nvmlInit that fails (driver not loaded, version mismatch).
        return GpuSnapshot(gpus=(), init_error=init_error)
    return GpuSnapshot(gpus=gpus, driver=str(doc.get("driver", "fake")))


class FakeGpuProbe:
    def __init__(self, path: str) -> None:
        self.path = path

    def snapshot(self) -> GpuSnapshot:
        try:
            # O_NOFOLLOW: root never follows a link planted where the file should be.
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise ProbeError(f"{self.path}: cannot open the fake GPU file ({exc.strerror})") from None
        with os.fdopen(fd, "rb") as f:
            data = f.read(_MAX_FAKE_BYTES + 1)
        if len(data) > _MAX_FAKE_BYTES:
            raise ProbeError(f"{self.path}: larger than 1 MiB")
        return parse_fake(data.decode("utf-8", errors="replace"), self.path)


def healthy_fake(count: int, nvlinks: int = 18, model: str = "NVIDIA H100 80GB HBM3") -> str:
    """The fake file of a healthy node (the test cluster writes one per node at start)."""
    gpus = [
        {"index": i, "pci_bus_id": f"00000000:{0x18 + 0x10 * i:02X}:00.0", "model": model,
         "nvlink_up": [True] * nvlinks, "pcie_gen": 5, "pcie_gen_max": 5, "pcie_width": 16,
         "pcie_width_max": 16, "temperature_c": 35, "fabric_state": "completed",
         "recovery_action": 0}
        for i in range(count)
    ]
    return json.dumps({"driver": "fake-550.54", "gpus": gpus}, indent=1)
