"""What an infrastructure failure cost the jobs that checkpoint with gpuwarden, measured from
their restore records (`ckpt.restorelog`) instead of modelled. Pure.

A run the attribution blamed is matched with its job's first restore after it (a later run of
the same job, SLURM_RESTART_COUNT at least 1). That restore says:
- the work the failure lost: the failed run's end less the time the restored step was saved
  (its manifest's `created_at`), at most the failed run's length (what came before the run
  was an earlier failure's loss);
- the restart: the restore's end less the failed run's end: the requeue wait, the prolog's
  stage-in and the verified read, until training could go on (ETTR's u0).

A job restore counts for job N only when the user accounting names for N owns the job
directory its records were read from: a user can file records under any `job-N` directory of
their own making, but not speak for another user's job.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gpuwarden.ckpt.restorelog import RestoreRecord, job_restores


@dataclass(frozen=True)
class Measured:
    lost_s: float | None  # None: the record is from before restores recorded saved_at
    restart_s: float


@dataclass(frozen=True)
class FailedRun:
    """A blamed run as the tally kept it."""

    key: int  # collect.run_key
    job_id: int
    end: int
    seconds: int  # how long it had run
    user: str


@dataclass(frozen=True)
class Restarts:
    measured: dict[int, Measured] = field(default_factory=dict)  # run_key -> its restart
    after_restart: int = 0  # job restores in a run after the first (SLURM_RESTART_COUNT > 0)
    not_owner: int = 0  # the job directory's owner is not the user accounting names
    unexplained: int = 0  # no blamed run of the job before it (preempted, requeued by hand)


def match(records: Iterable[RestoreRecord], failed: Iterable[FailedRun],
          uid_of: Callable[[str], int | None]) -> Restarts:
    """``uid_of``: a user name's uid, None where it cannot be resolved (nothing matches)."""
    by_job: dict[int, list[FailedRun]] = defaultdict(list)
    for f in failed:
        by_job[f.job_id].append(f)
    for runs in by_job.values():
        runs.sort(key=lambda f: f.end)
    measured: dict[int, Measured] = {}
    after = not_owner = unexplained = 0
    uids: dict[str, int | None] = {}
    for rec in sorted((r for r in job_restores(records) if r.restarts > 0),
                      key=lambda r: (r.at, r.job, r.run)):
        after += 1
        before = [f for f in by_job.get(rec.job_id, ()) if f.end <= rec.at]
        if not before or before[-1].key in measured:
            unexplained += 1  # the failure before it is another restore's already
            continue
        f = before[-1]
        if f.user not in uids:
            uids[f.user] = uid_of(f.user)
        if rec.owner is None or uids[f.user] != rec.owner:
            not_owner += 1
            continue
        lost = None
        if rec.saved_at is not None:
            lost = min(float(f.seconds), max(0.0, f.end - rec.saved_at))
        measured[f.key] = Measured(lost, rec.at - f.end)
    return Restarts(measured, after, not_owner, unexplained)
