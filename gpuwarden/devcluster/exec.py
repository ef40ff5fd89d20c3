"""Run a command in a container with a hard deadline (docker's exec API has none of its own)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ExecResult:
    rc: int
    out: str
    err: str

    def check(self, what: str) -> ExecResult:
        if self.rc != 0:
            raise RuntimeError(f"{what} failed (exit {self.rc}): {self.err.strip() or self.out.strip()}")
        return self


# How long past its own deadline an exec may take to come back: `timeout` inside ends the
# command, but a process that escaped its group (dpkg runs in a pty of its own) can hold the
# exec's output open, and dockerd under load can stall a stream; the caller must not wait on.
GRACE_S = 30.0


class ExecStalled(RuntimeError):
    pass


def _bounded(call: Callable[[], Any], limit: float, argv: list[str]) -> Any:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["res"] = call()
        except BaseException as exc:  # handed to the caller as it is
            box["exc"] = exc
    t = threading.Thread(target=run, daemon=True, name="docker-exec")
    t.start()
    t.join(limit)
    if t.is_alive():
        raise ExecStalled(f"`{' '.join(argv)[:200]}` did not come back within {limit:g} s "
                          "(its own deadline and a grace): the container or dockerd is stuck")
    if "exc" in box:
        raise box["exc"]
    return box["res"]


def run_in(container: Any, argv: list[str], timeout: float = 60.0, user: str = "",
           environment: dict[str, str] | None = None, stdin_text: str | None = None) -> ExecResult:
    """coreutils `timeout` inside the container enforces the deadline; exit 124 means it passed."""
    cmd = ["timeout", "-k", "5", f"{timeout:g}", *argv]
    if stdin_text is not None:
        # exec_run cannot feed stdin: hand the text over as an environment variable instead.
        environment = {**(environment or {}), "GPUWARDEN_STDIN": stdin_text}
        cmd = ["timeout", "-k", "5", f"{timeout:g}", "sh", "-c",
               'printf %s "$GPUWARDEN_STDIN" | "$@"', "sh", *argv]
    res = _bounded(lambda: container.exec_run(cmd, demux=True, user=user or "root",
                                              environment=environment),
                   timeout + GRACE_S, argv)
    out, err = res.output if res.output else (b"", b"")
    return ExecResult(
        rc=res.exit_code if res.exit_code is not None else -1,
        out=(out or b"").decode(errors="replace"),
        err=(err or b"").decode(errors="replace"),
    )
