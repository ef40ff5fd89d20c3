"""Progress of a long transfer, as log lines: at most one every few seconds, none for a
transfer that ends sooner (a checkpoint of a few MiB says nothing)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Progress:
    """Call with each chunk's byte count (boto3's transfer Callback does, from its threads)."""

    def __init__(self, what: str, total: int, every_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.total, self.every_s, self._clock = what, total, every_s, clock
        self.done = 0
        self._start = self._last = clock()
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = self._clock()
            if now - self._last < self.every_s:
                return
            self._last = now
            done, elapsed = self.done, now - self._start
        rate = done / elapsed / 2**20 if elapsed > 0 else 0.0
        pct = 100.0 * done / self.total if self.total else 100.0
        log.info("%s: %.0f of %.0f MiB (%.0f%%), %.0f MiB/s", self.what, done / 2**20,
                 self.total / 2**20, pct, rate)
