"""NVIDIA XIDs and NVSwitch SXids from the kernel log, judged by one versioned policy. Pure.

Only a record the kernel logged (kernlog says which) whose message *starts* with the driver's own
prefix counts: ``NVRM: Xid (<bus>[ GPU-I:n[ GPU-CI:n]]): <code>,`` or
``nvidia-nvswitchN: SXid (PCI:<bus>): <code>,``. Kernel messages that quote user-chosen text
(segfault reports, audit records, filesystem errors) put their own words first, and the one
kind that starts with user text, a process name, is at most 15 characters: shorter than any
whole Xid prefix. A kernel record that starts with the prefix but lacks the driver's whole shape
(a process named "NVRM: Xid é", which kmsg escapes past 15 characters; "NVRM: Xid (PCI: invoked
oom-killer") is a user's doing, not the driver's: it is counted and logged, never a verdict, so
no user can make the check UNKNOWN. The policy itself (NVIDIA's catalog and gpuwarden's action)
is xidpolicy.py.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime

from gpuwarden.health import kernlog
from gpuwarden.health.model import CheckResult, Status, normalise_bus_id
from gpuwarden.health.xidpolicy import (
    DRAINS,
    POLICY,
    POLICY_VERSION,
    SUFFIX,
    UNKNOWN_RULE,
    Action,
    Rule,
    sxid_rule,
    xid_rule,
)

__all__ = ["POLICY", "POLICY_VERSION", "UNKNOWN_RULE", "Action", "KernelLog", "Rule", "XidEvent",
           "evaluate", "parse_kernel_log", "parse_kmsg"]

log_ = logging.getLogger(__name__)

_BUS = r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?"
_XID = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<bus>" + _BUS + r")(?: GPU-I:(?P<gi>\d{1,3}))?"
                  r"(?: GPU-CI:(?P<ci>\d{1,3}))?\): ?(?P<code>\d{1,5}),(?P<rest>.*)\Z", re.S)
_SXID = re.compile(r"nvidia-nvswitch\d{1,3}: SXid \(PCI:(?P<bus>" + _BUS + r")\): ?"
                   r"(?P<code>\d{1,5}), (?P<rest>.*)\Z", re.S)
_SXID_PREFIX = re.compile(r"nvidia-nvswitch\d+: SXid\b")
_SXID_HEADLINE = re.compile(r"(Fatal|Non-fatal|Nonfatal),", re.IGNORECASE)
_XID_PREFIX = "NVRM: Xid"
# A process's own report ("<comm>[<pid>]: segfault at ...") starts with its name, at most 15
# characters: a name equal to a prefix is the user's text, neither an event nor malformed.
_COMM_LED = re.compile(r".{1,15}(?:\[\d+\]| \(\d+\))")
# The driver prints one Xid as several records (13 does, per SM); records of one GPU and code
# within this time of an event's FIRST record are that event (measured from the first, so a
# steady stream such as 92's is many events, not one chain). An SXid's "Severity ..." and
# "Data {...}" records follow their headline ("<code>, Fatal, Link ..."); without a headline
# before them (it left the ring buffer) they are ignored.
_SAME_EVENT_S = 1.0
_MAX_MALFORMED_SHOWN = 1


@dataclass(frozen=True)
class XidEvent:
    xid: int
    bus_id: str
    at: float  # wall-clock seconds
    line: str
    kind: str = "xid"  # "xid" (a GPU) or "sxid" (an NVSwitch)
    rule: Rule = UNKNOWN_RULE
    records: int = 1
    boot_clock: bool = False  # timed by this boot's clock (kmsg): may run ahead of the wall clock


@dataclass(frozen=True)
class KernelLog:
    events: tuple[XidEvent, ...]
    malformed: tuple[str, ...]  # "line N: why"
    boot_time: float = 0.0  # events before it are from an earlier boot
    not_kernel: int = 0  # records with the driver's prefix that the kernel did not log
    unshaped: int = 0  # kernel records with the driver's prefix but not its shape: a user's
    forgeable: frozenset[str] = frozenset()  # renderings seen that a user can forge lines in
    oversized: int = 0  # lines too long to be a kernel record, skipped


def parse_kmsg(text: str, boot_time: float, now: float | None = None) -> KernelLog:
    return parse_kernel_log(text, boot_time, now)


def parse_kernel_log(text: str, boot_time: float, now: float | None = None) -> KernelLog:
    """Any rendering kernlog reads; ``now`` only places syslog's year-less times."""
    recs = kernlog.parse(text, boot_time, time.time() if now is None else now)
    builder = _Builder()
    malformed = list(recs.malformed)
    for rec in recs.records:
        why = builder.add(rec)
        if why:
            malformed.append(f"line {rec.lineno}: {why}: {rec.text[:80]!r}")
    malformed.sort(key=lambda m: int(m.split(":", 1)[0].split()[1]))
    if builder.unshaped:
        log_.warning("kernel log: %d record(s) start with the NVIDIA driver's prefix but do not "
                     "have its shape (a user's process name or text), ignored", builder.unshaped)
    return KernelLog(builder.events(), tuple(malformed), boot_time, builder.not_kernel,
                     builder.unshaped, recs.forgeable, recs.oversized)


class _Builder:
    def __init__(self) -> None:
        self._events: list[XidEvent] = []
        self._last: dict[tuple[str, str, int], int] = {}  # key -> index of its latest event
        self.not_kernel = 0
        self.unshaped = 0

    def add(self, rec: kernlog.Record) -> str:
        """Take one record; the reason it is malformed, or ""."""
        is_xid = rec.text.startswith(_XID_PREFIX)
        if (not is_xid and not _SXID_PREFIX.match(rec.text)) or _COMM_LED.match(rec.text):
            return ""
        if not rec.kernel:
            self.not_kernel += 1
            log_.debug("line %d: driver prefix outside the kernel facility, ignored", rec.lineno)
            return ""
        m = (_XID if is_xid else _SXID).match(rec.text)
        if not m:
            # Not the driver's shape: the driver always prints its whole prefix, a user can
            # print part of it (see the module doc). Counted, never a verdict.
            self.unshaped += 1
            log_.debug("line %d: driver prefix without the driver's shape, ignored", rec.lineno)
            return ""
        if rec.at is None:
            return "no timestamp"
        kind, code, rest = ("xid" if is_xid else "sxid"), int(m.group("code")), m.group("rest")
        key = (kind, normalise_bus_id(m.group("bus")), code)
        if is_xid:
            self._add_xid(key, rec, rest)
        else:
            self._add_sxid(key, rec, rest)
        return ""

    def _add_xid(self, key: tuple[str, str, int], rec: kernlog.Record, rest: str) -> None:
        rule = xid_rule(key[2], rest)
        prev = self._last.get(key)
        assert rec.at is not None
        if (prev is not None and key[2] != 154
                and 0 <= rec.at - self._events[prev].at <= _SAME_EVENT_S):
            self._merge(prev, rule)
            return
        self._new(key, rec, rule)

    def _add_sxid(self, key: tuple[str, str, int], rec: kernlog.Record, rest: str) -> None:
        headline = _SXID_HEADLINE.match(rest.lstrip(" "))
        prev = self._last.get(key)
        if headline is None:
            if prev is not None:
                self._merge(prev, None)
            else:  # its headline left the ring buffer: the headline's severity was the verdict
                log_.debug("line %d: SXid follow-up record without its headline, ignored",
                           rec.lineno)
            return
        self._new(key, rec, sxid_rule(key[2], headline.group(1)))

    def _new(self, key: tuple[str, str, int], rec: kernlog.Record, rule: Rule) -> None:
        assert rec.at is not None
        self._events.append(XidEvent(key[2], key[1], rec.at, rec.text[:200], key[0], rule,
                                     boot_clock=rec.boot_clock))
        self._last[key] = len(self._events) - 1

    def _merge(self, i: int, rule: Rule | None) -> None:
        e = self._events[i]
        stronger = rule if rule is not None and rule.action > e.rule.action else e.rule
        self._events[i] = dataclasses.replace(e, rule=stronger, records=e.records + 1)

    def events(self) -> tuple[XidEvent, ...]:
        # 154 states the GPU's current recovery action: only the latest one per GPU stands.
        latest = {e.bus_id: e for e in self._events if e.kind == "xid" and e.xid == 154}
        return tuple(e for e in self._events
                     if not (e.kind == "xid" and e.xid == 154) or latest[e.bus_id] is e)


def _fatal_once(rule: Rule) -> bool:
    return rule.action in DRAINS and rule.threshold == 1


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def evaluate(log: KernelLog, bus_to_gpu: dict[str, int], now: float, window_s: float,
             gpus: set[int] | None = None) -> list[CheckResult]:
    """One result per (code, device, rule) that matters, plus one for malformed input."""
    results: list[CheckResult] = []
    if log.malformed:
        shown = "; ".join(log.malformed[:_MAX_MALFORMED_SHOWN])
        results.append(CheckResult(
            "xid", Status.UNKNOWN,
            f"kernel log: {len(log.malformed)} malformed line(s), not acted on ({shown})"))
    # Fatal XIDs count since boot: a GPU that fell off the bus stays suspect until then, however
    # long ago it happened. Records from before this boot (saved syslog files) do not count.
    # A record "in the future" is from a clock gone wrong, except kmsg's: the printk clock drifts
    # from the wall clock on long uptimes, and a kmsg record is this boot's by construction.
    recent = [e for e in log.events if log.boot_time <= e.at and (e.boot_clock or e.at <= now + 60)
              and (now - window_s <= e.at or _fatal_once(e.rule))]
    counts = Counter((e.kind, e.xid, e.bus_id, e.rule.action, e.rule.what) for e in recent)
    last = {(e.kind, e.xid, e.bus_id, e.rule.action, e.rule.what): e for e in recent}
    for key, n in sorted(counts.items()):
        results.extend(_judge(last[key], n, bus_to_gpu, window_s, gpus))
    if not results:
        extra = (f"; {log.not_kernel} driver-like record(s) not from the kernel ignored"
                 if log.not_kernel else "")
        if log.unshaped:
            extra += (f"; {log.unshaped} kernel record(s) with the driver's prefix but not its "
                      "shape ignored")
        results.append(CheckResult("xid", Status.OK,
                                   f"no actionable XIDs in {window_s / 3600:g} h "
                                   f"(policy {POLICY_VERSION}){extra}"))
    return results


def _judge(e: XidEvent, n: int, bus_to_gpu: dict[str, int], window_s: float,
           gpus: set[int] | None) -> list[CheckResult]:
    gpu = bus_to_gpu.get(e.bus_id) if e.kind == "xid" else None
    if gpus is not None and gpu is not None and gpu not in gpus:
        return []
    rule = e.rule
    if e.kind == "sxid":
        where = f"NVSwitch {e.bus_id}"
    else:
        where = f"GPU {gpu}" if gpu is not None else f"PCI {e.bus_id}"
    evidence = f"{e.kind} {e.xid} on {where} at {_when(e.at)}"
    if n > 1:
        evidence += f" ({n}x in {window_s / 3600:g} h)"
    nvidia = f" (NVIDIA: {rule.catalog})" if rule.catalog else ""
    if rule.action in DRAINS and n >= rule.threshold:
        suffix = rule.needs or SUFFIX.get(rule.action, "")
        return [CheckResult("xid", Status.CRITICAL, f"{evidence}: {rule.what}{suffix}{nvidia}",
                            gpu, evidence + suffix)]
    if rule.action is not Action.IGNORE:
        return [CheckResult("xid", Status.WARNING, f"{evidence}: {rule.what}{nvidia}", gpu)]
    return []
