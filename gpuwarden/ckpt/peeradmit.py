"""The peer server's connection limits: no stranger may hold every slot.

``total`` connections at once, and at most ``per_source`` from one address that have not yet
shown the job's key; a connection that has shown it no longer counts against its address.
"""

from __future__ import annotations

import threading
import time

REFUSAL_LOG_S = 10.0  # at most one refusal line per source this often: attacks flood logs
_MAX_LOGGED = 4096  # sources remembered for that; forgotten all at once beyond


class Admission:
    """Connection limits: ``total`` at once, and ``per_source`` per address until the client
    has shown the key, so that no stranger (a slowloris from one host) can take every slot."""

    def __init__(self, total: int, per_source: int) -> None:
        self.total, self.per_source = total, per_source
        self._lock = threading.Lock()
        self._active = 0
        self._handshaking: dict[str, int] = {}
        self._logged: dict[str, float] = {}

    def enter(self, source: str) -> str:
        """"" when admitted (in the handshake); else why not."""
        with self._lock:
            if self._active >= self.total:
                return f"{self._active} connections already, the most at once"
            if self._handshaking.get(source, 0) >= self.per_source:
                return f"{self.per_source} connections from {source} already in the handshake"
            self._active += 1
            self._handshaking[source] = self._handshaking.get(source, 0) + 1
            return ""

    def authenticated(self, source: str) -> None:
        with self._lock:
            self._drop(source)

    def leave(self, source: str, in_handshake: bool) -> None:
        with self._lock:
            self._active -= 1
            if in_handshake:
                self._drop(source)

    def should_log(self, source: str) -> bool:
        now = time.monotonic()
        with self._lock:
            if len(self._logged) > _MAX_LOGGED:
                self._logged.clear()
            if now - self._logged.get(source, -REFUSAL_LOG_S) < REFUSAL_LOG_S:
                return False
            self._logged[source] = now
            return True

    def _drop(self, source: str) -> None:
        left = self._handshaking.get(source, 0) - 1
        if left > 0:
            self._handshaking[source] = left
        else:
            self._handshaking.pop(source, None)
