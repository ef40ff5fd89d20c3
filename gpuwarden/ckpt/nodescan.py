"""What this node's tier 0 holds, as root sees it: the periodic check's checkpoint series
(`gpuwarden_ckpt.prom`: bytes and steps held, the newest save, how long steps have waited
for the durable tier).

Everything is read from the filesystem by root, never from what a job says about itself:
sizes and step counts from ``lstat`` of the step directories' entries, times from their
``ctime`` (the kernel sets it at the rename that commits a step; a user can move it to now,
never into the past), the durable tier's newest step of each rank from the shared tier's
listing. Directories are opened by descriptor from the spool, never through a link, and
only when they are the job directory owner's (`safefs.open_dir`); anything else is skipped
and counted. The scan is bounded (`MAX_ENTRIES`) and the caller runs it in a child killed at
a deadline (the shared filesystem may hang).

A rank's durable lag is the age of its oldest tier-0 step newer than every step of that
rank on the shared tier (0 when the shared tier has caught up): a step held only in this
node's memory for that long is lost with the node. Without a shared tier (`shared_root`
empty: S3 is the only durable tier, which root cannot list) there is no lag to report.
Lags are kept per user bucket (uid mod `BUCKETS`): the alert tells one user's jobs (their
own business, perhaps on purpose) from many users' (the durable tier is failing), without
naming anyone.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field

from gpuwarden.ckpt.names import PEER_SUFFIX, parse_step_dir
from gpuwarden.ckpt.tier import MANIFEST
from gpuwarden.core import safefs as safeio
from gpuwarden.core.safefs import Refused, closing

MAX_ENTRIES = 200_000  # directory entries looked at in one scan: past it, the rest is skipped
BUCKETS = 8
_JOB = re.compile(r"job-[1-9][0-9]{0,11}")
_RANK = re.compile(r"rank-[0-9]{5}")


@dataclass
class Held:
    """One scan's figures (JSON-able through `as_dict`/`from_dict`: it crosses a pipe)."""

    bytes: int = 0
    steps: int = 0
    newest_save: float = 0.0  # ctime of the newest step (0: none)
    lag: dict[str, float] = field(default_factory=dict)  # user bucket -> seconds
    skipped: int = 0  # entries not read: not the owner's, a link, odd, past MAX_ENTRIES

    def as_dict(self) -> dict[str, object]:
        return {"bytes": self.bytes, "steps": self.steps, "newest_save": self.newest_save,
                "lag": dict(self.lag), "skipped": self.skipped}

    @staticmethod
    def from_dict(doc: dict[str, object]) -> Held:
        lag = doc.get("lag")
        return Held(int(str(doc.get("bytes", 0))), int(str(doc.get("steps", 0))),
                    float(str(doc.get("newest_save", 0.0))),
                    {str(k): float(v) for k, v in lag.items()} if isinstance(lag, dict) else {},
                    int(str(doc.get("skipped", 0))))


class _Budget:
    """Entries left to look at; those past the bound are counted as skipped."""

    def __init__(self, entries: int, held: Held) -> None:
        self.left, self.held = entries, held

    def names(self, fd: int) -> list[str]:
        names = os.listdir(fd)
        if len(names) > self.left:
            self.held.skipped += len(names) - self.left
            names = names[:self.left]
        self.left -= len(names)
        return names


@dataclass(frozen=True)
class _Step:
    number: int
    ctime: float
    bytes: int


def _steps(rank_fd: int, owner: int, where: str, budget: _Budget, held: Held
           ) -> Iterator[_Step]:
    """The rank's complete steps (a manifest in them), the owner's, not through a link."""
    for name in budget.names(rank_fd):
        number = parse_step_dir(name)
        if number is None:
            continue  # a step being written (a temp name) or anything else: not held yet
        try:
            fd, st = safeio.open_dir(rank_fd, name, owner, f"{where}/{name}")
        except (Refused, OSError):
            held.skipped += 1
            continue
        with closing(fd):
            size, complete = 0, False
            for entry in budget.names(fd):
                est = safeio.lstat_at(fd, entry)
                if est is None or not stat.S_ISREG(est.st_mode) or est.st_uid != owner:
                    continue
                size += est.st_size
                complete = complete or entry == MANIFEST
        if complete:
            yield _Step(number, st.st_ctime, size)


def _ranks(job_fd: int, owner: int, where: str, budget: _Budget, held: Held
           ) -> Iterator[tuple[str, list[_Step]]]:
    for name in budget.names(job_fd):
        if not _RANK.fullmatch(name):
            continue
        try:
            fd, _ = safeio.open_dir(job_fd, name, owner, f"{where}/{name}")
        except (Refused, OSError):
            held.skipped += 1
            continue
        with closing(fd):
            yield name, list(_steps(fd, owner, f"{where}/{name}", budget, held))


def _durable_newest(shared_root: str, job: str, rank: str, owner: int, budget: _Budget,
                    held: Held) -> int | None:
    """The newest complete step of ``job``/``rank`` on the shared tier (None: none)."""
    try:
        fd = safeio.walk(shared_root, (job, rank), owner)
    except FileNotFoundError:
        return None
    except (Refused, OSError):
        held.skipped += 1
        return None
    with closing(fd):
        return max((s.number for s in _steps(fd, owner, f"{shared_root}/{job}/{rank}",
                                             budget, held)), default=None)


def scan(memory_root: str, shared_root: str, now: float,
         max_entries: int = MAX_ENTRIES) -> Held:
    """The node's tier 0 under ``memory_root`` (own ranks' steps and peers' replicas) and, with
    ``shared_root``, each own rank's durable lag at ``now``. A spool that is not there holds
    nothing. Raises Refused or OSError when the spool itself cannot be read."""
    held = Held()
    budget = _Budget(max_entries, held)
    try:
        spool = safeio.open_spool(memory_root)
    except FileNotFoundError:
        return held
    with closing(spool):
        for name in budget.names(spool):
            job = name[:-len(PEER_SUFFIX)] if name.endswith(PEER_SUFFIX) else name
            if not _JOB.fullmatch(job):
                continue  # a squatter's entry moved aside, anything else: not a job's
            st = safeio.lstat_at(spool, name)
            if st is None or not stat.S_ISDIR(st.st_mode):
                held.skipped += st is not None
                continue
            owner = st.st_uid
            try:
                fd, _ = safeio.open_dir(spool, name, owner, f"{memory_root}/{name}")
            except (Refused, OSError):
                held.skipped += 1
                continue
            with closing(fd):
                for rank, steps in _ranks(fd, owner, f"{memory_root}/{name}", budget, held):
                    _add(held, steps)
                    if shared_root and name == job and steps:
                        durable = _durable_newest(shared_root, job, rank, owner, budget, held)
                        _lag(held, steps, durable, owner, now)
    return held


def _add(held: Held, steps: list[_Step]) -> None:
    held.steps += len(steps)
    held.bytes += sum(s.bytes for s in steps)
    held.newest_save = max([held.newest_save, *(s.ctime for s in steps)])


def _lag(held: Held, steps: list[_Step], durable: int | None, owner: int, now: float) -> None:
    waiting = [s.ctime for s in steps if durable is None or s.number > durable]
    lag = max(0.0, now - min(waiting)) if waiting else 0.0
    bucket = str(owner % BUCKETS)
    held.lag[bucket] = max(held.lag.get(bucket, 0.0), lag)
