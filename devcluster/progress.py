"""Progress for long waits (image builds, requeues, batches of jobs): what, elapsed, expected.

A terminal sees one line rewritten in place every second; a log (not a terminal) gets a plain
line every ``every_s`` seconds, so that a CI log shows the wait is alive without a flood.
The line itself is pure (`Wait.line`); `waiting` runs a small thread that writes it while the
caller blocks (in a subprocess, or in a polling loop that may `note` what it last saw).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TextIO

TTY_EVERY_S = 1.0
PLAIN_EVERY_S = 10.0


def _secs(s: float) -> str:
    s = max(0, round(s))
    return f"{s} s" if s < 120 else f"{s // 60} min {s % 60:02d} s"


@dataclass
class Wait:
    """One wait's state; `due` and `line` decide what to show at a given time."""

    what: str
    expected_s: float | None
    started: float
    tty: bool
    every_s: float = PLAIN_EVERY_S
    detail: str = ""
    last_shown: float = field(init=False)

    def __post_init__(self) -> None:
        self.last_shown = self.started

    def line(self, now: float) -> str:
        elapsed = now - self.started
        text = f"{self.what}: {_secs(elapsed)}"
        if self.expected_s is not None:
            text += f" (usually about {_secs(self.expected_s)})"
            if elapsed > 1.5 * self.expected_s + 10:
                text += ", longer than usual, still waiting"
        return f"{text}; {self.detail}" if self.detail else text

    def due(self, now: float) -> bool:
        """On a terminal, every tick; in a log, once every ``every_s``."""
        if self.tty or now - self.last_shown >= self.every_s:
            self.last_shown = now
            return True
        return False

    def done(self, now: float, ok: bool) -> str:
        elapsed = _secs(now - self.started)
        return f"{self.what}: done in {elapsed}" if ok else f"{self.what}: stopped after {elapsed}"


class Ticker:
    """Writes a `Wait` to a stream until stopped. ``clock`` is injectable for tests."""

    def __init__(self, wait: Wait, stream: TextIO, clock: Callable[[], float]) -> None:
        self.wait, self.stream, self.clock = wait, stream, clock
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._width = 0  # of the line now on a terminal, to blank it when rewriting

    def tick(self) -> None:
        now = self.clock()
        if self.wait.due(now):
            self._write(self.wait.line(now), final=False)

    def begin(self) -> None:
        """The first line, at once: a log says what it waits for before the first interval."""
        self._write(self.wait.line(self.clock()), final=False)

    def finish(self, ok: bool) -> None:
        self._write(self.wait.done(self.clock(), ok), final=True)

    def note(self, detail: str) -> None:
        self.wait.detail = detail

    def _write(self, text: str, final: bool) -> None:
        with self._lock:
            if self.wait.tty:
                # Blank a longer line left before, then write this one over it.
                blank = "\r" + " " * self._width if self._width > len(text) else ""
                self.stream.write(f"{blank}\r{text}" + ("\n" if final else ""))
                self._width = 0 if final else len(text)
            else:
                self.stream.write(text + "\n")
            self.stream.flush()

    def run(self) -> None:
        # Look once a second; `due` keeps a log to one line per `every_s`.
        while not self._stop.wait(min(TTY_EVERY_S, self.wait.every_s)):
            self.tick()

    def stop(self) -> None:
        self._stop.set()


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


@contextmanager
def waiting(what: str, expected_s: float | None = None, stream: TextIO | None = None,
            tty: bool | None = None, every_s: float = PLAIN_EVERY_S,
            clock: Callable[[], float] = time.monotonic) -> Iterator[Ticker]:
    """Show the wait while the body runs; a last line says how long it took (or that it
    stopped, when the body raised). The body may call ``note`` with what it last saw."""
    out = stream if stream is not None else sys.stdout
    wait = Wait(what, expected_s, clock(), _is_tty(out) if tty is None else tty, every_s)
    ticker = Ticker(wait, out, clock)
    ticker.begin()
    thread = threading.Thread(target=ticker.run, name=f"progress: {what}", daemon=True)
    thread.start()
    ok = False
    try:
        yield ticker
        ok = True
    finally:
        ticker.stop()
        thread.join(timeout=5)
        ticker.finish(ok)
