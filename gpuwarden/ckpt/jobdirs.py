"""Root's part of each job's tier-0 directories: the prolog makes them, the epilog removes them.

The tier-0 spool (``/dev/shm/gpuwarden-ckpt``) is world-writable and job ids are sequential, so
any user could create ``job-N`` before job N starts; the job would then refuse it (it is not its
user's) and fail. So the prolog, as root, before the job:

* creates ``job-N`` and ``job-N.peer``, ``0700``, owned by the job's user;
* moves anything else already under those names (another user's directory, a link, a file) aside
  to ``.squatted.<name>.<uid>.<ns>`` in the spool, and logs it. Only names of the starting job
  are touched.

The epilog, as root, after the job: when Slurm says the job is finished for good, it removes
``job-N``, ``job-N.peer`` and that job's ``.squatted.*`` entries, and the job's directory on
the shared tier when the prolog made it and the job left it empty (`sharedspool`); when the job will run again
(pending or requeued, ``scontrol show job`` state PENDING, REQUEUED, REQUEUE_HOLD,
SPECIAL_EXIT...) or Slurm cannot say, it keeps the job's directories (a requeue onto this node
restores from them; a single-node job may have no other tier) and logs why. Nothing is ever
followed through a link nor removed outside the spool (`safeio`). Neither ever raises: a
problem is logged and the job goes on (the job then refuses an unfit directory itself).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Mapping
from contextlib import suppress
from typing import TYPE_CHECKING, Protocol

from gpuwarden.ckpt.names import PEER_SUFFIX
from gpuwarden.core import safefs as safeio
from gpuwarden.core.errors import GpuwardenError
from gpuwarden.core.safefs import closing
from gpuwarden.slurm import jobenv

if TYPE_CHECKING:
    from gpuwarden.config import Config
    from gpuwarden.slurm.models import Job

log = logging.getLogger(__name__)

# A job in any of these states (or with any of these flags) will run again: keep its tier 0.
WILL_RUN = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "REQUEUE_CRON",
                      "SPECIAL_EXIT", "RUNNING", "SUSPENDED", "CONFIGURING", "RESIZING",
                      "STAGE_OUT", "SIGNALING", "RESV_DEL_HOLD"})
# ...and in these, with none of the above, it is over.
FINISHED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                      "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"})
SQUATTED = ".squatted."
# What `claim` did: made the directory after moving another's entry aside (counted: metrics).
MOVED = "created (another's entry moved aside)"


class JobDirError(GpuwardenError):
    """The environment does not name a job and its user."""


class JobSource(Protocol):
    def job(self, job_id: int) -> Job: ...


def _ids(environ: Mapping[str, str]) -> tuple[str, int, int]:
    return jobenv.job_ids(environ, JobDirError)


def names(job_id: str) -> tuple[str, str]:
    return f"job-{job_id}", f"job-{job_id}{PEER_SUFFIX}"


def _fit(st: os.stat_result, uid: int) -> bool:
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022


CLAIM_S = 5.0  # how long the prolog keeps looking again while a squatter races it


def claim(spool: int, name: str, uid: int, gid: int, where: str,
          deadline_s: float = CLAIM_S) -> str:
    """Make ``name`` in the spool the job user's private directory; what was done. A squatter
    racing it (making and removing entries under that name) only makes it look again, until
    ``deadline_s``; JobDirError then."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            return _claim_once(spool, name, uid, gid, where)
        except (FileNotFoundError, FileExistsError):
            pass  # what was there changed under us: look again
        except safeio.Refused:
            pass  # swapped for a link or a file between mkdir and open: look again
        if time.monotonic() > end:
            raise JobDirError(f"{where}/{name}: still taken or changing after {deadline_s:g} s "
                              "of moving it aside")


def _claim_once(spool: int, name: str, uid: int, gid: int, where: str) -> str:
    st = safeio.lstat_at(spool, name)
    if st is not None and _fit(st, uid):
        return "kept"
    if st is not None and _being_made(st):
        # On the shared tier every node's prolog claims the same job-N at once: one made it
        # and has not chowned it yet. Moving it aside would leave a root directory behind for
        # good (and the other prolog would then take the job's for root-squashed): finish it.
        done = _make_it_the_users(spool, name, uid, gid, where, made_here=False)
        if done:
            return done
    moved = False
    if st is not None:
        moved = True
        aside = f"{SQUATTED}{name}.{st.st_uid}.{time.time_ns()}"
        os.rename(name, aside, src_dir_fd=spool, dst_dir_fd=spool)
        log.warning("checkpoint tier 0: %s/%s belonged to uid %d (mode %o), not to the job's "
                    "user (uid %d): moved aside to %s", where, name, st.st_uid, st.st_mode,
                    uid, aside)
    os.mkdir(name, 0o700, dir_fd=spool)
    done = _make_it_the_users(spool, name, uid, gid, where, made_here=True)
    return MOVED if moved and done == "created" else done


def _being_made(st: os.stat_result) -> bool:
    """Root's private directory: only a prolog (root) makes one under a job's name."""
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()
            and stat.S_IMODE(st.st_mode) == 0o700)


def _make_it_the_users(spool: int, name: str, uid: int, gid: int, where: str,
                       made_here: bool) -> str:
    """Chown the directory ``name`` to the job's user; "created" or "kept" ("": not made
    here and not a prolog's half-made one, so not ours to hand over)."""
    # The entry is root's until the chown, in a sticky spool: nobody else can swap it.
    fd, st = safeio.open_dir(spool, name, None, f"{where}/{name}")
    with closing(fd):
        if _fit(st, uid):
            return "kept"  # another node's prolog was first to chown it
        if st.st_uid != os.geteuid():
            if made_here and stat.S_IMODE(st.st_mode) == 0o700 and not os.listdir(fd):
                # An NFS server that squashes root made it "nobody's": take it back and say so.
                with suppress(OSError):
                    os.rmdir(name, dir_fd=spool)
                raise JobDirError(f"{where}/{name}: made by root but owned by uid {st.st_uid} "
                                  "(root squashed?): cannot make it the job user's")
            raise FileExistsError(errno.EEXIST, "not the directory just made")
        if not made_here and os.listdir(fd):
            return ""  # root's, but holding something: not a prolog's half-made directory
        try:
            os.fchown(fd, uid, gid)
        except PermissionError:
            if made_here:
                with suppress(OSError):
                    os.rmdir(name, dir_fd=spool)
            raise JobDirError(f"{where}/{name}: root may not chown here (root squashed?): "
                              "cannot make it the job user's") from None
        os.fchmod(fd, 0o700)
    return "created" if made_here else "kept"


def prepare(memory_root: str, job_id: str, uid: int, gid: int = -1) -> int:
    """Both of the job's directories: a failure with one does not stop the other. How many
    squatters' entries were moved aside."""
    problems, moved = [], 0
    with closing(safeio.ensure_spool(memory_root)) as spool:
        for name in names(job_id):
            try:
                done = claim(spool, name, uid, gid, memory_root)
            except (GpuwardenError, OSError) as exc:
                problems.append(f"{name}: {exc}")
                continue
            log.info("checkpoint tier 0: %s/%s %s for uid %d", memory_root, name, done, uid)
            moved += done == MOVED
    if problems:
        raise JobDirError("; ".join(problems))
    return moved


SHARED_S = 10.0  # the shared filesystem may hang: the prolog gives up on it after this


def prepare_shared(shared_root: str, job_id: str, uid: int, gid: int = -1) -> str:
    """The job's directory on the shared tier, made by root before the job (where root may
    chown there): a squatter's ``job-N`` (job ids are sequential, the spool world-writable) is
    moved aside, as on tier 0. The spool must already exist (an admin's, root's, 1777)."""
    name = names(job_id)[0]
    with closing(safeio.open_spool(shared_root)) as spool:
        return claim(spool, name, uid, gid, shared_root)


def for_prolog(config: Config, environ: Mapping[str, str]) -> int:
    """The prolog's hook (root, before the job): the job's tier-0 directories and its
    directory on the shared tier; how many squatters' entries were moved aside. Never
    raises."""
    moved = 0
    try:
        job_id, uid, gid = _ids(environ)
        if config.ckpt.shared_root:
            moved += _shared_in_child(config.ckpt.shared_root, job_id, uid, gid)
        moved += prepare(config.ckpt.memory_root, job_id, uid, gid)
        _note_held(config, job_id, uid)
    except (GpuwardenError, OSError) as exc:
        log.error("checkpoint tier 0 for job %s: %s", jobenv.job_id(environ, "?")[:20], exc)
    except Exception:  # a prolog that raises drains the node: log, never raise
        log.exception("checkpoint tier 0 for job %s: unexpected error",
                      jobenv.job_id(environ, "?")[:20])
    return moved


def _note_held(config: Config, job_id: str, uid: int) -> None:
    """Root's record of the job whose directories it made here (`jobsheld`: the periodic
    check's scan reads it, never the spool's listing). Logged, never raised. Only where that
    scan runs (`[health] prom_dir` set): otherwise it is a write per job start for nothing."""
    if not config.health.prom_dir:
        return
    from gpuwarden.ckpt import jobsheld  # noqa: PLC0415 - light

    try:
        jobsheld.record(config.health.state_dir, job_id, uid, time.time())
    except (GpuwardenError, OSError, ValueError) as exc:
        log.error("checkpoint tier 0: job %s not recorded in %s/%s (its steps are left out of "
                  "the node's checkpoint metrics): %s", job_id, config.health.state_dir,
                  jobsheld.DIR, exc)


def _shared_in_child(shared_root: str, job_id: str, uid: int, gid: int) -> int:
    """`prepare_shared` in a child killed at `SHARED_S`: a hung filesystem must not hold the
    prolog into PrologEpilogTimeout (which drains the node). Logged, never raised; 1 when a
    squatter's entry was moved aside."""
    from gpuwarden.ckpt import childcall  # noqa: PLC0415 - light, prolog only

    try:
        done = childcall.call(lambda: prepare_shared(shared_root, job_id, uid, gid), SHARED_S)
        log.info("checkpoint shared tier: %s/job-%s %s for uid %d", shared_root, job_id, done,
                 uid)
    except (GpuwardenError, OSError) as exc:
        log.error("checkpoint shared tier for job %s: %s (the job checks its directory itself)",
                  job_id, exc)
        return 0
    return int(done == MOVED)


def will_run_again(job: Job) -> bool | None:
    """True when Slurm will run the job again, False when it is over, None when its state says
    neither. Pure."""
    states = set(job.state)
    if states & WILL_RUN:
        return True
    if states & FINISHED:
        return False
    return None


def remove(memory_root: str, job_id: str, keep_dirs: bool) -> list[str]:
    """Remove the job's squatted entries and, unless ``keep_dirs``, its directories; what was
    removed. One entry that cannot be removed (too big, an I/O error) is logged and the others
    still go."""
    try:
        spool = safeio.open_spool(memory_root)
    except FileNotFoundError:
        return []
    gone = []
    with closing(spool):
        mine = names(job_id)
        # The job's own directories first: what a squatter planted must never hold them up.
        for n in sorted(os.listdir(spool), key=lambda n: n not in mine):
            squatted = n.startswith(SQUATTED) and n[len(SQUATTED):].rsplit(".", 2)[0] in mine
            if not (squatted or (n in mine and not keep_dirs)):
                continue
            try:
                if safeio.remove_at(spool, n):
                    gone.append(n)
            except Exception as exc:  # one bad entry must not keep the others
                log.error("checkpoint tier 0: cannot remove %s/%s (%s: %s): left in place",
                          memory_root, n, type(exc).__name__, exc)
    return gone


def for_epilog(config: Config, environ: Mapping[str, str],
               client: JobSource | None = None) -> None:
    """The epilog's hook (root, after the job). ``client``: how to ask Slurm for the job's
    state (by default `scontrol show job`, with the [slurm] timeouts). Never raises."""
    try:
        job_id, uid, _ = _ids(environ)
        again = _will_run_again(config, int(job_id), client)
        keep = again is not False
        try:
            gone = remove(config.ckpt.memory_root, job_id, keep_dirs=keep)
            if not keep:
                _forget_held(config, job_id)
        finally:
            # Whatever became of tier 0. Never while the job will run again (a requeue needs
            # its directory) or Slurm cannot say.
            if config.ckpt.shared_root and again is False:
                _shared_end_in_child(config.ckpt.shared_root, job_id, uid)
        if keep:
            log.info("checkpoint tier 0 and shared tier: keeping job %s's directories (%s)",
                     job_id, "it will run again" if again else "Slurm cannot say whether it "
                     "will run again")
        if gone:
            log.info("checkpoint tier 0: removed %s", ", ".join(gone))
    except (GpuwardenError, OSError) as exc:
        log.error("checkpoint tier 0 cleanup for job %s: %s",
                  jobenv.job_id(environ, "?")[:20], exc)
    except Exception:  # an epilog that raises drains the node: log, never raise
        log.exception("checkpoint tier 0 cleanup for job %s: unexpected error",
                      jobenv.job_id(environ, "?")[:20])


def _forget_held(config: Config, job_id: str) -> None:
    from gpuwarden.ckpt import jobsheld  # noqa: PLC0415 - light

    try:
        jobsheld.forget(config.health.state_dir, job_id)
    except (GpuwardenError, OSError) as exc:
        log.error("checkpoint tier 0: job %s's record in %s/%s left (the scan drops it once "
                  "its directories are gone): %s", job_id, config.health.state_dir,
                  jobsheld.DIR, exc)


def _shared_end_in_child(shared_root: str, job_id: str, uid: int) -> None:
    """A finished job's directory on the shared tier removed when the prolog made it and
    the job left it empty (`sharedspool`), in a child killed at `SHARED_S` (a hung filesystem
    must not hold the epilog). Logged, never raised."""
    from gpuwarden.ckpt import childcall, sharedspool  # noqa: PLC0415 - epilog only

    try:
        done = childcall.call(lambda: sharedspool.remove_if_empty(shared_root, job_id, uid),
                              SHARED_S)
    except (GpuwardenError, OSError) as exc:
        log.error("checkpoint shared tier: job %s's directory in %s left in place: %s", job_id,
                  shared_root, exc)
        return
    log.info("checkpoint shared tier: %s/job-%s %s", shared_root, job_id, done)


def _will_run_again(config: Config, job_id: int, client: JobSource | None) -> bool | None:
    if client is None:
        from gpuwarden.slurm.client import CliSlurmClient  # noqa: PLC0415 - epilog only
        from gpuwarden.slurm.runner import SubprocessRunner  # noqa: PLC0415

        client = CliSlurmClient(config.slurm, SubprocessRunner())
    try:
        return will_run_again(client.job(job_id))
    except GpuwardenError as exc:
        log.warning("checkpoint tier 0: cannot tell whether job %d will run again (%s): "
                    "keeping its directories", job_id, exc)
        return None

