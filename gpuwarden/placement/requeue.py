"""A requeued gang job does not wait for a leaf switch again.

The filter gives a gang job `req_switch` and a wait at submission. Slurm counts that wait from
the first time topology/tree looks at the job and never restarts the clock (eval_nodes_tree.c,
24.11 and 26.05: `wait4switch_start` is set once), so a job whose prolog failed moments after
it started, and that Slurm requeued, waits again for one leaf for what is left of the wait
once its requeue hold (cred_expire + 1 s, 121 s by default) is over: on a busy cluster, the
whole wait again in effect. The job has already lost that time to a failure that was not its
own; the wait was a trade of start time for locality made when it was submitted. So a pending
job that has been requeued (restart count > 0) and still carries the wait gpuwarden's filter
gave it gets that wait set to 0: at its next scheduling pass it starts at once, in the fewest
leaf switches Slurm finds free (topology/tree still prefers them), as with `wait_s = 0`.

Left alone: a wait the user chose (`--switches`: the filter wrote no switches= note), one the
user changed since (a switch count other than the filter's, or a longer wait), a "required"
partition's (the admin chose locality over start time), and a job relaxed already. Pure:
the daemon reads the jobs and applies what ``to_relax`` returns.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from gpuwarden.placement.decide import REQUIRED_WAIT_S
from gpuwarden.slurm.models import Job

# What job_submit.lua's apply() writes into admin_comment (users cannot set admin_comment).
_PLACED = re.compile(r"gpuwarden placement \(snapshot \d{1,20}\): switches=(\d{1,9}) "
                     r"wait=(\d{1,9})s")
RELAXED = "requeued: switch wait relaxed"
# The filter's comment for a job held for a leaf (decide.waits); any other comment is the user's.
_WAIT_LINE = "gpuwarden: this job may wait "
_MAX_TEXT = 64 * 1024  # decide.MAX_FIELD: longer text is not parsed


@dataclass(frozen=True)
class Relax:
    job_id: int
    switches: int
    was_s: int  # the wait Slurm held for it
    restarts: int
    admin_comment: str  # the new one: the old, plus what was done
    comment: str | None  # the new comment; None: the user's own, left as it is


def placed(admin_comment: str) -> tuple[int, int] | None:
    """The switches and wait gpuwarden's filter set, from the job's admin_comment; None when
    it set none."""
    if len(admin_comment) > _MAX_TEXT:
        return None
    found = _PLACED.findall(admin_comment)
    if not found:
        return None
    switches, wait = found[-1]
    return int(switches), int(wait)


def relax(job: Job) -> Relax | None:
    """What to set on ``job``, or None to leave it."""
    if "PENDING" not in job.state or job.restart_count <= 0 or RELAXED in job.admin_comment:
        return None
    note = placed(job.admin_comment)
    if note is None:
        return None
    switches, wait = note
    if not 0 < wait < REQUIRED_WAIT_S:
        return None  # no wait, or a "required" partition's
    # Slurm caps the wait at max_switch_wait, so it may be shorter than the filter's; longer,
    # or another switch count, and the user changed it (scontrol update): theirs.
    if job.req_switch != switches or not 0 < job.switch_wait_s <= wait:
        return None
    note_text = (f"gpuwarden placement: {RELAXED} (restart {job.restart_count}): "
                 f"{job.switch_wait_s}s -> 0s")
    admin = f"{job.admin_comment}; {note_text}" if job.admin_comment else note_text
    comment = None
    if job.comment.startswith(_WAIT_LINE):
        comment = (f"gpuwarden: this job was requeued (restart {job.restart_count}): it "
                   "starts wherever it fits, without waiting again for fewer leaf switches")
    return Relax(job.job_id, switches, job.switch_wait_s, job.restart_count, admin, comment)


def to_relax(jobs: Iterable[Job], done: set[int]) -> list[Relax]:
    """The jobs to relax now, less those in ``done`` (relaxed, or tried, by this daemon: its
    job list may be a minute old)."""
    return [r for r in (relax(j) for j in jobs if j.job_id not in done) if r is not None]
