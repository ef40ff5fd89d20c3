"""Read a job history (exported `sacct --json` files or the live cluster) into one Attribution.

Files are read one at a time per worker and only the per-node tallies are kept, so memory stays
flat however long the history; with several files, worker processes share them out.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from multiprocessing import get_context
from pathlib import Path

from gpuwarden.errors import GpuwardenError, SlurmError
from gpuwarden.lemon.attribution import (
    GRACE_S,
    Attribution,
    HealthDrain,
    add_lone_drains,
    attribute_runs,
    by_node,
    health_drains,
    lemon_clears,
    node_failures,
)
from gpuwarden.slurm import parse
from gpuwarden.slurm.client import SlurmClient
from gpuwarden.slurm.models import AcctJob, NodeEvent

log = logging.getLogger(__name__)

SLURM_TIME = "%Y-%m-%dT%H:%M:%S"


class HistoryError(GpuwardenError):
    """A history file that cannot be read at all (not merely a bad record in it)."""


@dataclass(frozen=True)
class History:
    attribution: Attribution
    records: int
    events: tuple[NodeEvent, ...]


def read_events(path: str | None) -> list[NodeEvent]:
    if not path:
        return []
    try:
        return parse.parse_events(Path(path).read_text(encoding="utf-8", errors="replace"))
    except OSError as exc:
        raise HistoryError(f"{path}: cannot read ({exc.strerror})") from None
    except SlurmError as exc:
        raise HistoryError(f"{path}: {exc}") from None


@dataclass(frozen=True)
class _Known:
    """What the events say, needed while reading runs."""

    drains: Mapping[str, list[HealthDrain]]
    failures: Mapping[str, list[HealthDrain]]
    clears: Mapping[str, float]
    grace_s: float

    @classmethod
    def of(cls, events: Sequence[NodeEvent], grace_s: float) -> _Known:
        return cls(by_node(health_drains(events)), by_node(node_failures(events)),
                   lemon_clears(events), grace_s)

    def finish(self, att: Attribution) -> Attribution:
        return add_lone_drains(att, self.drains, self.grace_s, self.clears)


def _count(att: Attribution, records: Iterable[AcctJob | SlurmError], label: str,
           known: _Known) -> tuple[Attribution, int]:
    n = 0
    good: list[AcctJob] = []
    for r in records:
        n += 1
        if isinstance(r, AcctJob):
            good.append(r)
        else:
            att.skipped[f"{label}malformed record"] += 1
    return att.merge(attribute_runs(good, known.drains, known.grace_s, known.clears,
                                    known.failures)), n


@contextmanager
def gc_paused() -> Iterator[None]:
    """Decoding a big sacct file makes millions of small dicts, and the cyclic collector runs
    over all of them again and again (4-5x the decode time). The tree has no cycles."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _read_one(path: str, known: _Known) -> tuple[Attribution, int]:
    with gc_paused():
        return _read_one_unpaused(path, known)


def _read_one_unpaused(path: str, known: _Known) -> tuple[Attribution, int]:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        doc = parse.load_json(text, "sacct --json")
        del text
        lo, hi = parse.acct_window(doc)
        records: Iterable[AcctJob | SlurmError] = parse.acct_records(doc)
        if lo is not None or hi is not None:
            # Exported with a window: count only runs that ended in it, so that day files
            # never count a run that crossed midnight twice.
            records = _ended_in(records, lo or 0.0, hi or float("inf"))
        return _count(Attribution(), records, f"{path}: ", known)
    except OSError as exc:
        raise HistoryError(f"{path}: cannot read ({exc.strerror})") from None
    except SlurmError as exc:
        raise HistoryError(f"{path}: {exc} (expected `sacct --json` output)") from None


def _refuse_repeats(paths: Sequence[str]) -> None:
    """The same file twice (a repeated --from, overlapping globs) would count its runs twice."""
    seen: dict[tuple[int, int], str] = {}
    for p in paths:
        try:
            st = os.stat(p)
        except OSError as exc:
            raise HistoryError(f"{p}: cannot read ({exc.strerror})") from None
        key = (st.st_dev, st.st_ino)
        if key in seen:
            raise HistoryError(f"{p} is the same file as {seen[key]}: give each export once")
        seen[key] = p


def _workers(n_files: int) -> int:
    return max(1, min(n_files, len(os.sched_getaffinity(0))))


def from_files(paths: Sequence[str], events: Sequence[NodeEvent], grace_s: float = GRACE_S,
               workers: int | None = None,
               progress: Callable[[int, int], None] | None = None) -> History:
    _refuse_repeats(paths)
    known = _Known.of(events, grace_s)
    att, total = Attribution(), 0
    workers = workers or _workers(len(paths))
    if workers > 1 and len(paths) > 1:
        # fork: workers start without re-importing gpuwarden.
        with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
            futures = [pool.submit(_read_one, p, known) for p in paths]
            try:
                for i, fut in enumerate(futures, 1):
                    part, n = fut.result()
                    att.merge(part)
                    total += n
                    if progress:
                        progress(i, len(paths))
            except BrokenProcessPool:
                pool.shutdown(cancel_futures=True)
                raise HistoryError("a worker reading the history died (out of memory?): "
                                   "split the export into smaller files") from None
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise
    else:
        for i, p in enumerate(paths, 1):
            part, n = _read_one(p, known)
            att.merge(part)
            total += n
            if progress:
                progress(i, len(paths))
    return History(known.finish(att), total, tuple(events))


def _ended_in(records: Iterable[AcctJob | SlurmError], lo: float,
              hi: float) -> Iterator[AcctJob | SlurmError]:
    """sacct lists a run in every window it overlaps: count it only in the one it ended in
    (runs still going are not finished, so not counted yet)."""
    for r in records:
        if not isinstance(r, AcctJob) or (r.end_time is not None and lo <= r.end_time < hi):
            yield r


def _slurm_time(at: datetime) -> str:
    # The client runs Slurm's commands with TZ=UTC (gpuwarden.slurm.runner.SLURM_ENV).
    return at.astimezone(UTC).strftime(SLURM_TIME)


def from_cluster(client: SlurmClient, since: timedelta, grace_s: float = GRACE_S,
                 now: datetime | None = None,
                 progress: Callable[[int, int], None] | None = None) -> History:
    """One day per sacct call, so a long scan never asks slurmdbd for everything at once."""
    end = (now or datetime.now(UTC)).replace(microsecond=0)
    start = end - since
    events = client.events(_slurm_time(start), _slurm_time(end))
    known = _Known.of(events, grace_s)
    att, total = Attribution(), 0
    days = max(1, -(-int(since.total_seconds()) // 86_400))
    i = 0
    while start < end:
        stop = min(start + timedelta(days=1), end)
        with gc_paused():
            records = client.acct_jobs(_slurm_time(start), _slurm_time(stop))
            att, n = _count(att, _ended_in(records, start.timestamp(), stop.timestamp()), "",
                            known)
        total += n
        i += 1
        if progress:
            progress(i, days)
        start = stop
    return History(known.finish(att), total, tuple(events))
