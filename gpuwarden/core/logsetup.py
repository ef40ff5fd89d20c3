"""Where gpuwarden's log lines go: stderr always, and errors to syslog/the journal.

Slurm shows a Prolog/Epilog/HealthCheckProgram's stderr only when it exits non-zero, and the
hooks fail open (exit 0), so an error written to stderr alone is never seen: errors also go to
/dev/log. The socket is opened at the first error only (the prolog's fast path never pays for
it), sends have a deadline, and a syslog that is absent or stuck never stops gpuwarden.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import sys

DEV_LOG = "/dev/log"
_SEND_TIMEOUT_S = 1.0
_LOG_DAEMON = 3 << 3
_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6}


class SyslogHandler(logging.Handler):
    """RFC 3164 lines to a local syslog socket (datagram), opened lazily."""

    def __init__(self, path: str = DEV_LOG, ident: str = "gpuwarden") -> None:
        super().__init__(logging.ERROR)
        self.path = path
        self.ident = ident
        self._sock: socket.socket | None = None

    def _socket(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.settimeout(_SEND_TIMEOUT_S)
            try:
                sock.connect(self.path)
            except OSError:
                sock.close()
                raise
            self._sock = sock
        return self._sock

    def emit(self, record: logging.LogRecord) -> None:
        try:
            pri = _LOG_DAEMON | _PRIORITY.get(record.levelno, 3)
            text = " ".join(self.format(record).split())[:2000]
            self._socket().send(f"<{pri}>{self.ident}[{os.getpid()}]: {text}".encode(
                errors="replace"))
        except OSError:
            # Syslog away or stuck: stderr still has the line; never fail the hook over it.
            self.close_socket()

    def close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        self.close_socket()
        super().close()


def add_syslog(path: str = DEV_LOG) -> SyslogHandler | None:
    """Send errors to ``path`` when it is a socket (once per process); None when absent."""
    root = logging.getLogger()
    for h in root.handlers:
        if isinstance(h, SyslogHandler):
            return h
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return None
    except OSError:
        return None
    handler = SyslogHandler(path)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    return handler


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the stderr handler gpuwarden installed, so a second setup replaces it."""


def setup_stderr(verbose: bool) -> None:
    """Log to the current sys.stderr at INFO (DEBUG with -v)."""
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, _Stderr)]:
        root.removeHandler(h)
    handler = _Stderr(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
