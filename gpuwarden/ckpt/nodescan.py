"""What this node's tier 0 holds, as root sees it: the periodic check's checkpoint series
(`gpuwarden_ckpt.prom`: bytes and steps held, the newest save, how far the shared tier is
behind).

Which jobs to look at comes from root's own record (`jobsheld`: the prolog notes each job whose
directories it made here), never from listing the world-writable spool, where anyone can put
a million entries. Everything else is read from the filesystem by root, never from what a job
says about itself: space from ``lstat`` of the step directories' files (allocated blocks, each
inode once: a sparse or hard-linked file counts what it really holds), times from the step
directories' ``ctime`` (the kernel sets it at the rename that commits a step; a user can move
it to now, never into the past), each rank's newest durable step from the shared tier (one look
for the manifest per step, newest first). Directories are opened by descriptor, never through
a link, and only when they are the job's user's (`safefs.open_dir`); anything else is skipped
and counted.

The work is bounded, and fairly: each owner of jobs on the node gets an equal share of
`MAX_ENTRIES` entries and of the time left (`TIME_S` in all) when its turn comes, so one user's
huge directories cannot hide another's job; what an owner's share leaves unread is counted as
skipped. `complete` is False only when the scan as a whole fell short (the shared tier refused
to root, an owner not reached in time), never for one owner's excess.

A rank's durable lag is how long it has kept saving without the shared tier keeping up: the
commit time of its newest tier-0 step less the later of its newest durable step's and this
run's start (the prolog's record), when tier 0 holds a newer step (else 0). It grows only while
the job saves: in an outage it is the outage's length (tier 0's retention pruning older steps
does not hide it), a job that ended keeps the lag it had, a requeued job is measured from its
new start. A shared tier or job directory that is gone or failing counts as nothing durable
(the lag then runs from the run's start); one root may not read (an NFS server squashing root)
gives that rank no lag. Without a shared tier (`shared_root` empty: S3 is the only durable
tier, which root cannot list) there is no lag to report. Lags are kept per user bucket (uid
mod `BUCKETS`): the alert tells one user's jobs (their own business) from many users' (the
shared tier is failing), without naming anyone.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from gpuwarden.ckpt import jobsheld
from gpuwarden.ckpt.jobsheld import JobHeld
from gpuwarden.ckpt.names import PEER_SUFFIX, parse_step_dir
from gpuwarden.core import safefs as safeio
from gpuwarden.core.safefs import Refused, StateDirError, closing

MANIFEST = "MANIFEST.json"  # gpuwarden.ckpt.tier.MANIFEST (not imported: it loads numpy)
MAX_ENTRIES = 200_000  # entries below the job directories, shared equally by their owners
TIME_S = 3.0  # the scan stops here, reporting what it read (the caller's deadline is later)
BUCKETS = 8
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

    def spent(self) -> bool:
        return self.left <= 0 or self.mono() > self.until

    def names(self, fd: int) -> Iterator[str]:
        """The entries of the directory ``fd``, read as they are needed: the bound limits the
        work, not only what is counted."""
        with os.scandir(fd) as it:
            for entry in it:
                if self.spent():
                    self.held.skipped += 1  # this directory's rest: the owner's share is used
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
    """The shared tier, its spool opened once. ``fd`` None: not there (a mount gone), so no
    rank has a durable step root can see."""

    def __init__(self, root: str) -> None:
        self.root = root
        try:
            self.fd: int | None = safeio.open_spool(root)
        except FileNotFoundError:
            self.fd = None

    def since(self, job: str, rank: str, owner: int, budget: _Budget, run_start: float
              ) -> tuple[int, float] | None:
        """(the rank's newest durable step, -1 for none, and the time the lag runs from: when
        that step was committed, or this run started if later); None when root may not look
        (a directory refused to root: an NFS server squashing root, or not the owner's)."""
        try:
            newest = self._newest(job, rank, owner, budget)
        except (Refused, PermissionError):
            return None
        except OSError:
            newest = None  # gone or failing: nothing reached it that root can see
        if newest is None:
            return -1, run_start
        return newest.number, max(newest.ctime, run_start)

    def _newest(self, job: str, rank: str, owner: int, budget: _Budget) -> _Step | None:
        if self.fd is None:
            return None
        jfd, _ = safeio.open_dir(self.fd, job, owner, f"{self.root}/{job}")
        with closing(jfd):
            rfd, _ = safeio.open_dir(jfd, rank, owner, f"{self.root}/{job}/{rank}")
            with closing(rfd):
                return _newest_complete(rfd, owner, budget)


def _newest_complete(rank_fd: int, owner: int, budget: _Budget) -> _Step | None:
    """The newest step with its manifest (the owner's regular file), newest first: one look
    into each step directory until one is complete, not a listing of every shard."""
    try:
        numbered = sorted(((n, name) for name in budget.names(rank_fd)
                           if (n := parse_step_dir(name)) is not None), reverse=True)
    except OSError:
        return None
    for number, name in numbered:
        if budget.spent():
            return None
        try:
            fd, st = safeio.open_dir(rank_fd, name, owner, name)
        except (Refused, OSError):
            continue
        with closing(fd):
            mst = safeio.lstat_at(fd, MANIFEST)
        if mst is not None and stat.S_ISREG(mst.st_mode) and mst.st_uid == owner:
            return _Step(number, st.st_ctime)
    return None


def scan(memory_root: str, shared_root: str, state_dir: str, max_entries: int = MAX_ENTRIES,
         time_s: float = TIME_S, mono: Callable[[], float] = time.monotonic) -> Held:
    """The tier-0 directories of the jobs root's prolog made on this node (`jobsheld`, never
    the spool's listing), their own ranks' steps and peers' replicas, and with ``shared_root``
    each own rank's durable lag. Each owner of jobs gets an equal share of ``max_entries`` and
    of the time left when its turn comes. Raises Refused or OSError when the spool itself
    cannot be read, StateDirError when root's record cannot."""
    held = Held()
    until = mono() + time_s
    jobs, bad = jobsheld.held(state_dir)
    held.skipped += bad
    try:
        spool = safeio.open_spool(memory_root)
    except FileNotFoundError:
        return held
    with closing(spool):
        owners: dict[int, list[JobHeld]] = {}
        for j in jobs:
            owners.setdefault(j.uid, []).append(j)
        shared = None
        if shared_root:
            try:
                shared = _Shared(shared_root)
            except (Refused, OSError):
                held.skipped += 1  # no lag anywhere: root may not list the shared tier
                held.complete = False
        try:
            seen: set[tuple[int, int]] = set()
            share = max_entries // max(1, len(owners))
            for i, (owner, owned) in enumerate(owners.items()):
                now = mono()
                if now > until:
                    held.complete = False  # an owner not reached at all
                    break
                # What is left of the time, shared by the owners still to come.
                budget = _Budget(share, held, now + (until - now) / (len(owners) - i), mono)
                for j in owned:
                    _job(spool, j, owner, memory_root, budget, held, seen, shared, state_dir)
        finally:
            if shared is not None and shared.fd is not None:
                os.close(shared.fd)
    return held


def _job(spool: int, j: JobHeld, owner: int, memory_root: str, budget: _Budget, held: Held,
         seen: set[tuple[int, int]], shared: _Shared | None, state_dir: str) -> None:
    job = f"job-{j.job_id}"
    present = 0
    for name in (job, job + PEER_SUFFIX):
        st = safeio.lstat_at(spool, name)
        if st is None:
            continue
        present += 1
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != owner:
            held.skipped += 1  # not what the prolog made: another's, a link
            continue
        try:
            _namespace(spool, name, j.since, owner, memory_root, budget, held, seen, shared)
        except (Refused, OSError):
            held.skipped += 1  # changing under the scan (the job's own doing): this one only
    if not present:
        with contextlib.suppress(StateDirError, OSError):
            jobsheld.forget(state_dir, j.job_id)  # its directories are gone (a reboot)


def _namespace(spool: int, name: str, run_start: float, owner: int, memory_root: str,
               budget: _Budget, held: Held, seen: set[tuple[int, int]],
               shared: _Shared | None) -> None:
    where = f"{memory_root}/{name}"
    fd, _ = safeio.open_dir(spool, name, owner, where)
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
                since = shared.since(name, rank, owner, budget, run_start)
                if since is not None:
                    durable, ref = since
                    lag = max(0.0, newest.ctime - ref) if newest.number > durable else 0.0
                    bucket = str(owner % BUCKETS)
                    held.lag[bucket] = max(held.lag.get(bucket, 0.0), lag)
