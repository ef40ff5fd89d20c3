"""The end of a job's directory on the shared tier (``<shared_root>/job-N``).

The prolog makes ``job-N`` for every job, also for jobs that never checkpoint, so without
this the shared root grows by one empty directory per job. Root removes a job's directory
only when all of these hold, and otherwise leaves it as it is:

* Slurm says the job is over for good (COMPLETED, FAILED, CANCELLED, ...): never while it
  will run again (pending, requeued: the requeue needs its directory), nor when Slurm cannot
  say;
* the entry is exactly what the prolog made: a directory (not a link, nor a file), mode
  ``0700``, owned by the job's user (the epilog knows the uid; `tidy` takes any);
* it is empty. The removal is one ``rmdir`` by name relative to the spool's descriptor,
  which removes an empty directory or nothing (a link or a file is refused, a directory
  holding anything is refused atomically): a step, a restore record, the job's key, a file
  a user put there keeps the directory, and nothing is ever followed or removed inside it.

The epilog does it on each of the job's nodes (the first one wins; the others find it gone),
in a child killed after a few seconds so a hung filesystem cannot stall it. `tidy` (``gpuwarden
ckpt tidy``, root, on a timer) catches what no epilog saw: a job cancelled while requeued
(no epilog runs then), a node that died. Squatters' entries moved aside by the prolog
(``.squatted.*``) and every other name are never touched.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gpuwarden.core import safefs as safeio
from gpuwarden.core.safefs import closing
from gpuwarden.slurm.models import Job

log = logging.getLogger(__name__)

_JOB_DIR = re.compile(r"job-([0-9]{1,12})")
MAX_ENTRIES = 1_000_000  # a shared root is listed at most this far in one run
HOLDS_FILES = "kept: it holds the job's files"


def made_by_prolog(st: os.stat_result, uid: int | None) -> bool:
    """Is ``st`` (an lstat) what the prolog leaves: a directory, ``0700``, the job user's
    (``uid``; None: any user's)? Pure."""
    return (stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
            and (uid is None or st.st_uid == uid))


def remove_if_empty(shared_root: str, job_id: str, uid: int | None) -> str:
    """Remove ``<shared_root>/job-<job_id>`` when it is the prolog's and empty; what happened
    ("removed", "absent", or "kept: why")."""
    name = f"job-{job_id}"
    try:
        spool = safeio.open_spool(shared_root)
    except FileNotFoundError:
        return "absent"
    with closing(spool):
        return _remove_at(spool, name, uid)


def _remove_at(spool: int, name: str, uid: int | None) -> str:
    st = safeio.lstat_at(spool, name)
    if st is None:
        return "absent"
    if not made_by_prolog(st, uid):
        kind = "a link" if stat.S_ISLNK(st.st_mode) else \
            "not a directory" if not stat.S_ISDIR(st.st_mode) else \
            f"uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}"
        return f"kept: not the directory the prolog made ({kind})"
    try:
        # rmdir by name, relative to the spool: an empty directory or nothing. A link or file
        # swapped in since the lstat is refused (ENOTDIR), a directory with anything in it
        # too (ENOTEMPTY), atomically.
        os.rmdir(name, dir_fd=spool)
    except FileNotFoundError:
        return "absent"  # another node's epilog was first
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return HOLDS_FILES
        if exc.errno == errno.ENOTDIR:
            return "kept: replaced by something that is not a directory"
        raise
    return "removed"


@dataclass
class Tidied:
    removed: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)  # name: why (only what was looked at)


_KINDS = ((HOLDS_FILES, "holding files"), ("Slurm does not know", "jobs Slurm does not know"),
          ("job ", "jobs not over"), ("kept: not the directory", "not what the prolog made"))


def kind_of(why: str) -> str:
    """The kind of a reason `tidy` kept a directory for, to count them by. Pure."""
    return next((kind for start, kind in _KINDS if why.startswith(start)), "other")


def finished(job: Job) -> bool:
    from gpuwarden.ckpt.jobdirs import will_run_again  # noqa: PLC0415 - no import cycle

    return will_run_again(job) is False


def tidy(shared_root: str, jobs: Callable[[], Iterable[Job]]) -> Tidied:
    """Remove every ``job-N`` of the shared root that the prolog made, that is empty, and
    whose job is over: Slurm says so, or Slurm no longer knows the job and its id is below the
    newest id Slurm knows (ids are given in order, so that one was given; a job pending or
    running is always known; one that finished is forgotten after MinJobAge). A larger id
    (not given yet: someone made the directory ahead) and, while Slurm knows no job at all,
    every unknown one are kept.
    ``jobs`` is asked once, and only when a candidate is found. One shared root per cluster:
    another cluster's job ids mean other jobs."""
    out = Tidied()
    with closing(safeio.open_spool(shared_root)) as spool:
        candidates = _candidates(spool)
        if not candidates:
            return out
        known = {j.job_id: j for j in jobs()}
        newest = max(known, default=None)
        for job_id, name in candidates:
            job = known.get(job_id)
            if job is not None:
                if not finished(job):
                    out.kept[name] = f"job {job_id} is {'+'.join(job.state) or 'in no state'}"
                    continue
            elif newest is None or job_id > newest:
                out.kept[name] = f"Slurm does not know job {job_id}: cannot tell it is over"
                continue
            try:
                what = _remove_at(spool, name, None)
            except OSError as exc:
                out.kept[name] = f"kept: cannot remove it ({exc.strerror or exc})"
                continue
            if what == "removed":
                out.removed.append(name)
            elif what != "absent":
                out.kept[name] = what
    return out


def _candidates(spool: int) -> list[tuple[int, str]]:
    """The spool's ``job-N`` entries shaped as the prolog leaves them, by job id."""
    found = []
    with os.scandir(spool) as entries:
        for n, e in enumerate(entries):
            if n >= MAX_ENTRIES:
                log.warning("checkpoint shared tier: more than %d entries: looking at the "
                            "first %d only this time", MAX_ENTRIES, MAX_ENTRIES)
                break
            m = _JOB_DIR.fullmatch(e.name)
            if m is None:
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if made_by_prolog(st, None):
                found.append((int(m.group(1)), e.name))
    return sorted(found)
