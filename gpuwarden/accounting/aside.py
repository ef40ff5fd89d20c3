"""Part of a computation run in a forked child while the caller does the rest (`Aside`), its
result pickled back: the lemon scoring's per-node tests, on numpy arrays the child only
reads (a child that walked the history's Python objects copied their pages, and lost what
it won). Where fork is missing, or the child fails, it runs in place instead: the same
result, or the same error with its own traceback, only later.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from multiprocessing import get_all_start_methods, get_context
from multiprocessing.connection import Connection
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


def _child(fn: Callable[[], Any], conn: Connection) -> None:
    try:
        got = (True, fn())
    except BaseException:  # the parent runs it again, where it raises
        got = (False, None)
    try:
        conn.send(got)
    except Exception:  # a result that will not pickle: the parent's turn
        conn.send((False, None))
    finally:
        conn.close()


class Aside(Generic[T]):
    """``fn()`` started in a forked child (``fork`` False: run in place, at `result`).
    ``fn`` sees the caller's memory as it was at the fork."""

    def __init__(self, fn: Callable[[], T], fork: bool = True) -> None:
        self._fn = fn
        self._conn: Connection | None = None
        self._proc: Any = None
        if fork and "fork" in get_all_start_methods():
            ctx = get_context("fork")
            recv, send = ctx.Pipe(duplex=False)
            self._proc = ctx.Process(target=_child, args=(fn, send), daemon=True)
            self._proc.start()
            send.close()
            self._conn = recv

    def cancel(self) -> None:
        """The child stopped and reaped, its result never read (the caller failed first): a
        result larger than the pipe holds would keep it waiting until the interpreter ends."""
        conn, proc = self._conn, self._proc
        if conn is None:
            return
        self._conn = None
        conn.close()
        proc.terminate()
        proc.join()

    def result(self) -> T:
        """``fn()``'s value: the child's, else computed here."""
        conn, proc = self._conn, self._proc
        if conn is None:
            return self._fn()
        self._conn = None
        try:
            ok, value = conn.recv()
        except (EOFError, OSError):
            ok, value = False, None  # the child died (out of memory?)
        finally:
            conn.close()
            proc.join()
        if ok:
            return value  # type: ignore[no-any-return]
        log.info("the forked child gave no result (exit code %s): running it here",
                 proc.exitcode)
        return self._fn()
