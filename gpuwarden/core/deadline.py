"""Run checks in child processes with a hard deadline.

A hung NFS mount or a wedged GPU driver blocks the calling thread in the kernel, where no
timeout can reach it; a child process can be abandoned instead. Children are plain forks (not
multiprocessing, whose exit handler would join, and so wait forever for, a child stuck in the
kernel). They run concurrently, so a batch takes as long as its slowest check, never longer
than the deadline.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuwarden.core.stdio import quiet_stdio

log = logging.getLogger(__name__)

_MAX_RESULT = 64 << 20


@dataclass(frozen=True)
class Outcome:
    name: str
    value: Any = None
    error: str = ""
    timed_out: bool = False
    seconds: float = 0.0


def _child(fd: int, fn: Callable[[], Any]) -> None:
    """In the fork: run, send the pickled result, and leave without running any exit handler."""
    code = 0
    try:
        try:
            quiet_stdio()
            payload = pickle.dumps(("ok", fn()))
        except BaseException as exc:  # everything must reach the parent
            detail = f"{exc.__class__.__name__}: {exc}"
            if not str(exc):
                detail += " " + traceback.format_exc(limit=2)
            payload = pickle.dumps(("error", detail))
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _reap(pid: int) -> None:
    # Never block: a child stuck in the kernel stays a zombie until it lets go; init reaps it
    # after we exit.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def run_all(tasks: dict[str, Callable[[], Any]], deadline_s: float,
            limits: dict[str, float] | None = None) -> dict[str, Outcome]:
    """Run every task in its own child; whatever has not answered by the deadline times out.

    ``limits`` gives some tasks their own deadline instead (the GPU probe: a slow nvmlInit)."""
    start = time.monotonic()
    ends = {name: start + (limits or {}).get(name, deadline_s) for name in tasks}
    running: dict[int, tuple[str, int, bytearray]] = {}  # read fd -> (name, pid, bytes so far)
    for name, fn in tasks.items():
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child leaves through os._exit
            os.close(r)
            _child(w, fn)
        os.close(w)
        running[r] = (name, pid, bytearray())
    results: dict[str, Outcome] = {}
    while running:
        now = time.monotonic()
        for fd in [fd for fd, (name, _, _) in running.items() if ends[name] <= now]:
            name, pid, _ = running.pop(fd)
            results[name] = _abandon(fd, name, pid, ends[name] - start)
        if not running:
            break
        left = min(ends[name] for name, _, _ in running.values()) - now
        ready, _, _ = select.select(list(running), [], [], left)
        for fd in ready:
            name, pid, buf = running[fd]
            chunk = os.read(fd, 1 << 16)
            if chunk and len(buf) < _MAX_RESULT:
                buf.extend(chunk)
                continue
            del running[fd]
            os.close(fd)
            _reap(pid)
            took = time.monotonic() - start
            try:
                kind, payload = pickle.loads(bytes(buf))  # noqa: S301 - our own forked child
            except Exception:
                kind, payload = "error", "check process died without an answer"
            results[name] = (Outcome(name, value=payload, seconds=took) if kind == "ok"
                             else Outcome(name, error=str(payload), seconds=took))
    return results


def _abandon(fd: int, name: str, pid: int, limit_s: float) -> Outcome:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.close(fd)
    _reap(pid)
    log.warning("check %s timed out after %.1f s", name, limit_s)
    return Outcome(name, timed_out=True, seconds=limit_s)
