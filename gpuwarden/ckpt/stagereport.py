"""What the prolog's stage-in child says, brought back to the prolog (issue 37).

The child that copies a requeued job's step (`stagein.run_as`) has its stdout and stderr on
/dev/null (a child stuck in a hung filesystem must not hold the hook's), so its log lines were
lost, and a stage-in that staged nothing said why nowhere. A `Channel` is a pipe and a logging
handler on the ``gpuwarden`` logger, set up by the prolog before it forks: in the child (or in
the process, with an in-process runner) it sends every record at WARNING and above, and the
copy's plan and result, as lines; the prolog reads them once the child has exited or been
killed (`collect`) and logs one line for the whole stage-in (`stagein`).

Bounded on both ends: the child writes at most `MAX_BYTES`, each line at most `MAX_LINE`
characters, without ever blocking (the pipe's write end is non-blocking: a full pipe drops
lines); the prolog reads without blocking, after the child is gone, at most what the child may
write. The text may quote user-controlled names (a rank directory's): control characters,
backslashes and everything outside printable ASCII are escaped, so a line can forge no other.
Known secrets (the S3 credentials root read for the child) are replaced before anything is
written. Standard library only: the prolog imports this.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from types import TracebackType

MAX_BYTES = 8 << 10  # all a child may send
MAX_LINE = 400  # characters of one line, escaped
LINE_MAX = 1900  # the prolog's summary line: syslog keeps 2000 (core.logsetup)
PIPE_SIZE = 16 << 10  # asked for (Linux gives 64 KiB, but one page to a user over quota)
_RESERVED = MAX_LINE + 256  # kept for the plan, the result and the last line
REDACTED = "<redacted>"
LOGGER = "gpuwarden"

_ESCAPED = re.compile(r"[\x00-\x1f\x7f\\]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}
_PRINTABLE = re.compile(r"[\x20-\x7e]*")
_PLAN = re.compile(r"([0-9]{1,20}) ([0-9]{1,9}) ([0-9]{1,9}) ([0-9]{1,20})")
_COPIED = re.compile(r"([0-9]{1,20}) ([0-9]{1,9}\.[0-9]{3}) ([0-9]{1,9}) ([0-9]{1,9})")


def escape(text: str) -> str:
    """``text`` as printable ASCII: control characters and backslashes as escapes (``\\n``,
    ``\\x1b``, ``\\\\``), anything else outside ASCII as ``\\xe9``, ``\\u202e``..."""
    text = _ESCAPED.sub(lambda m: _NAMED.get(m.group(), f"\\x{ord(m.group()):02x}"), text)
    return text.encode("ascii", "backslashreplace").decode("ascii")


def bounded(text: str, limit: int = MAX_LINE) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def redact(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return text


@dataclass(frozen=True)
class Copied:
    """The copy's own account: bytes copied, seconds, ranks already there, ranks failed."""

    bytes: int
    seconds: float
    there: int
    failed: int


@dataclass(frozen=True)
class Report:
    """What came back from the child: its warnings and errors (``said``, escaped, in order),
    whether some were dropped (``cut``), the step and ranks it chose with their bytes
    (``plan``: step, first rank, last rank, bytes), the copy's result, and its last line at
    INFO or above (why there was nothing to stage)."""

    said: tuple[str, ...] = ()
    cut: bool = False
    plan: tuple[int, int, int, int] | None = None
    copied: Copied | None = None
    last: str = ""


class Channel(logging.Handler):
    """The pipe and its handler (a context manager, entered by the prolog around the runner).
    The child's side: `emit` (through logging), `plan`, `copied`, `finish`. The prolog's:
    `collect`, once the child has exited or was killed."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__(logging.INFO)
        self.secrets = tuple(s for s in secrets if len(s) >= 4)
        self.r = self.w = -1
        self.capacity = 0  # the pipe's, in bytes
        self._sent = 0
        self._cut = False
        self._once: set[str] = set()
        self._last = ""
        self._level = logging.NOTSET

    # ---- set up, around the runner --------------------------------------------------------
    def __enter__(self) -> Channel:
        r, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        # Above 0-2: the child points those at /dev/null (quiet_stdio) after the fork.
        self.r, self.w = _above_stdio(r), _above_stdio(w)
        with contextlib.suppress(OSError):  # the child never blocks on it anyway
            fcntl.fcntl(self.w, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        self.capacity = fcntl.fcntl(self.w, fcntl.F_GETPIPE_SZ)
        logger = logging.getLogger(LOGGER)
        # The copy's lines at INFO (why there was nothing to stage) must reach this handler
        # whatever the host's logging says; the hooks log at INFO already.
        self._level = logger.level
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        logger.addHandler(self)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        logger = logging.getLogger(LOGGER)
        logger.removeHandler(self)
        logger.setLevel(self._level)
        for fd in (self.r, self.w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.r = self.w = -1

    # ---- the child's side -----------------------------------------------------------------
    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                err = record.exc_info[1]
                text += f": {type(err).__name__}: {err}"
            text = bounded(escape(redact(text, self.secrets)))
        except Exception:  # a record that cannot be formatted says so, never raises
            text = f"(a line of {record.name} that could not be formatted)"
        self._last = text
        if record.levelno >= logging.WARNING:
            self._send("W", text, MAX_BYTES - _RESERVED)

    def plan(self, step: int, ranks: range, total: int) -> None:
        if ranks:
            self._send_once("P", f"{step} {ranks[0]} {ranks[-1]} {total}")

    def copied(self, done: int, seconds: float, there: int, failed: int) -> None:
        self._send_once("C", f"{done} {min(seconds, 1e9 - 1):.3f} {there} {failed}")

    def finish(self) -> None:
        """The last line at INFO or above: why there was nothing to stage."""
        if self._last:
            self._send_once("L", self._last)

    def _send_once(self, kind: str, text: str) -> None:
        with self.lock or contextlib.nullcontext():
            if kind not in self._once:
                self._once.add(kind)
                self._send(kind, text, MAX_BYTES)

    def _send(self, kind: str, text: str, room: int) -> None:
        data = f"{kind} {text}\n".encode("ascii")
        with self.lock or contextlib.nullcontext():
            if self._sent + len(data) > room:
                if not self._cut:
                    self._cut = True
                    self._send_once("T", "")
                return
            try:
                # One write of at most PIPE_BUF bytes: all of it or none (O_NONBLOCK).
                self._sent += os.write(self.w, data)
            except OSError:  # full (nobody reads yet) or closed: dropped, never waited on
                self._cut = True

    # ---- the prolog's side ----------------------------------------------------------------
    def collect(self) -> Report:
        """What the child sent, read without blocking: call once it has exited or was
        killed. The prolog's write end is closed first, so an exited child's lines end in EOF;
        a killed child stuck in the kernel may still hold its end: what is there is read."""
        with contextlib.suppress(OSError):
            os.close(self.w)
        self.w = -1
        raw = bytearray()
        while len(raw) <= MAX_BYTES:
            try:
                chunk = os.read(self.r, 1 << 16)
            except (BlockingIOError, InterruptedError):
                break
            if not chunk:
                break
            raw += chunk
        report = parse(bytes(raw[:MAX_BYTES]), self.secrets)
        if len(raw) + MAX_LINE + 16 > self.capacity:
            # Full: the child's next line (and its note that it dropped some) did not fit.
            report = replace(report, cut=True)
        return report


def parse(raw: bytes, secrets: Iterable[str] = ()) -> Report:
    """The lines the child sent, as a Report. Untrusted (the child has become the job's
    user): malformed lines are dropped, text is checked again."""
    said: list[str] = []
    cut = False
    plan: tuple[int, int, int, int] | None = None
    copied: Copied | None = None
    last = ""
    lines = raw.split(b"\n")
    if lines and lines[-1]:
        cut = True  # a line cut short by the bound
    for line in lines[:-1]:
        kind, _, body = line.decode("ascii", "replace").partition(" ")
        if not _PRINTABLE.fullmatch(body):
            body = escape(body)
        body = bounded(redact(body, secrets))
        if kind == "W":
            said.append(body)
        elif kind == "T":
            cut = True
        elif kind == "L":
            last = body
        elif kind == "P" and (m := _PLAN.fullmatch(body)) and plan is None:
            step, first, final, total = map(int, m.groups())
            plan = (step, first, max(first, final), total)
        elif kind == "C" and (m := _COPIED.fullmatch(body)) and copied is None:
            copied = Copied(int(m[1]), float(m[2]), int(m[3]), int(m[4]))
    return Report(tuple(said), cut, plan, copied, last)


def _above_stdio(fd: int) -> int:
    if fd > 2:
        return fd
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(fd)
    return new
