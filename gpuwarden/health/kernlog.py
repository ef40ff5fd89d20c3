"""Kernel log records from /dev/kmsg and from the renderings admins save: dmesg (plain, -T, -r,
-x, -d, --time-format iso, with CONFIG_PRINTK_CALLER's ``[ T1234]``), syslog (BSD and RFC 5424,
rsyslog imklog), journalctl (short, short-precise, short-iso, short-full, short-monotonic, json).
Pure: text in, records out.

Each record says whether the rendering shows it came from the kernel facility:
* kmsg and ``dmesg -r``: the priority field (facility = pri >> 3 must be 0);
* ``dmesg -x``: the facility name (``kern``);
* ``journalctl -o json``: ``_TRANSPORT=kernel``, a field journald sets and no client can;
* syslog and journalctl short: the ``kernel`` tag (RFC 5424: also its facility). Any local
  user can forge that tag with ``logger -t kernel``;
* plain dmesg: nothing.
Only kmsg and journalctl -o json (TRUSTED) keep a user's text from posing as a kernel record:
kmsg escapes every control character and journald stores records, not lines. Every other
rendering is forgeable (``logger -t kernel``, or a newline in a file name where the kernel's
syslog interface repeats the ``<pri>[time]`` prefix after each newline inside a record), so
``gpuwarden config check`` and ``health selftest`` refuse them (kernlogtrust.py). Lines with a
repeated ``<pri>[time]`` prefix are not joined back into one record: two real records printed
in the same microsecond look the same, and joining them could hide a real Xid.
Lines split on "\\n" only: str.splitlines() would also split on \\r, \\x0b, \\x1c, U+2028 ...,
characters a user can put inside one record.
Times: kmsg, dmesg and short-monotonic count from boot; the others are wall clock.
Syslog has no year: the year that puts the record at most a day after ``now`` is assumed.
"""

from __future__ import annotations

import calendar
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

TRUSTED = frozenset({"kmsg", "journal-json"})
MAX_LINE = 64 << 10  # longer lines are no kernel record (the kernel caps one at 1-2 KiB)
MAX_TEXT = 8 << 10  # kmsg escapes a byte as 4 characters: 2 KiB of record is at most 8 KiB

_KMSG = re.compile(r"^(\d{1,4}),(\d+),(\d+),([^;]*);(.*)$", re.S)
_MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
_MON = "(?:" + "|".join(_MONTHS) + ")"
_DAY = "(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_FACILITIES = frozenset({
    "kern", "user", "mail", "daemon", "auth", "syslog", "lpr", "news", "uucp", "cron", "authpriv",
    "ftp", *(f"local{i}" for i in range(8)),
})
_CALLER = r"(?: ?\[ *[TC]\d{1,10}\])?"  # CONFIG_PRINTK_CALLER
_DELTA = r"(?: <[ \d]{0,12}\.\d{1,9}>)?"  # dmesg -d
_FACLVL = r"(?:(?P<fac>[a-z0-9]{1,8}) {0,8}:(?P<lvl>[a-z]{1,8}) {0,8}: )"
_DMESG = re.compile(
    r"^(?:<(?P<pri>\d{1,4})>|" + _FACLVL + r")?"
    r"\[ {0,12}(?:(?P<up>\d{1,12}\.\d{1,9})|(?P<ctime>" + _DAY + " " + _MON +
    r" [ \d]\d \d\d:\d\d:\d\d \d{4}))" + _DELTA + r"\]" + _CALLER + r" ?(?P<msg>.*)$", re.S)
_DMESG_ISO = re.compile(
    r"^" + _FACLVL + r"?(?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d,\d{1,9}[+-]\d\d:\d\d)" + _CALLER +
    r" (?P<msg>.*)$", re.S)
_TAG = r"(?P<host>\S{1,255}) (?P<tag>[^\s:\[]{1,255})(?:\[\d{1,10}\])?: ?(?P<msg>.*)$"
_SYSLOG = re.compile(
    r"^(?P<mon>" + _MON + r") +(?P<day>\d{1,2}) (?P<hms>\d\d:\d\d:\d\d)(?:\.\d{1,9})? " + _TAG,
    re.S)
_ISO = re.compile(
    r"^(?P<ts>\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:\.\d{1,9})?(?:Z|[+-]\d\d:?\d\d)?) " + _TAG,
    re.S)
_FULL = re.compile(  # journalctl -o short-full
    r"^" + _DAY + r" (?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:\.\d{1,9})? "
    r"(?P<tz>[A-Za-z][A-Za-z0-9+-]{0,9}) " + _TAG, re.S)
_MONOTONIC = re.compile(  # journalctl -o short-monotonic: only the kernel's own records matter
    r"^\[ {0,12}(?P<up>\d{1,12}\.\d{1,9})\] (?P<host>\S{1,255}) (?P<tag>kernel): ?(?P<msg>.*)$",
    re.S)
_RFC5424 = re.compile(
    r"^<(?P<pri>\d{1,3})>1 (?P<ts>\S{1,64}) (?P<host>\S{1,255}) (?P<tag>\S{1,48}) \S{1,128} "
    r"\S{1,32} (?:-|(?:\[[^\]]*\])+)(?: \ufeff?(?P<msg>.*))?$", re.S)
_UPTIME_PREFIX = re.compile(r"^\[ {0,12}\d{1,12}\.\d{1,9}\]" + _CALLER + " ?")
# Renderings seen in the wild that carry no absolute time: named in the error, not guessed at.
_UNREADABLE = (
    (re.compile(r"^(?:" + _FACLVL + r")?\[(?:" + _MON + r" ?[ \d]\d \d\d:\d\d| {0,12}[+-]\d)"),
     "dmesg -e / --time-format reltime (relative times)"),
)


@dataclass(frozen=True)
class Record:
    text: str
    at: float | None  # wall-clock seconds
    kernel: bool  # the rendering shows (or, where it cannot tell, does not deny) kernel origin
    lineno: int
    continues: bool = False  # a kmsg fragment that continues the previous record
    rendering: str = "kmsg"
    boot_clock: bool = False  # ``at`` is this boot's clock (kmsg): never "in the future"


@dataclass(frozen=True)
class Records:
    records: tuple[Record, ...]
    malformed: tuple[str, ...]
    renderings: frozenset[str] = frozenset()
    oversized: int = 0  # lines too long to be a kernel record, skipped

    @property
    def forgeable(self) -> frozenset[str]:
        return self.renderings - TRUSTED


def parse(text: str, boot_time: float, now: float) -> Records:
    records: list[Record] = []
    malformed: list[str] = []
    renderings: set[str] = set()
    oversized = 0
    for lineno, raw in enumerate(text.split("\n"), 1):
        # Blank lines, and kmsg dictionary lines (" KEY=value") or dmesg's indented
        # continuation lines that belong to the record before.
        if not raw.strip() or raw.startswith(" "):
            continue
        if len(raw) > MAX_LINE:
            oversized += 1
            continue
        rec = _parse_line(raw, lineno, boot_time, now)
        if rec is None:
            malformed.append(f"line {lineno}: {_why_unreadable(raw)}: {raw[:80]!r}")
            continue
        renderings.add(rec.rendering)
        if rec.continues and records and records[-1].lineno == lineno - 1:
            prev = records[-1]
            records[-1] = Record((prev.text + rec.text)[:MAX_TEXT], prev.at,
                                 prev.kernel and rec.kernel, lineno, False, prev.rendering,
                                 prev.boot_clock)
        else:
            records.append(rec)
    return Records(tuple(records), tuple(malformed), frozenset(renderings), oversized)


def _why_unreadable(raw: str) -> str:
    for pattern, name in _UNREADABLE:
        if pattern.match(raw):
            return f"{name} cannot be read"
    return "not a kernel log record"


def _parse_line(raw: str, lineno: int, boot_time: float, now: float) -> Record | None:
    if m := _KMSG.match(raw):
        facility = int(m.group(1)) >> 3
        return Record(m.group(5)[:MAX_TEXT], boot_time + int(m.group(3)) / 1e6, facility == 0,
                      lineno, "+" in m.group(4), "kmsg", True)
    if raw.startswith("{"):
        return _journal_json(raw, lineno)
    # The order matters: short-monotonic before dmesg (both start "[secs]"), dmesg's ISO time
    # (a comma before the fraction) before the syslog ISO stamps.
    for pattern, build in _PARSERS:
        if m := pattern.match(raw):
            return build(m, lineno, boot_time, now)
    return None


def _monotonic(m: re.Match[str], lineno: int, boot_time: float, _now: float) -> Record | None:
    return _rec(m.group("msg"), boot_time + float(m.group("up")), True, lineno,
                "journal-short-monotonic")


def _dmesg_iso(m: re.Match[str], lineno: int, _boot: float, _now: float) -> Record | None:
    if m.group("fac") and m.group("fac") not in _FACILITIES:
        return None
    return _rec(m.group("msg"), _iso_time(m.group("ts")), m.group("fac") in (None, "kern"), lineno,
                "dmesg-iso")


def _syslog(m: re.Match[str], lineno: int, _boot: float, now: float) -> Record | None:
    at = _syslog_time(m.group("mon"), int(m.group("day")), m.group("hms"), now)
    return _tagged(m, at, lineno, "syslog")


def _syslog_iso(m: re.Match[str], lineno: int, _boot: float, _now: float) -> Record | None:
    return _tagged(m, _iso_time(m.group("ts")), lineno, "syslog-iso")


def _journal_full(m: re.Match[str], lineno: int, _boot: float, _now: float) -> Record | None:
    return _tagged(m, _full_time(m.group("ts"), m.group("tz")), lineno, "journal-short-full")


def _rfc5424(m: re.Match[str], lineno: int, _boot: float, _now: float) -> Record | None:
    kernel = int(m.group("pri")) >> 3 == 0 and m.group("tag") == "kernel"
    return _rec(_UPTIME_PREFIX.sub("", m.group("msg") or ""), _iso_time(m.group("ts")), kernel,
                lineno, "rfc5424")


def _rec(text: str, at: float | None, kernel: bool, lineno: int, rendering: str) -> Record:
    return Record(text[:MAX_TEXT], at, kernel, lineno, rendering=rendering)


def _tagged(m: re.Match[str], at: float | None, lineno: int, rendering: str) -> Record:
    return _rec(_UPTIME_PREFIX.sub("", m.group("msg")), at, m.group("tag") == "kernel", lineno,
                rendering)


def _dmesg(m: re.Match[str], lineno: int, boot_time: float, _now: float) -> Record | None:
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
    return _rec(m.group("msg"), at, kernel, lineno, "dmesg")


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
    return _rec(str(msg), at, doc.get("_TRANSPORT") == "kernel", lineno, "journal-json")


_Builder = Callable[[re.Match[str], int, float, float], "Record | None"]
_PARSERS: tuple[tuple[re.Pattern[str], _Builder], ...] = (
    (_MONOTONIC, _monotonic), (_DMESG, _dmesg), (_DMESG_ISO, _dmesg_iso), (_SYSLOG, _syslog),
    (_ISO, _syslog_iso), (_FULL, _journal_full), (_RFC5424, _rfc5424),
)


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


def _full_time(ts: str, tz: str) -> float | None:
    try:
        parsed = time.strptime(ts, "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return None
    # journalctl prints the zone's abbreviation; UTC/GMT are exact, any other is local time.
    return float(calendar.timegm(parsed)) if tz in ("UTC", "GMT") else time.mktime(parsed)
