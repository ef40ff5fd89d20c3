"""Health records: what was observed, what each check concluded, and the node's verdict."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Status(enum.IntEnum):
    """Nagios order: a higher value is worse; UNKNOWN sorts below CRITICAL on purpose."""

    OK = 0
    WARNING = 1
    UNKNOWN = 3
    CRITICAL = 4

    @property
    def exit_code(self) -> int:
        return {Status.OK: 0, Status.WARNING: 1, Status.CRITICAL: 2, Status.UNKNOWN: 3}[self]


@dataclass(frozen=True)
class CheckResult:
    check: str
    status: Status
    message: str
    gpu: int | None = None
    # A drain reason fragment naming the evidence, e.g. "xid 79 on GPU 5 at 2026-...".
    evidence: str = ""


@dataclass(frozen=True)
class GpuObs:
    """One GPU as NVML (or the fake) reports it. None: the part or driver does not say."""

    index: int
    pci_bus_id: str = ""
    model: str = ""
    ecc_uncorrected_volatile: int | None = 0
    remapped_rows_pending: bool | None = False
    remapped_rows_failed: bool | None = False
    retired_pages_pending: bool | None = None
    nvlink_up: tuple[bool, ...] = ()
    nvlink_errors: int | None = 0
    pcie_gen: int | None = None
    pcie_gen_max: int | None = None
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    clock_event_reasons: int = 0
    temperature_c: int | None = None
    persistence_mode: bool | None = True
    inforom_valid: bool | None = True
    fabric_state: str | None = None
    recovery_action: int | None = None
    # Set when the driver cannot read this GPU at all (lost, fallen off the bus).
    error: str | None = None


@dataclass(frozen=True)
class GpuSnapshot:
    gpus: tuple[GpuObs, ...]
    driver: str = ""
    # Set when the driver could not be opened at all (nvmlInit failed: module not loaded,
    # library/driver version mismatch, ...): "NVMLError_DriverNotLoaded: Driver Not Loaded".
    init_error: str = ""

    def by_bus_id(self) -> dict[str, int]:
        return {normalise_bus_id(g.pci_bus_id): g.index for g in self.gpus if g.pci_bus_id}


def normalise_bus_id(bus_id: str) -> str:
    """NVML says 00000000:3B:00.0, the kernel log 0000:3b:00: compare domain:bus:device."""
    parts = bus_id.lower().split(":")
    if len(parts) < 3:
        return bus_id.lower()
    domain, bus, dev = parts[-3], parts[-2], parts[-1].split(".")[0]
    return f"{int(domain, 16):04x}:{bus}:{dev}" if _hex(domain) else f"{domain}:{bus}:{dev}"


def _hex(text: str) -> bool:
    try:
        int(text, 16)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Verdict:
    node: str
    at: float
    context: str
    results: tuple[CheckResult, ...] = field(default_factory=tuple)

    @property
    def status(self) -> Status:
        return max((r.status for r in self.results), default=Status.OK)

    @property
    def failures(self) -> tuple[CheckResult, ...]:
        return tuple(r for r in self.results if r.status == Status.CRITICAL)

    def reason(self) -> str:
        """The drain reason: the evidence of the first failures, briefly."""
        parts = [r.evidence or r.message for r in self.failures]
        return "; ".join(parts[:3]) + (f" (+{len(parts) - 3} more)" if len(parts) > 3 else "")

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node, "at": self.at, "context": self.context,
            "status": self.status.name,
            "results": [
                {"check": r.check, "status": r.status.name, "message": r.message, "gpu": r.gpu,
                 "evidence": r.evidence}
                for r in self.results
            ],
        }

    @staticmethod
    def from_json(doc: dict[str, Any]) -> Verdict:
        results = tuple(
            CheckResult(str(r["check"]), Status[str(r["status"])], str(r["message"]),
                        r.get("gpu") if isinstance(r.get("gpu"), int) else None,
                        str(r.get("evidence", "")))
            for r in doc["results"]
        )
        return Verdict(str(doc["node"]), float(doc["at"]), str(doc["context"]), results)
