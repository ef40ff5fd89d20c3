"""Failures over time by class, per partition. Pure.

Classes: hardware = the runs the attribution rules blame on the infrastructure (the same runs
as the MTTF section's failures); user = FAILED and OUT_OF_MEMORY runs it does not blame;
timeout = TIMEOUT and DEADLINE; cancelled = CANCELLED; preempted = PREEMPTED, and REQUEUED runs
no node failure explains (an operator's, a preemption's or the job's own requeue). NODE_FAIL
and BOOT_FAIL are hardware whether or not a node could be named.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from gpuwarden.accounting.attribution import Attribution
from gpuwarden.accounting.incidence import NO_JOB
from gpuwarden.report.bins import bin_days, day_label
from gpuwarden.report.collect import Cell, RunTally, run_key, run_keys
from gpuwarden.report.text import clean

CLASSES = ("hardware", "user", "timeout", "cancelled", "preempted")
STATE_CLASS = {
    "NODE_FAIL": "hardware", "BOOT_FAIL": "hardware",
    "FAILED": "user", "OUT_OF_MEMORY": "user",
    "TIMEOUT": "timeout", "DEADLINE": "timeout",
    "CANCELLED": "cancelled",
    "PREEMPTED": "preempted", "REQUEUED": "preempted",
    "COMPLETED": "completed",
}
MAPPING = ("hardware: runs the attribution rules blame on the infrastructure, the MTTF "
           "section's failures (NODE_FAIL, BOOT_FAIL, REQUEUED after a node failure, every gang "
           "job that FAILED, one-node runs that FAILED on a node health gating drained); user: "
           "other FAILED and OUT_OF_MEMORY; timeout: TIMEOUT, DEADLINE; cancelled: CANCELLED; "
           "preempted: PREEMPTED and REQUEUED runs no node failure explains")
NO_PARTITION = "(none)"


@dataclass(frozen=True)
class PartitionSeries:
    partition: str
    runs: int
    totals: dict[str, int]  # class -> runs over the whole history
    counts: dict[str, list[int]]  # class -> runs per bin (`Outcomes.bins`)


@dataclass(frozen=True)
class Outcomes:
    bin_days: int  # 1: per day, 7: per week
    bins: list[str]  # the first UTC day of each bin
    partitions: list[PartitionSeries]  # most runs first
    totals: dict[str, int]  # every partition
    runs: int
    unmatched_blames: int  # blamed runs the tally did not see (should be 0)
    # Of the hardware runs: gang runs that FAILED with no node event at the time, blamed
    # because accounting cannot tell which node failed them (a user's crash looks the same).
    gang_failed_no_event: int
    never_ran: int  # records of jobs that never ran (no nodes: cancelled while pending)
    cpu_runs: int  # runs without GPUs (not counted here nor in the MTTF section)
    mapping: str = MAPPING


Hit = tuple[Cell, int, int, str, int | None]  # (cell, GPUs, run seconds, user, restart count)
# A blamed run: (its `run_key`, its job, its end in whole seconds, whether its blame is
# pinned, `Blame.pinned`); as Blames, a year's million took a second to make.
Run = tuple[int, int, int, bool]


def blamed_runs(tally: RunTally, att: Attribution) -> Iterator[tuple[Run, Hit | None]]:
    """Each run the attribution blamed, once: (the run, as its first blame says it, (its
    cell, its GPUs, its length) or None where the tally did not see it)."""
    blames = att.blames
    if not len(blames):
        return
    run = np.frombuffer(blames.run, dtype=np.int32)
    # The first blame of each run (`Blames.firsts`): a gang run's blames come together.
    firsts = run[np.flatnonzero(np.r_[True, run[1:] != run[:-1]])]
    job = np.frombuffer(blames.job, dtype=np.int64)[firsts]
    ran = job != NO_JOB  # a drain without a run: no run to move
    firsts, job = firsts[ran], job[ran]
    if not len(job):
        return
    at = np.frombuffer(blames.at, dtype=np.float64)[firsts]
    # The next node of the run just seen: a gang run's blames come together.
    again = np.r_[False, (job[1:] == job[:-1]) & (at[1:] == at[:-1])]
    firsts, job, at = firsts[~again], job[~again], at[~again]
    pinned = np.frombuffer(blames.pinned, dtype=np.int8)[firsts].astype(bool)
    end = at.astype(np.int64) if np.isfinite(at).all() else None  # toward zero, as int()
    keys = None if end is None else run_keys(job, end)
    if keys is None:  # a job id past `run_keys`' int64, or an end int() refuses
        yield from _blamed_one_by_one(tally, job.tolist(), [int(t) for t in at.tolist()],
                                      pinned.tolist())
        return
    assert end is not None
    # One blame per node of a gang job: each run counts once, where it first comes.
    first = np.sort(np.unique(keys, return_index=True)[1])
    get = tally.blamable.get
    for key, j, e, pin in zip(keys[first].tolist(), job[first].tolist(), end[first].tolist(),
                              pinned[first].tolist(), strict=True):
        yield (key, j, e, pin), get(key)


def _blamed_one_by_one(tally: RunTally, jobs: list[int], ends: list[int], pinned: list[bool]
                       ) -> Iterator[tuple[Run, Hit | None]]:
    """`blamed_runs`' last step run by run (job ids past 31 bits: `run_keys` is int64)."""
    seen: set[int] = set()
    see = seen.add
    get = tally.blamable.get
    for j, end, pin in zip(jobs, ends, pinned, strict=True):
        key = run_key(j, end)
        if key in seen:
            continue  # one blame per node of a gang job: the run counts once
        see(key)
        yield (key, j, end, pin), get(key)


def gpu_blamed_runs(tally: RunTally, att: Attribution) -> Iterator[tuple[Run, Hit | None]]:
    """`blamed_runs` with GPUs (the MTTF section's failures), and any the tally missed."""
    for b, hit in blamed_runs(tally, att):
        if hit is None or hit[1] > 0:
            yield b, hit


Blamed = Sequence[tuple[Run, Hit | None]]  # `gpu_blamed_runs`, read once for every card


def gpu_blamed(tally: RunTally, att: Attribution, blamed: Blamed | None = None) -> Blamed:
    """``blamed`` where the caller read it already, else `gpu_blamed_runs`: the report's cards
    each walked every blame (a million at 10M records) for the same runs."""
    return list(gpu_blamed_runs(tally, att)) if blamed is None else blamed


def _name(part: str) -> str:
    return clean(part) if part else NO_PARTITION


def classify(tally: RunTally, att: Attribution,
             blamed: Blamed | None = None) -> Counter[tuple[int, str, str]]:
    """Runs per (day, partition, class)."""
    out: Counter[tuple[int, str, str]] = Counter()
    for (day, part, state), n in tally.cells.items():
        out[(day, _name(part), STATE_CLASS.get(state, "other"))] += n
    # The blamed runs per (cell, pinned) first: a year's million, a few thousand cells.
    moved = Counter((hit[0], b[3]) if hit is not None else None
                    for b, hit in gpu_blamed(tally, att, blamed))
    for key, n in moved.items():
        if key is None:
            out[(-1, "", "unmatched")] += n
            continue
        (day, part, state), pinned = key
        if state == "FAILED" and not pinned:
            out[(-1, "", "gang failed, no event")] += n
        was = STATE_CLASS[state]
        part = _name(part)
        if was != "hardware":
            out[(day, part, was)] -= n
            out[(day, part, "hardware")] += n
    return out


def outcomes(tally: RunTally, att: Attribution, blamed: Blamed | None = None) -> Outcomes:
    counts = classify(tally, att, blamed)
    unmatched = counts.pop((-1, "", "unmatched"), 0)
    gang = counts.pop((-1, "", "gang failed, no event"), 0)
    days = [d for d, _, _ in counts]
    first, last = (min(days), max(days)) if days else (0, -1)
    step = bin_days(last - first + 1)
    nbins = (last - first) // step + 1 if days else 0
    per: dict[str, dict[str, list[int]]] = {}
    runs: Counter[str] = Counter()
    for (day, part, cls), n in counts.items():
        runs[part] += n
        if cls not in CLASSES:
            continue
        series = per.setdefault(part, {c: [0] * nbins for c in CLASSES})
        series[cls][(day - first) // step] += n
    parts = [PartitionSeries(p, runs[p], {c: sum(v) for c, v in per.get(p, {}).items()} or
                             dict.fromkeys(CLASSES, 0),
                             per.get(p, {c: [0] * nbins for c in CLASSES}))
             for p in sorted(runs, key=lambda p: (-runs[p], p))]
    totals = {c: sum(s.totals[c] for s in parts) for c in CLASSES}
    return Outcomes(step, [day_label(first + i * step) for i in range(nbins)], parts, totals,
                    sum(runs.values()), unmatched, gang, tally.never_ran, tally.cpu_runs)
