"""Root's own record of the jobs whose checkpoint directories it made on this node: what the
periodic check's tier-0 scan (`nodescan`) reads instead of listing the world-writable spool,
where any user can put a million entries.

The prolog records ``job-N`` (its uid, and when this run of it started) in
``<state_dir>/ckpt-jobs/`` (root's alone) after making the job's tier-0 directories; the epilog
forgets it when it removes them (a job that will run again keeps its record, and the next
prolog writes the new run's start). Records whose directories are gone (a reboot emptied
tier 0) are dropped by the scan. Light: the prolog imports this.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from gpuwarden.core.safefs import (
    StateDirError,
    atomic_write,
    check_private_dir,
    discard,
    ensure_private_dir,
    read_private,
)

DIR = "ckpt-jobs"
MAX_JOBS = 4096  # records read by one scan (newest job ids first)
_NAME = re.compile(r"job-([1-9][0-9]{0,11})")


@dataclass(frozen=True)
class JobHeld:
    job_id: str
    uid: int
    since: float  # when this run's prolog made the directories (epoch seconds)


def _dir(state_dir: str) -> str:
    return os.path.join(state_dir, DIR)


def record(state_dir: str, job_id: str, uid: int, now: float) -> None:
    """Raises OSError or StateDirError (the caller logs: the prolog goes on)."""
    if not _NAME.fullmatch(f"job-{job_id}"):
        raise ValueError(f"job id {job_id[:20]!r}")
    directory = _dir(state_dir)
    ensure_private_dir(state_dir)
    ensure_private_dir(directory)
    atomic_write(directory, f"job-{job_id}",
                 json.dumps({"uid": uid, "since": now}).encode(), 0o600)


def forget(state_dir: str, job_id: str) -> None:
    """Raises OSError or StateDirError."""
    if _NAME.fullmatch(f"job-{job_id}"):
        discard(_dir(state_dir), f"job-{job_id}")


def _parse(job_id: str, data: bytes | None) -> JobHeld | None:
    try:
        doc = json.loads(data or b"")
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    uid, since = doc.get("uid"), doc.get("since")
    if isinstance(uid, bool) or not isinstance(uid, int) or uid < 0 \
            or isinstance(since, bool) or not isinstance(since, int | float):
        return None
    return JobHeld(job_id, uid, float(since))


def held(state_dir: str) -> tuple[list[JobHeld], int]:
    """The jobs recorded (at most MAX_JOBS, newest ids first) and how many records were left
    out (unreadable, malformed, past the bound). Raises StateDirError when the directory is
    not root's alone."""
    directory = _dir(state_dir)
    if not check_private_dir(directory):
        return [], 0
    ids = sorted((m.group(1) for n in os.listdir(directory) if (m := _NAME.fullmatch(n))),
                 key=int, reverse=True)
    out: list[JobHeld] = []
    bad = max(0, len(ids) - MAX_JOBS)
    for job_id in ids[:MAX_JOBS]:
        try:
            got = _parse(job_id, read_private(os.path.join(directory, f"job-{job_id}")))
        except (StateDirError, OSError):
            got = None
        if got is None:
            bad += 1
        else:
            out.append(got)
    return out, bad
