"""Running Slurm's commands: argument lists, never a shell, always a timeout."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gpuwarden.core.errors import SlurmError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


class CommandTimeoutError(SlurmError):
    def __init__(self, argv: Sequence[str], timeout: float) -> None:
        self.argv = tuple(argv)
        self.timeout = timeout
        super().__init__(f"`{' '.join(argv)}` did not answer within {timeout:g} s")


class CommandRunner(Protocol):
    def run(self, argv: Sequence[str], timeout: float) -> CommandResult: ...


class DeadlineRunner:
    """Wraps a runner so that every command ends by one absolute deadline (time.monotonic()).

    Used on the job-start path: however many Slurm calls a prolog makes, together they cannot
    outlast its budget.
    """

    def __init__(self, inner: CommandRunner, end: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._inner = inner
        self._end = end
        self._clock = clock

    def run(self, argv: Sequence[str], timeout: float) -> CommandResult:
        left = self._end - self._clock()
        if left <= 0.05:
            raise CommandTimeoutError(argv, 0)
        return self._inner.run(argv, min(timeout, left))


# Times without a zone (sacctmgr's columns, sacct's --starttime) mean UTC, whatever the host's
# zone, daylight saving or the user's SLURM_TIME_FORMAT: one reading everywhere.
SLURM_ENV = {**os.environ, "TZ": "UTC", "SLURM_TIME_FORMAT": "standard"}


class SubprocessRunner:
    """The real runner: subprocess with a hard timeout (the child is killed when it passes).

    ``bin_dir``: called once, at the first command named without a directory, for the
    directory to run it from (see gpuwarden.slurm.bindir); None leaves the lookup to PATH.
    Resolving late keeps it off the path of an entry point that never calls Slurm.
    """

    def __init__(self, bin_dir: Callable[[], str] | None = None) -> None:
        self._bin_dir = bin_dir
        self._resolved: str | None = None

    def _absolute(self, argv: Sequence[str]) -> list[str]:
        if self._bin_dir is None or "/" in argv[0]:
            return list(argv)
        if self._resolved is None:
            self._resolved = self._bin_dir()
        return [os.path.join(self._resolved, argv[0]), *argv[1:]]

    def run(self, argv: Sequence[str], timeout: float) -> CommandResult:
        argv = self._absolute(argv)
        log.debug("running %s (timeout %g s)", argv, timeout)
        try:
            proc = subprocess.run(
                list(argv),
                capture_output=True,
                # Users choose bytes in job names, comments and paths, and Slurm prints them
                # as they are: one invalid byte must not fail every reader of the output.
                encoding="utf-8",
                errors="replace",
                timeout=timeout,
                check=False,
                stdin=subprocess.DEVNULL,
                env=SLURM_ENV,
            )
        except subprocess.TimeoutExpired:
            raise CommandTimeoutError(argv, timeout) from None
        except FileNotFoundError:
            raise SlurmError(
                f"{argv[0]} not found: install Slurm's client commands on this host "
                "or set [slurm] bin_dir in the gpuwarden config"
            ) from None
        except OSError as exc:
            raise SlurmError(f"cannot run {argv[0]}: {exc}") from None
        return CommandResult(tuple(argv), proc.returncode, proc.stdout, proc.stderr)
