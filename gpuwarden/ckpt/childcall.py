"""Run a blocking call in a forked child that is killed at a deadline.

For user-database lookups in the prolog (``getpwuid``, ``getgrouplist``): NSS modules (LDAP,
SSSD) can hang inside C while holding the GIL, so a thread with a timeout cannot give up on
them. A child process can be killed whatever it holds. The result comes back as JSON over a
pipe. Light: the prolog imports this.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import time
from collections.abc import Callable
from typing import Any

from gpuwarden.core.errors import GpuwardenError

_MAX_RESULT = 1 << 20


class ChildTimeout(GpuwardenError):
    """The call did not finish before the deadline: the child was killed."""


class ChildFailed(GpuwardenError):
    """The call raised in the child (other than KeyError), or the child died."""


def call(fn: Callable[[], Any], deadline_s: float) -> Any:
    """``fn()`` (JSON-able) computed in a child; KeyError in the child is raised here as
    KeyError (NSS's "no such user"); ChildTimeout when it takes longer than ``deadline_s``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child, which leaves through os._exit
        _child(fn, r, w)
    os.close(w)
    try:
        raw = _read(r, time.monotonic() + deadline_s)
    finally:
        os.close(r)
        _reap(pid)
    if raw is None:
        raise ChildTimeout(f"no answer within {deadline_s:g} s")
    try:
        out = json.loads(raw)
    except ValueError:
        raise ChildFailed("the child died before answering") from None
    if "missing" in out:
        raise KeyError(out["missing"])
    if "error" in out:
        raise ChildFailed(str(out["error"]))
    return out["ok"]


def _child(fn: Callable[[], Any], r: int, w: int) -> None:  # pragma: no cover - see call
    try:
        os.close(r)
        try:
            out: dict[str, Any] = {"ok": fn()}
        except KeyError as exc:
            out = {"missing": str(exc)}
        except Exception as exc:
            out = {"error": f"{type(exc).__name__}: {exc}"}
        view = memoryview(json.dumps(out).encode())
        while view:
            view = view[os.write(w, view):]
    finally:
        os._exit(0)


def _read(r: int, deadline: float) -> bytes | None:
    """Everything until EOF, or None at the deadline."""
    chunks: list[bytes] = []
    size = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([r], [], [], left)
        if not ready:
            continue
        chunk = os.read(r, 65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > _MAX_RESULT:
            return b""  # not ours to believe: reported as a child that died
        chunks.append(chunk)


def _reap(pid: int) -> None:
    """Kill (harmless when it has exited) and reap without ever blocking: a child stuck in the
    kernel dies when the kernel lets go, and init reaps it then."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    for _ in range(20):
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:
            return
        time.sleep(0.01)
