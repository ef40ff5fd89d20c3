"""NVIDIA XIDs from the kernel log, judged by one versioned policy table. Pure.

Policy sources: NVIDIA's XID catalog and DCGM's fatal list (see docs/health.md). 63, 92 and 94
never drain a node by themselves; repeats past a threshold within the window may.
"""

from __future__ import annotations

import enum
import re
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime

from gpuwarden.health.model import CheckResult, Status, normalise_bus_id

POLICY_VERSION = "2026.11-1"


class Action(enum.Enum):
    DRAIN = "drain"
    RESET = "reset"  # drain until the GPU is reset (a reboot or nvidia-smi -r)
    WARN = "warn"
    IGNORE = "ignore"


@dataclass(frozen=True)
class Rule:
    action: Action
    threshold: int  # occurrences within the window before the action applies
    what: str


POLICY: dict[int, Rule] = {
    13: Rule(Action.IGNORE, 1, "graphics engine exception (usually the application)"),
    31: Rule(Action.IGNORE, 1, "GPU memory page fault (usually the application)"),
    43: Rule(Action.IGNORE, 1, "GPU stopped processing (usually the application)"),
    45: Rule(Action.IGNORE, 1, "preemptive cleanup after another error"),
    48: Rule(Action.DRAIN, 1, "double-bit ECC error"),
    61: Rule(Action.RESET, 1, "internal micro-controller breakpoint"),
    62: Rule(Action.RESET, 1, "internal micro-controller halt"),
    63: Rule(Action.IGNORE, 1, "ECC page retirement or row remap event"),
    64: Rule(Action.DRAIN, 1, "ECC page retirement or row remap failure"),
    74: Rule(Action.DRAIN, 1, "NVLink error"),
    79: Rule(Action.DRAIN, 1, "GPU has fallen off the bus"),
    92: Rule(Action.DRAIN, 20, "high single-bit ECC error rate"),
    94: Rule(Action.RESET, 3, "contained ECC error"),
    95: Rule(Action.DRAIN, 1, "uncontained ECC error"),
    119: Rule(Action.RESET, 1, "GSP RPC timeout"),
    120: Rule(Action.RESET, 1, "GSP error"),
    140: Rule(Action.DRAIN, 1, "unrecovered ECC error"),
}
UNKNOWN_RULE = Rule(Action.WARN, 1, "XID not in gpuwarden's policy table")

_KMSG = re.compile(r"^(\d+),(\d+),(\d+),[^;]*;(.*)$")
_XID = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.\d)?)\): (\d{1,4})\b")
_MAX_MALFORMED_SHOWN = 1


@dataclass(frozen=True)
class XidEvent:
    xid: int
    bus_id: str
    at: float  # wall-clock seconds
    line: str


@dataclass(frozen=True)
class KernelLog:
    events: tuple[XidEvent, ...]
    malformed: tuple[str, ...]  # "line N: why"


def parse_kmsg(text: str, boot_time: float) -> KernelLog:
    """Records in /dev/kmsg format: ``pri,seq,usec_since_boot,flags;message``.

    Continuation lines (starting with a space) are ignored; any other line that is not a
    record, and any Xid line that does not parse, is reported as malformed.
    """
    events: list[XidEvent] = []
    malformed: list[str] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        if not raw.strip() or raw.startswith(" "):
            continue
        m = _KMSG.match(raw)
        if not m:
            malformed.append(f"line {lineno}: not a kernel log record: {raw[:80]!r}")
            continue
        message = m.group(4)
        if "NVRM: Xid" not in message:
            continue
        x = _XID.search(message)
        if not x:
            malformed.append(f"line {lineno}: unparseable Xid message: {message[:80]!r}")
            continue
        at = boot_time + int(m.group(3)) / 1e6
        events.append(XidEvent(int(x.group(2)), normalise_bus_id(x.group(1)), at, message))
    return KernelLog(tuple(events), tuple(malformed))


def _fatal_once(xid_no: int) -> bool:
    rule = POLICY.get(xid_no, UNKNOWN_RULE)
    return rule.action in (Action.DRAIN, Action.RESET) and rule.threshold == 1


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def evaluate(log: KernelLog, bus_to_gpu: dict[str, int], now: float, window_s: float,
             gpus: set[int] | None = None) -> list[CheckResult]:
    """One result per (xid, GPU) that matters, plus one for malformed input."""
    results: list[CheckResult] = []
    if log.malformed:
        shown = "; ".join(log.malformed[:_MAX_MALFORMED_SHOWN])
        results.append(CheckResult(
            "xid", Status.UNKNOWN,
            f"kernel log: {len(log.malformed)} malformed line(s), not acted on ({shown})"))
    # Fatal XIDs (threshold 1) count since boot: the log starts afresh at a reboot, and a GPU
    # that fell off the bus stays suspect until then, however long ago it happened.
    recent = [e for e in log.events if e.at <= now + 60 and (
        now - window_s <= e.at or _fatal_once(e.xid))]
    counts = Counter((e.xid, e.bus_id) for e in recent)
    last = {(e.xid, e.bus_id): e for e in recent}
    for (xid, bus), n in sorted(counts.items()):
        gpu = bus_to_gpu.get(bus)
        if gpus is not None and gpu is not None and gpu not in gpus:
            continue
        rule = POLICY.get(xid, UNKNOWN_RULE)
        where = f"GPU {gpu}" if gpu is not None else f"PCI {bus}"
        evidence = f"xid {xid} on {where} at {_when(last[(xid, bus)].at)}"
        if n > 1:
            evidence += f" ({n}x in {window_s / 3600:g} h)"
        if rule.action in (Action.DRAIN, Action.RESET) and n >= rule.threshold:
            suffix = ", needs GPU reset" if rule.action is Action.RESET else ""
            results.append(CheckResult("xid", Status.CRITICAL, f"{evidence}: {rule.what}{suffix}",
                                       gpu, evidence + suffix))
        elif rule.action is not Action.IGNORE:
            results.append(CheckResult("xid", Status.WARNING, f"{evidence}: {rule.what}", gpu))
    if not results:
        results.append(CheckResult("xid", Status.OK,
                                   f"no actionable XIDs in {window_s / 3600:g} h "
                                   f"(policy {POLICY_VERSION})"))
    return results
