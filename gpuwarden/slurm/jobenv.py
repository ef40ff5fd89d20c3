"""The Slurm job environment, read in one place: what slurmd gives the prolog, the epilog and
the health check (SLURM_JOB_*, SLURMD_NODENAME), and what srun gives a job's ranks
(SLURM_PROCID, SLURM_NTASKS, ...).

Pure: every function takes the environment (default ``os.environ``). The readers return the
raw strings; each caller judges them by its own rules (a log line's job id, a path's, a rank's
differ), with `digits` and `valid_job_id` for the common "plain ASCII digits" rule.

The prolog's fast path (gpuwarden.health.fastgate) imports this module: builtins and os only
(no typing, collections.abc, re or socket: each costs the fast path milliseconds per job start).
"""

from __future__ import annotations

import os

TYPE_CHECKING = False  # as in fastgate: typing and collections.abc are not free at run time
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

# slurmd, for the prolog, the epilog and the job.
JOB_ID = "SLURM_JOB_ID"
JOB_UID = "SLURM_JOB_UID"
JOB_GID = "SLURM_JOB_GID"
JOB_USER = "SLURM_JOB_USER"
JOB_NODELIST = "SLURM_JOB_NODELIST"
JOB_GPUS = "SLURM_JOB_GPUS"
NODENAME = "SLURMD_NODENAME"
# The prolog's and epilog's name for how often the job was requeued (RESTART_COUNT is the job's).
JOB_RESTART_COUNT = "SLURM_JOB_RESTART_COUNT"
# The epilog's: the job's exit code, and its derived one; any non-zero means it failed.
JOB_EXIT_CODE = "SLURM_JOB_EXIT_CODE"
JOB_EXIT_CODES = (JOB_EXIT_CODE, "SLURM_JOB_EXIT_CODE2", "SLURM_JOB_DERIVED_EC")
# srun, for each rank of a job step.
PROCID = "SLURM_PROCID"
NTASKS = "SLURM_NTASKS"
STEP_ID = "SLURM_STEP_ID"
RESTART_COUNT = "SLURM_RESTART_COUNT"

# A job id of the plain form (`valid_job_id`): Slurm's are 32-bit; 12 leaves room.
JOB_ID_DIGITS = 12
# A uid or gid of the plain form: 32-bit.
ID_DIGITS = 10


def digits(raw: str, max_len: int) -> bool:
    """``raw`` is 1 to ``max_len`` ASCII digits (str.isdigit alone also takes other
    scripts' digits and superscripts)."""
    return 0 < len(raw) <= max_len and raw.isascii() and raw.isdigit()


# ---- raw readers: "" when unset, unless the caller must tell unset from empty (None) ------------
def job_id(environ: Mapping[str, str] = os.environ, default: str = "") -> str:
    """SLURM_JOB_ID as set (``default`` when unset); not validated."""
    return environ.get(JOB_ID, default)


def valid_job_id(environ: Mapping[str, str] = os.environ) -> str:
    """SLURM_JOB_ID when plain digits (at most JOB_ID_DIGITS): safe in a path; else ""."""
    raw = job_id(environ)
    return raw if digits(raw, JOB_ID_DIGITS) else ""


def job_uid(environ: Mapping[str, str] = os.environ) -> str:
    return environ.get(JOB_UID, "")


def job_gid(environ: Mapping[str, str] = os.environ) -> str | None:
    """SLURM_JOB_GID; None when unset (stage-in then takes the uid's primary group)."""
    return environ.get(JOB_GID)


def job_ids(environ: Mapping[str, str], error: type[Exception]) -> tuple[str, int, int]:
    """SLURM_JOB_ID, SLURM_JOB_UID and SLURM_JOB_GID (-1 when unset or not digits: leave the
    group alone) of a root-run hook; ``error`` naming the variable when the id or uid is not
    digits."""
    jid, uid, gid = valid_job_id(environ), job_uid(environ), job_gid(environ) or ""
    if not jid:
        raise error(f"{JOB_ID}={job_id(environ)[:20]!r}: expected digits")
    if not digits(uid, ID_DIGITS):
        raise error(f"{JOB_UID}={uid[:20]!r}: expected digits")
    return jid, int(uid), int(gid) if digits(gid, ID_DIGITS) else -1


def job_user(environ: Mapping[str, str] = os.environ) -> str:
    return environ.get(JOB_USER, "")


def job_nodelist(environ: Mapping[str, str] = os.environ) -> str:
    """SLURM_JOB_NODELIST, a hostlist expression ("c[1-4]"); not expanded."""
    return environ.get(JOB_NODELIST, "")


def job_gpus(environ: Mapping[str, str] = os.environ) -> str:
    """SLURM_JOB_GPUS ("0,1,5"); not parsed."""
    return environ.get(JOB_GPUS, "")


def job_restart_count(environ: Mapping[str, str] = os.environ) -> str:
    """SLURM_JOB_RESTART_COUNT, "0" when unset or empty (a first start); not validated."""
    return environ.get(JOB_RESTART_COUNT) or "0"


def job_exit_codes(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The epilog's exit codes (JOB_EXIT_CODES, in order), "" for each unset."""
    return tuple(environ.get(k, "") for k in JOB_EXIT_CODES)


def slurmd_nodename(environ: Mapping[str, str] = os.environ) -> str:
    return environ.get(NODENAME, "")


def node_name(environ: Mapping[str, str] = os.environ,
              hostname: Callable[[], str] | None = None) -> str:
    """SLURMD_NODENAME, else this host's short name: ``hostname()``, by default os.uname's
    (what socket.gethostname returns on Linux, without importing socket); not validated."""
    name = slurmd_nodename(environ)
    if name:
        return name
    return (hostname() if hostname is not None else os.uname().nodename).split(".")[0]


def procid(environ: Mapping[str, str] = os.environ) -> str | None:
    """SLURM_PROCID, this rank; None when unset (not under srun)."""
    return environ.get(PROCID)


def ntasks(environ: Mapping[str, str] = os.environ) -> str | None:
    """SLURM_NTASKS; None when unset."""
    return environ.get(NTASKS)


def step_id(environ: Mapping[str, str] = os.environ) -> str:
    return environ.get(STEP_ID, "")


def restart_count(environ: Mapping[str, str] = os.environ) -> str | None:
    """SLURM_RESTART_COUNT, as a job sees it; None when unset."""
    return environ.get(RESTART_COUNT)
