"""Run checks in child processes with a hard deadline.

A hung NFS mount or a wedged GPU driver blocks the calling thread in the kernel, where no
timeout can reach it; a child process can be abandoned instead. Children run concurrently, so a
batch takes as long as its slowest check, never longer than the deadline.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

_CTX = multiprocessing.get_context("fork")


@dataclass(frozen=True)
class Outcome:
    name: str
    value: Any = None
    error: str = ""
    timed_out: bool = False
    seconds: float = 0.0


def _child(conn: Any, fn: Callable[[], Any]) -> None:
    try:
        conn.send(("ok", fn()))
    except BaseException as exc:  # everything must reach the parent
        detail = f"{exc.__class__.__name__}: {exc}"
        if not str(exc):
            detail += " " + traceback.format_exc(limit=2)
        conn.send(("error", detail))
    finally:
        conn.close()


def run_all(tasks: dict[str, Callable[[], Any]], deadline_s: float) -> dict[str, Outcome]:
    """Run every task in its own child; whatever has not answered by the deadline times out."""
    start = time.monotonic()
    running: dict[Any, tuple[str, Any]] = {}  # read end of each child's pipe -> (name, process)
    for name, fn in tasks.items():
        parent, child = _CTX.Pipe(duplex=False)
        proc = _CTX.Process(target=_child, args=(child, fn), daemon=True, name=f"check-{name}")
        proc.start()
        child.close()
        running[parent] = (name, proc)
    results: dict[str, Outcome] = {}
    end = start + deadline_s
    while running:
        left = end - time.monotonic()
        if left <= 0:
            break
        ready: list[Any] = multiprocessing.connection.wait(list(running), timeout=left)
        for conn in ready:
            name, proc = running.pop(conn)
            took = time.monotonic() - start
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                kind, payload = "error", f"check process died (exit {proc.exitcode})"
            conn.close()
            proc.join(1.0)
            results[name] = (Outcome(name, value=payload, seconds=took) if kind == "ok"
                             else Outcome(name, error=str(payload), seconds=took))
    for conn, (name, proc) in running.items():
        # SIGKILL; a child stuck in the kernel (D state) stays until the kernel lets go, but
        # we never wait for it.
        proc.kill()
        conn.close()
        log.warning("check %s timed out after %.1f s", name, deadline_s)
        results[name] = Outcome(name, timed_out=True, seconds=deadline_s)
    return results
