"""What the launcher tells others: the lost nodes into the job's own record, and every
event as a JSON line (for the log, and for whoever measures recovery times).

The launcher runs as the job's user and never drains a node: a user must not be able to take
nodes out of service. It writes what it saw into its own job's Comment, which the job's owner
may set (`scontrol update JobId=N Comment=...`); health gating's epilog, as root, reads it
back as a hint to run every check on that node, never as a drain by itself (the user
writes it): see gpuwarden.slurm.lostnote and hooks.entry.epilog_gate.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from gpuwarden.core.errors import SlurmError
from gpuwarden.launch.decide import Lost
from gpuwarden.slurm import lostnote
from gpuwarden.slurm.runner import CommandRunner

log = logging.getLogger(__name__)

COMMENT_PREFIX = lostnote.PREFIX
_SHOWN_COMMENT = re.compile(r"^\s*Comment=(.*)$", re.MULTILINE)


class Reporter(Protocol):
    def lost(self, lost: Sequence[Lost]) -> None: ...


def comment(lost_so_far: Sequence[Lost]) -> str:
    """``gpuwarden-launch: lost c3 (rank 1: no heartbeat ...); c7 (...)`` (lostnote). Pure."""
    return lostnote.format_lost([(x.node, x.rank, x.why) for x in lost_so_far])


def ours(current: str | None) -> bool:
    """True when the job's Comment is empty or one gpuwarden wrote: it may be replaced."""
    return lostnote.replaceable(current)


class JobComment:
    """The real reporter: the job's own Comment, rewritten with every loss so far, unless the
    user set a comment of their own (then the loss is only logged)."""

    def __init__(self, job_id: str, runner: CommandRunner, scontrol: str = "scontrol") -> None:
        self.job_id, self.runner, self.scontrol = job_id, runner, scontrol
        self.so_far: list[Lost] = []

    def current(self) -> str | None:
        """The job's Comment now; None when it has none. SlurmError when it cannot be read."""
        res = self.runner.run([self.scontrol, "show", "job", self.job_id], 10.0)
        if res.returncode != 0:
            raise SlurmError(res.stderr.strip()[:300] or f"scontrol exited {res.returncode}")
        m = _SHOWN_COMMENT.search(res.stdout)
        return m.group(1).strip() if m else None

    def lost(self, lost: Sequence[Lost]) -> None:
        self.so_far.extend(lost)
        text = comment(self.so_far)
        try:
            now = self.current()
        except (SlurmError, OSError) as exc:
            log.warning("%s; not written: the job's comment could not be read (%s)", text, exc)
            return
        if not ours(now):
            log.warning("%s; not written: job %s has a comment of its own", text, self.job_id)
            return
        argv = [self.scontrol, "update", f"JobId={self.job_id}",
                f"Comment={text}"]
        try:
            res = self.runner.run(argv, 10.0)
        except (SlurmError, OSError) as exc:
            log.warning("could not record the lost node in job %s: %s", self.job_id, exc)
            return
        if res.returncode != 0:
            log.warning("could not record the lost node in job %s: %s", self.job_id,
                        res.stderr.strip()[:300])


@dataclass
class Recorded:
    """A fake reporter: what would have been written."""

    so_far: list[Lost] = field(default_factory=list)

    def lost(self, lost: Sequence[Lost]) -> None:
        self.so_far.extend(lost)


class Events:
    """Each event as one JSON line with the wall time (``t``) and the launcher's monotonic
    time (``mono``), to ``out`` when given, and kept in ``seen`` (tests, a demo)."""

    def __init__(self, out: IO[str] | None = None) -> None:
        self.out = out
        self.seen: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._failed = False

    def __call__(self, event: str, **fields: Any) -> None:
        rec = {"t": round(time.time(), 3), "mono": round(time.monotonic(), 3), "event": event,
               **fields}
        line = json.dumps(rec, default=str)
        log.info("%s", line)
        with self._lock:
            self.seen.append(rec)
            if self.out is not None and not self._failed:
                try:
                    self.out.write(line + "\n")
                    self.out.flush()
                except (OSError, ValueError) as exc:  # a full disk never stops the launcher
                    self._failed = True
                    log.error("events file: %s; no more events are written there", exc)

    def named(self, event: str) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.seen if e["event"] == event]
