"""Counters kept across runs and reboots in root's state directory: one small JSON file of
numbers, updated under a lock so that runs side by side (a node's prologs, its periodic
check) never lose each other's counts, and replaced atomically (safefs).

A counter never goes backwards, except that a file that cannot be read as counters (corrupt,
truncated, not ours) is reset to nothing, loudly (an error in the log, the caller's self
error): Prometheus takes that as a counter reset. A lock held too long is given up after
``wait_s`` (StateDirError): metrics never hang the run that counts.

What is written from the counters (a textfile) is written under the same lock (`locked`,
`update`'s ``then``): read outside it, a run could write counts older than those another run
wrote a moment before, and the counter would go backwards in the textfile.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from gpuwarden.core.safefs import StateDirError, atomic_write, ensure_private_dir, read_private

log = logging.getLogger(__name__)

Numbers = dict[str, float]
_POLL_S = 0.01


def _parse(data: bytes | None) -> tuple[Numbers, str]:
    """The counters in ``data`` and, when they could not be read, why (then none)."""
    if not data:
        return {}, ""
    try:
        doc = json.loads(data)
    except ValueError as exc:
        return {}, f"not JSON ({exc})"
    if not isinstance(doc, dict):
        return {}, "not a JSON object"
    out: Numbers = {}
    for key, value in doc.items():
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value) or value < 0:
            return {}, f"{key!r} is not a count: {value!r:.40}"
        out[str(key)] = float(value)
    return out, ""


def read(directory: str, name: str) -> tuple[Numbers, str]:
    """The counters stored, and why they were reset ("" when they were not). Raises
    StateDirError when the directory or file is not root's alone."""
    path = os.path.join(directory, name)
    numbers, bad = _parse(read_private(path))
    if bad:
        log.error("%s: %s: counters reset to 0", path, bad)
    return numbers, bad


class _Lock:
    def __init__(self, directory: str, name: str, wait_s: float,
                 mono: Callable[[], float], sleep: Callable[[float], None]) -> None:
        self.path = os.path.join(directory, name)
        self.wait_s, self.mono, self.sleep = wait_s, mono, sleep
        self.fd = -1

    def __enter__(self) -> None:
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                              0o600)
        except OSError as exc:
            raise StateDirError(f"{self.path}: {exc}") from None
        until = self.mono() + self.wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES) or self.mono() >= until:
                    os.close(self.fd)
                    why = "held by another run" if exc.errno == errno.EWOULDBLOCK else exc
                    raise StateDirError(f"{self.path}: not locked within {self.wait_s:g} s "
                                        f"({why})") from None
            self.sleep(_POLL_S)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


@contextmanager
def locked(directory: str, name: str, wait_s: float = 1.0,
           mono: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep) -> Iterator[tuple[Numbers, str]]:
    """The stored counters and why they were reset ("" when they were not), read under the
    counters' lock, held until the block ends. Raises StateDirError or OSError."""
    ensure_private_dir(directory)
    with _Lock(directory, f"{name}.lock", wait_s, mono, sleep):
        yield read(directory, name)


def update(directory: str, name: str, add: Mapping[str, float],
           put: Mapping[str, float] | None = None, wait_s: float = 1.0,
           mono: Callable[[], float] = time.monotonic,
           sleep: Callable[[float], None] = time.sleep,
           then: Callable[[Numbers], None] | None = None) -> tuple[Numbers, str]:
    """Add ``add`` to the stored counters and set the gauges ``put`` (both >= 0), in one
    locked read-modify-write; ``then`` gets the numbers now stored, still under the lock (to
    write a textfile from them). Returns the numbers now stored and why the old ones were
    reset ("" when they were not). Raises StateDirError or OSError when the file cannot be
    written (the numbers are then as they were), or what ``then`` raises."""
    for key, value in {**add, **(put or {})}.items():
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{key}: {value!r} is not a count")
    with locked(directory, name, wait_s, mono, sleep) as (numbers, bad):
        before = dict(numbers)
        for key, value in add.items():
            numbers[key] = numbers.get(key, 0.0) + value
        numbers.update(put or {})
        if numbers != before or bad:  # unchanged: no write (a healthy node's every run)
            atomic_write(directory, name, json.dumps(numbers, sort_keys=True).encode())
        if then is not None:
            then(numbers)
    return numbers, bad
