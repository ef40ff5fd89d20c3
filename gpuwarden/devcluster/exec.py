"""Run a command in a container with a hard deadline (docker's exec API has none of its own)."""

from __future__ import annotations

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


def run_in(container: Any, argv: list[str], timeout: float = 60.0, user: str = "",
           environment: dict[str, str] | None = None, stdin_text: str | None = None) -> ExecResult:
    """coreutils `timeout` inside the container enforces the deadline; exit 124 means it passed."""
    cmd = ["timeout", "-k", "5", f"{timeout:g}", *argv]
    if stdin_text is not None:
        # exec_run cannot feed stdin: hand the text over as an environment variable instead.
        environment = {**(environment or {}), "GPUWARDEN_STDIN": stdin_text}
        cmd = ["timeout", "-k", "5", f"{timeout:g}", "sh", "-c",
               'printf %s "$GPUWARDEN_STDIN" | "$@"', "sh", *argv]
    res = container.exec_run(cmd, demux=True, user=user or "root", environment=environment)
    out, err = res.output if res.output else (b"", b"")
    return ExecResult(
        rc=res.exit_code if res.exit_code is not None else -1,
        out=(out or b"").decode(errors="replace"),
        err=(err or b"").decode(errors="replace"),
    )
