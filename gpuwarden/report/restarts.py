"""What an infrastructure failure cost the jobs that checkpoint with gpuwarden, measured from
their restore records (`ckpt.restorelog`) instead of modelled. Pure.

A run the attribution blamed is matched with its job's first restore after it (a later run of
the same job, SLURM_RESTART_COUNT at least 1). That restore says:
- the work the failure lost: the failed run's end less the time the restored step was saved
  (its manifest's `created_at`), at most the failed run's length (what came before the run
  was an earlier failure's loss);
- the restart: the restore's end less the failed run's end: the requeue wait (outside any
  run: wall time on top of H), then the prolog's stage-in and the verified read inside the
  next run (time in H that trained nothing), until training could go on (ETTR's u0).

A blamed run of a job that checkpoints some other way (or not at all) whose job was requeued
still shows its requeue wait in accounting: the next run's start (a run with a restart count of
1 or more) less the failed run's end, wall time on top of H. The restore inside that run is
not in accounting: for such a failure only the wait is measured.

A job restore counts for job N only when the user accounting names for N owns the job
directory its records were read from: a user can file records under any `job-N` directory of
their own making, but not speak for another user's job.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuwarden.ckpt.restorelog import RestoreRecord, job_restores
from gpuwarden.report.collect import run_key

SKEW_S = 60.0  # clocks of the node that saved and of slurmctld may differ this much
# A longer wait for the next run is a hold or a requeue by hand, not the failure's restart:
# such a failure stays modelled (u0), and is counted apart.
MAX_REQUEUE_WAIT_S = 86_400.0


RunAfter = tuple[int, int, str]  # a run after a requeue: start, restart count, user


@dataclass(frozen=True)
class Measured:
    lost_s: float | None  # None: the record is from before restores recorded saved_at
    restart_s: float  # failure to restored
    gap_s: float  # failure to the next run's start: the part of the restart outside any run


@dataclass(frozen=True)
class FailedRun:
    """A blamed run as the tally kept it."""

    key: int  # collect.run_key
    job_id: int
    end: int
    seconds: int  # how long it had run
    user: str
    restarts: int | None = None  # its restart count (None: accounting does not say)


@dataclass(frozen=True)
class Restarts:
    measured: dict[int, Measured] = field(default_factory=dict)  # run_key -> its restart
    not_owner: int = 0  # the job directory's owner is not the user accounting names
    # Not after a blamed run of the job (a preemption, a hand requeue), not inside a run of
    # it in accounting, or from a step saved after that failure.
    unexplained: int = 0
    # run_key -> seconds from the failure to its job's next run, for blamed runs no restore
    # record measured
    requeue_wait: dict[int, float] = field(default_factory=dict)
    requeue_too_long: int = 0  # next runs that waited past MAX_REQUEUE_WAIT_S: not measured


def match(records: Iterable[RestoreRecord], failed: Iterable[FailedRun],
          runs: Mapping[int, Sequence[tuple[int, int]]],
          uid_of: Callable[[str], int | None],
          requeued: Mapping[int, Sequence[RunAfter]] | None = None) -> Restarts:
    """``runs``: each watched job's runs in accounting, (start, end); ``uid_of``: a user
    name's uid, None where it cannot be resolved (nothing matches); ``requeued``: the starts
    of each job's runs after a requeue (`RunTally.requeued`), for the requeue waits of the
    blamed runs no restore record measured.

    A job restore is placed in the run of its job that was going on when it ended; the run
    before that one must be a blamed failure, and the restored step saved before it ended.
    So a record's times are bounded by accounting's: a restart by the next run's start and
    that run's length, lost work by the failed run's length."""
    failed = list(failed)
    restores = sorted((r for r in job_restores(records) if r.restarts > 0),
                      key=lambda r: (r.at, r.job, r.run))
    # Looked up only for a record: without any, a year's million blamed runs for nothing.
    by_key = {f.key: f for f in failed} if restores else {}
    measured: dict[int, Measured] = {}
    not_owner = unexplained = 0
    uids: dict[str, int | None] = {}
    for rec in restores:
        spans = sorted(set(runs.get(rec.job_id, ())))
        # Accounting keeps whole seconds, and the node's clock is not slurmctld's.
        here = [i for i, (s, e) in enumerate(spans) if s - SKEW_S <= rec.at <= e + SKEW_S]
        if not here or here[-1] == 0:
            unexplained += 1
            continue
        start = spans[here[-1]][0]
        f = by_key.get(run_key(rec.job_id, spans[here[-1] - 1][1]))
        if f is None or f.key in measured or (rec.saved_at is not None
                                              and rec.saved_at > f.end + SKEW_S):
            unexplained += 1
            continue
        if f.user not in uids:
            uids[f.user] = uid_of(f.user)
        if rec.owner is None or uids[f.user] != rec.owner:
            not_owner += 1
            continue
        lost = None
        if rec.saved_at is not None:
            lost = min(float(f.seconds), max(0.0, f.end - rec.saved_at))
        measured[f.key] = Measured(lost, rec.at - f.end, max(0.0, float(start - f.end)))
    waits, too_long = requeue_waits(failed, requeued or {}, set(measured))
    return Restarts(measured, not_owner, unexplained, waits, too_long)


def requeue_waits(failed: Iterable[FailedRun], requeued: Mapping[int, Sequence[RunAfter]],
                  done: set[int]) -> tuple[dict[int, float], int]:
    """Each blamed run's wait until its job's next run started, unless in ``done``; and how
    many waited past MAX_REQUEUE_WAIT_S (held or requeued by hand: not measured). The next
    run is the one with the failed run's restart count plus one, of the same user (a job id
    Slurm gave out again after a reset is another user's job, or no requeue of this one),
    starting at or after the failure's end (both times slurmctld's)."""
    out: dict[int, float] = {}
    too_long = 0
    for f in failed:
        runs = requeued.get(f.job_id)
        if f.key in done or not runs or f.restarts is None:
            continue
        after = [s for s, n, user in runs
                 if n == f.restarts + 1 and user == f.user and s >= f.end]
        if not after:
            continue
        wait = float(min(after) - f.end)
        if wait > MAX_REQUEUE_WAIT_S:
            too_long += 1
            continue
        out[f.key] = wait
    return out, too_long
