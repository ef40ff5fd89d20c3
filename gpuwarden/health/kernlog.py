"""Kernel log records from /dev/kmsg and from the renderings admins save: dmesg (plain, -T, -r,
-x), syslog, journalctl (short, short-iso, json). Pure: text in, records out.

Each record says whether the rendering shows it came from the kernel facility:
* kmsg and ``dmesg -r``: the priority field (facility = pri >> 3 must be 0);
* ``dmesg -x``: the facility name (``kern``);
* ``journalctl -o json``: ``_TRANSPORT=kernel``, a field journald sets and no client can;
* syslog and journalctl short: the ``kernel`` tag. Any local user can forge that tag with
  ``logger -t kernel``, so these renderings are only as trustworthy as what wrote the file;
* plain dmesg and ``dmesg -T``: nothing. Only root can write /dev/kmsg, so the records in the
  ring buffer are the kernel's or root's.
Times: kmsg and plain dmesg count from boot; -T, syslog and journal are local wall clock.
Syslog has no year: the year that puts the record at most a day after ``now`` is assumed.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from datetime import datetime

_KMSG = re.compile(r"^(\d{1,4}),(\d+),(\d+),([^;]*);(.*)$")
_MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
_MON = "(?:" + "|".join(_MONTHS) + ")"
_FACILITIES = frozenset({
    "kern", "user", "mail", "daemon", "auth", "syslog", "lpr", "news", "uucp", "cron", "authpriv",
    "ftp", *(f"local{i}" for i in range(8)),
})
_DMESG = re.compile(
    r"^(?:<(?P<pri>\d{1,4})>|(?P<fac>[a-z0-9]+) *:(?P<lvl>[a-z]+) *: )?"
    r"\[ *(?:(?P<up>\d+\.\d+)|(?P<ctime>[A-Z][a-z]{2} " + _MON + r" [ \d]\d \d\d:\d\d:\d\d \d{4}))\] ?"
    r"(?P<msg>.*)$")
_SYSLOG = re.compile(
    r"^(?P<mon>" + _MON + r") +(?P<day>\d{1,2}) (?P<hms>\d\d:\d\d:\d\d)(?:\.\d+)? (?P<host>\S+) "
    r"(?P<tag>[^\s:\[]+)(?:\[\d+\])?: ?(?P<msg>.*)$")
_ISO = re.compile(
    r"^(?P<ts>\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?) (?P<host>\S+) "
    r"(?P<tag>[^\s:\[]+)(?:\[\d+\])?: ?(?P<msg>.*)$")
_UPTIME_PREFIX = re.compile(r"^\[ *\d+\.\d+\] ?")


@dataclass(frozen=True)
class Record:
    text: str
    at: float | None  # wall-clock seconds
    kernel: bool  # the rendering shows (or, where it cannot tell, does not deny) kernel origin
    lineno: int
    continues: bool = False  # a kmsg fragment that continues the previous record


@dataclass(frozen=True)
class Records:
    records: tuple[Record, ...]
    malformed: tuple[str, ...]


def parse(text: str, boot_time: float, now: float) -> Records:
    records: list[Record] = []
    malformed: list[str] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        # Blank lines, and kmsg dictionary lines (" KEY=value") that belong to the record before.
        if not raw.strip() or raw.startswith(" "):
            continue
        rec = _parse_line(raw, lineno, boot_time, now)
        if rec is None:
            malformed.append(f"line {lineno}: not a kernel log record: {raw[:80]!r}")
        elif rec.continues and records and records[-1].lineno == lineno - 1:
            prev = records[-1]
            records[-1] = Record(prev.text + rec.text, prev.at, prev.kernel and rec.kernel, lineno)
        else:
            records.append(rec)
    return Records(tuple(records), tuple(malformed))


def _parse_line(raw: str, lineno: int, boot_time: float, now: float) -> Record | None:
    if m := _KMSG.match(raw):
        facility = int(m.group(1)) >> 3
        return Record(m.group(5), boot_time + int(m.group(3)) / 1e6, facility == 0, lineno,
                      "+" in m.group(4))
    if raw.startswith("{"):
        return _journal_json(raw, lineno)
    if m := _DMESG.match(raw):
        return _dmesg(m, lineno, boot_time)
    if m := _SYSLOG.match(raw):
        at = _syslog_time(m.group("mon"), int(m.group("day")), m.group("hms"), now)
        return Record(_UPTIME_PREFIX.sub("", m.group("msg")), at, m.group("tag") == "kernel", lineno)
    if m := _ISO.match(raw):
        return Record(_UPTIME_PREFIX.sub("", m.group("msg")), _iso_time(m.group("ts")),
                      m.group("tag") == "kernel", lineno)
    return None


def _dmesg(m: re.Match[str], lineno: int, boot_time: float) -> Record | None:
    if m.group("fac") and m.group("fac") not in _FACILITIES:
        return None
    kernel = True
    if m.group("pri"):
        kernel = int(m.group("pri")) >> 3 == 0
    elif m.group("fac"):
        kernel = m.group("fac") == "kern"
    if m.group("up"):
        at = boot_time + float(m.group("up"))
    else:
        at = time.mktime(time.strptime(m.group("ctime"), "%a %b %d %H:%M:%S %Y"))
    return Record(m.group("msg"), at, kernel, lineno)


def _journal_json(raw: str, lineno: int) -> Record | None:
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict) or "MESSAGE" not in doc:
        return None
    msg = doc["MESSAGE"]
    if isinstance(msg, list):  # journald writes non-UTF-8 messages as a list of bytes
        msg = bytes(b for b in msg if isinstance(b, int) and 0 <= b < 256).decode(
            "utf-8", errors="replace")
    stamp = doc.get("__REALTIME_TIMESTAMP")
    at = int(stamp) / 1e6 if isinstance(stamp, str) and stamp.isdigit() else None
    return Record(str(msg), at, doc.get("_TRANSPORT") == "kernel", lineno)


def _syslog_time(mon: str, day: int, hms: str, now: float) -> float | None:
    year = time.localtime(now).tm_year
    for y in (year, year - 1):
        try:
            at = time.mktime(time.strptime(f"{y} {mon} {day} {hms}", "%Y %b %d %H:%M:%S"))
        except ValueError:  # 29 Feb in a year without it
            continue
        if at <= now + 86400:
            return at
    return None


def _iso_time(ts: str) -> float | None:
    try:
        parsed = datetime.fromisoformat(ts.replace(",", "."))
    except ValueError:
        return None
    return parsed.timestamp()  # naive: local time, as journalctl and rsyslog print it
