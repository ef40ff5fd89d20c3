"""What this node's tier 0 holds, as root sees it: the periodic check's checkpoint series
(`gpuwarden_ckpt.prom`: bytes and steps held, the newest save, how far the shared tier is
behind).

Everything is read from the filesystem by root, never from what a job says about itself:
space from ``lstat`` of the step directories' files (allocated blocks, each inode once: a
sparse or hard-linked file counts what it really holds), times from the step directories'
``ctime`` (the kernel sets it at the rename that commits a step; a user can move it to now,
never into the past), each rank's newest durable step from the shared tier's listing.
Directories are opened by descriptor, never through a link, and only when they are the job
directory owner's (`safefs.open_dir`); anything else is skipped and counted.

The work is bounded, and fairly: spool entries are read at most `MAX_SPOOL` at a time, and
each owner of job directories gets an equal share of `MAX_ENTRIES` for what is below them,
so one user's thousands of directories cannot hide another's job. A scan that runs out of
its share or of `time_s` says so (`complete` False) and reports what it read.

A rank's durable lag is how long it has been saving without the shared tier keeping up: the
commit time of its newest tier-0 step less that of its newest step on the shared tier, when
tier 0 holds a newer one (else 0). It grows only while the job saves: in an outage it is the
outage's length (tier 0's retention pruning older steps does not hide it), and a job that
ended with steps not yet durable (its tier 0 kept for a requeue) keeps the lag it had, not a
growing one. With nothing durable yet, the job's directory on the shared tier (made by the
prolog when the job started) stands for the last write-back. Without a shared tier
(`shared_root` empty: S3 is the only durable tier, which root cannot list), or when root
cannot read a rank's shared directory (an NFS server squashing root), that rank has no lag.
Lags are kept per user bucket (uid mod `BUCKETS`): the alert tells one user's jobs (their own
business) from many users' (the shared tier is failing), without naming anyone.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from gpuwarden.ckpt.names import PEER_SUFFIX, parse_step_dir
from gpuwarden.core import safefs as safeio
from gpuwarden.core.safefs import Refused, closing

MANIFEST = "MANIFEST.json"  # gpuwarden.ckpt.tier.MANIFEST (not imported: it loads numpy)
MAX_SPOOL = 1_000_000  # spool entries looked at
MAX_ENTRIES = 200_000  # entries below the job directories, shared equally by their owners
TIME_S = 3.0  # the scan stops here, reporting what it read (the caller's deadline is later)
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
    skipped: int = 0  # entries not read: another's, a link, past a bound
    complete: bool = True  # False: a bound or the time ran out, the rest not read

    def as_dict(self) -> dict[str, object]:
        return {"bytes": self.bytes, "steps": self.steps, "newest_save": self.newest_save,
                "lag": dict(self.lag), "skipped": self.skipped, "complete": self.complete}

    @staticmethod
    def from_dict(doc: dict[str, object]) -> Held:
        lag = doc.get("lag")
        return Held(int(str(doc.get("bytes", 0))), int(str(doc.get("steps", 0))),
                    float(str(doc.get("newest_save", 0.0))),
                    {str(k): float(v) for k, v in lag.items()} if isinstance(lag, dict) else {},
                    int(str(doc.get("skipped", 0))), doc.get("complete") is True)


class _Budget:
    """Entries one owner may still read, and the scan's clock; what is left unread counts as
    skipped and makes the scan incomplete."""

    def __init__(self, entries: int, held: Held, until: float,
                 mono: Callable[[], float]) -> None:
        self.left, self.held, self.until, self.mono = entries, held, until, mono

    def names(self, fd: int) -> Iterator[str]:
        """The entries of the directory ``fd``, read as they are needed: the bound limits the
        work, not only what is counted."""
        with os.scandir(fd) as it:
            for entry in it:
                if self.left <= 0 or self.mono() > self.until:
                    self.held.skipped += 1
                    self.held.complete = False
                    return
                self.left -= 1
                yield entry.name


@dataclass(frozen=True)
class _Step:
    number: int
    ctime: float


def _steps(rank_fd: int, owner: int, where: str, budget: _Budget, held: Held,
           seen: set[tuple[int, int]] | None) -> Iterator[_Step]:
    """The rank's complete steps (a manifest in them), the owner's, not through a link; with
    ``seen``, their files' allocated bytes are added to ``held`` (each inode once)."""
    # A step being written (a temp name) or anything else is not held yet.
    for name, fd, st in _subdirs(rank_fd, owner, where, budget, held,
                                 lambda n: parse_step_dir(n) is not None):
        size, complete = 0, False
        for entry in budget.names(fd):
            est = safeio.lstat_at(fd, entry)
            if est is None or not stat.S_ISREG(est.st_mode) or est.st_uid != owner:
                continue
            complete = complete or entry == MANIFEST
            if seen is not None and (est.st_dev, est.st_ino) not in seen:
                seen.add((est.st_dev, est.st_ino))
                size += est.st_blocks * 512
        if complete:
            held.bytes += size
            yield _Step(parse_step_dir(name) or 0, st.st_ctime)


def _subdirs(fd: int, owner: int, where: str, budget: _Budget, held: Held,
             wanted: Callable[[str], bool]) -> Iterator[tuple[str, int, os.stat_result]]:
    """The ``wanted`` subdirectories of ``fd``, each opened (the owner's, not through a link)
    while the caller looks at it; the others that cannot be opened are counted as skipped."""
    for name in list(budget.names(fd)):
        if not wanted(name):
            continue
        try:
            sub, st = safeio.open_dir(fd, name, owner, f"{where}/{name}")
        except (Refused, OSError):
            held.skipped += 1
            continue
        with closing(sub):
            yield name, sub, st


class _Shared:
    """The shared tier, its spool opened once (Refused or OSError when it cannot be)."""

    def __init__(self, root: str) -> None:
        self.root, self.fd = root, safeio.open_spool(root)

    def since(self, job: str, rank: str, owner: int, budget: _Budget, held: Held
              ) -> tuple[int, float] | None:
        """(the rank's newest durable step, or -1 for none, and when it was committed, or the
        job's shared directory was made); None when root cannot tell (no such directory,
        another's, unreadable)."""
        try:
            jfd, jst = safeio.open_dir(self.fd, job, owner, f"{self.root}/{job}")
        except (Refused, OSError):
            return None
        with closing(jfd):
            try:
                rfd, _ = safeio.open_dir(jfd, rank, owner, f"{self.root}/{job}/{rank}")
            except FileNotFoundError:
                return -1, jst.st_ctime
            except (Refused, OSError):
                return None
            with closing(rfd):
                try:
                    newest = max(_steps(rfd, owner, f"{self.root}/{job}/{rank}", budget, held,
                                        None), key=lambda s: s.number, default=None)
                except OSError:
                    return None  # a stale handle, a directory going away: not knowable now
        return (-1, jst.st_ctime) if newest is None else (newest.number, newest.ctime)


def _owners(spool: int, budget: _Budget, held: Held) -> dict[int, list[str]]:
    """The spool's job directories (own and peers') by owner."""
    out: dict[int, list[str]] = {}
    for name in budget.names(spool):
        job = name.removesuffix(PEER_SUFFIX)
        if not _JOB.fullmatch(job):
            held.skipped += not name.startswith(".squatted.")  # a squatter's, moved aside
            continue
        st = safeio.lstat_at(spool, name)
        if st is None or not stat.S_ISDIR(st.st_mode):
            held.skipped += st is not None
            continue
        out.setdefault(st.st_uid, []).append(name)
    return out


def scan(memory_root: str, shared_root: str, max_entries: int = MAX_ENTRIES,
         time_s: float = TIME_S, mono: Callable[[], float] = time.monotonic) -> Held:
    """The node's tier 0 under ``memory_root`` (own ranks' steps and peers' replicas) and, with
    ``shared_root``, each own rank's durable lag. A spool that is not there holds nothing.
    Raises Refused or OSError when the spool itself cannot be read."""
    held = Held()
    until = mono() + time_s
    try:
        spool = safeio.open_spool(memory_root)
    except FileNotFoundError:
        return held
    with closing(spool):
        owners = _owners(spool, _Budget(MAX_SPOOL, held, until, mono), held)
        shared = None
        if shared_root:
            try:
                shared = _Shared(shared_root)
            except (Refused, OSError):
                held.skipped += 1  # no lag anywhere: root cannot list the shared tier
        try:
            seen: set[tuple[int, int]] = set()
            share = max_entries // max(1, len(owners))
            for owner, names in owners.items():
                budget = _Budget(share, held, until, mono)
                for name in names:
                    _job(spool, name, owner, memory_root, budget, held, seen, shared)
        finally:
            if shared is not None:
                os.close(shared.fd)
    return held


def _job(spool: int, name: str, owner: int, memory_root: str, budget: _Budget, held: Held,
         seen: set[tuple[int, int]], shared: _Shared | None) -> None:
    where = f"{memory_root}/{name}"
    try:
        fd, _ = safeio.open_dir(spool, name, owner, where)
    except (Refused, OSError):
        held.skipped += 1
        return
    with closing(fd):
        for rank, rfd, _ in _subdirs(fd, owner, where, budget, held,
                                     lambda n: bool(_RANK.fullmatch(n))):
            steps = list(_steps(rfd, owner, f"{where}/{rank}", budget, held, seen))
            if not steps:
                continue
            held.steps += len(steps)
            newest = max(steps, key=lambda s: s.number)
            held.newest_save = max(held.newest_save, *(s.ctime for s in steps))
            if shared is not None and not name.endswith(PEER_SUFFIX):
                since = shared.since(name, rank, owner, budget, held)
                if since is not None:
                    durable, at = since
                    lag = max(0.0, newest.ctime - at) if newest.number > durable else 0.0
                    bucket = str(owner % BUCKETS)
                    held.lag[bucket] = max(held.lag.get(bucket, 0.0), lag)
