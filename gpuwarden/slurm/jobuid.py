"""The uid a job ran as, from Slurm: slurmctld's record while it knows the job (`scontrol show
job N --json`, its ``user_id``), else accounting's (`sacct -j N`, its ``UID``: slurmctld forgets
a job MinJobAge after it ends). Root's `gpuwarden ckpt ls|verify|gc` derive the job's
checkpoint key from it on a site with ``[ckpt] key_file`` (`gpuwarden.ckpt.jobkey`).

The uid is read as a number, never through a user name: the key is derived from the uid the
prolog got (``SLURM_JOB_UID``), and a name can map to another uid on another host. Both
commands together end by one deadline; nothing is retried (the admin runs the command again,
or gives ``--uid``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from gpuwarden.core.errors import SlurmError
from gpuwarden.slurm import bindir, jobenv
from gpuwarden.slurm.parse import load_json
from gpuwarden.slurm.runner import CommandRunner, DeadlineRunner, SubprocessRunner
from gpuwarden.slurm.settings import SlurmConfig

LOOKUP_S = 20.0  # both commands together
MAX_UID = 0xFFFFFFFD  # NO_VAL (0xfffffffe) and up are Slurm's "unset", never a uid


@dataclass(frozen=True)
class Found:
    """The job's uid and the command that said it; or None and why not (every command's
    answer)."""

    uid: int | None
    source: str = ""
    why: str = ""


def runner(slurm: SlurmConfig, end: float) -> CommandRunner:
    """Slurm's commands from where `Context.client_for` runs them, every one done by ``end``
    (time.monotonic())."""
    place = SubprocessRunner(lambda: bindir.locate(slurm.bin_dir, use_path=True).path)
    return DeadlineRunner(place, end)


def job_uid(job_id: str, run: CommandRunner, timeout_s: float) -> Found:
    """The uid job ``job_id`` (digits) ran as: slurmctld's, else accounting's."""
    if not jobenv.digits(job_id, jobenv.JOB_ID_DIGITS):
        return Found(None, why=f"job id {job_id[:20]!r}: expected digits")
    whys = []
    for source, ask in (("scontrol", _scontrol), ("sacct", _sacct)):
        try:
            uid, why = ask(job_id, run, timeout_s)
        except SlurmError as exc:  # not run, timed out, or its output not understood
            uid, why = None, str(exc)
        if uid is not None:
            return Found(uid, source)
        whys.append(f"{source}: {why}")
    return Found(None, why="; ".join(whys))


def _scontrol(job_id: str, run: CommandRunner, timeout_s: float) -> tuple[int | None, str]:
    argv = ["scontrol", "show", "job", job_id, "--json"]
    res = run.run(argv, timeout_s)
    if res.returncode != 0:
        err = " ".join((res.stderr or res.stdout).split())[:300]
        return None, f"exit {res.returncode}: {err or 'no message'}"
    doc = load_json(res.stdout, "scontrol show job --json")
    jobs = doc.get("jobs")
    # An array's or a heterogeneous job's id answers with every member: take its own.
    mine = [j for j in jobs if isinstance(j, Mapping) and _plain_int(j.get("job_id"))
            == int(job_id)] if isinstance(jobs, list) else []
    if not mine:
        return None, f"does not know job {job_id}"
    uid = _plain_int(mine[0].get("user_id"))
    if uid is None:
        return None, f"job {job_id} has no user_id"
    return uid, ""


def _sacct(job_id: str, run: CommandRunner, timeout_s: float) -> tuple[int | None, str]:
    # -j without -S reads every time (sacct's default start with -j is the epoch); without
    # --duplicates, the newest job of that id only.
    argv = ["sacct", "--allusers", "--allocations", "--noheader", "--parsable2",
            f"--jobs={job_id}", "--format=JobIDRaw,UID"]
    res = run.run(argv, timeout_s)
    if res.returncode != 0:
        err = " ".join((res.stderr or res.stdout).split())[:300]
        return None, f"exit {res.returncode}: {err or 'no message'}"
    uids = set()
    for line in res.stdout.splitlines():
        raw_id, sep, raw_uid = line.strip().partition("|")
        if sep and raw_id == job_id:
            if not (raw_uid.isascii() and raw_uid.isdigit() and int(raw_uid) <= MAX_UID):
                return None, f"job {job_id}'s UID {raw_uid[:20]!r}: expected a number"
            uids.add(int(raw_uid))
    if len(uids) > 1:  # never a guess between two users
        return None, f"job {job_id} is recorded with several uids ({sorted(uids)})"
    if not uids:
        return None, f"has no record of job {job_id}"
    return uids.pop(), ""


def _plain_int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_UID:
        return None
    return value


def lookup(job_id: str, slurm: SlurmConfig, budget_s: float = LOOKUP_S) -> Found:
    """`job_uid` with Slurm's own commands, all of it within ``budget_s``."""
    end = time.monotonic() + budget_s
    return job_uid(job_id, runner(slurm, end), min(slurm.command_timeout_s, budget_s))
