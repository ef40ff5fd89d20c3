"""Read a job history (exported `sacct --json` files or the live cluster) into one Attribution.

Files are read one at a time per worker and only the per-node tallies are kept, so memory stays
flat however long the history; with several files, worker processes share them out.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Protocol

from gpuwarden.accounting import stream as acctstream
from gpuwarden.accounting import windows as exportwindows
from gpuwarden.accounting.attribution import (
    GRACE_S,
    Attribution,
    HealthDrain,
    add_lone_drains,
    attribute_runs,
    by_node,
    health_drains,
    lemon_clears,
    node_failures,
    spread_exposure,
)
from gpuwarden.accounting.columns import Columns
from gpuwarden.accounting.gcpause import paused
from gpuwarden.accounting.mttf import drained_nodes
from gpuwarden.accounting.rangetally import RangeTally
from gpuwarden.accounting.readspan import FirstSeen, bounded, first_seen, window_note
from gpuwarden.accounting.stream import AcctRecord
from gpuwarden.core.errors import GpuwardenError, SlurmError
from gpuwarden.slurm import dataparser, parse
from gpuwarden.slurm.client import SlurmClient
from gpuwarden.slurm.models import AcctJob, NodeEvent
from gpuwarden.slurm.runner import CommandTimeoutError

log = logging.getLogger(__name__)

SLURM_TIME = "%Y-%m-%dT%H:%M:%S"


class HistoryError(GpuwardenError):
    """A history file that cannot be read at all (not merely a bad record in it)."""


class Collector(Protocol):
    """More tallies of the same records, filled in the same pass as the attribution (the fleet
    report's: `gpuwarden.report.collect`). Picklable: worker processes fill one each."""

    def add(self, records: Columns) -> None: ...
    def merge(self, other: Any) -> None: ...
    # The same tallies from the accounting store (`accounting.store.scan.StoreRuns`): its
    # plain runs on columns; the others a batch of column lists at a time (`schema.Batch`),
    # given to what it returns as the attribution reads them (`scan.Others`).
    def add_store(self, runs: Any) -> Any: ...


CollectorFactory = Callable[[], Collector]
Window = tuple[float | None, float | None]


@dataclass(frozen=True)
class History:
    attribution: Attribution
    records: int
    events: tuple[NodeEvent, ...]
    collected: Collector | None = None  # what ``collector`` gathered, when one was given
    # The accounting windows read (epoch seconds, merged), when every export named at least
    # its start: the spans failures were looked for in (runs that started before them still
    # count their hours). () when not known: the runs' own span stands in.
    # Bounded below by the first thing the cluster recorded (`readspan`): a cluster younger
    # than --since is read from its registration.
    windows: tuple[tuple[float, float], ...] = ()
    asked: tuple[float, float] | None = None  # the window asked, before that bound
    seen: FirstSeen | None = None  # the first thing recorded

    @property
    def window(self) -> tuple[float, float] | None:
        """From the first window's start to the last one's end."""
        return exportwindows.hull(self.windows)

    @property
    def window_note(self) -> str:
        """The window read, said as `fleet mttf` and `report` both show it."""
        return window_note(self.asked, self.windows, self.seen)


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

    def finish(self, att: Attribution,
               windows: Sequence[tuple[float, float]] = ()) -> Attribution:
        return add_lone_drains(att, self.drains, self.grace_s, self.clears, windows)


def _history(known: _Known, att: Attribution, records: int, events: Sequence[NodeEvent],
             collected: Collector | None, asked: Sequence[tuple[float, float]]) -> History:
    """The History of what was read in the windows ``asked`` (() when not known), those
    bounded below by the first thing seen."""
    seen = first_seen(att.first_start, events)
    spans = bounded(asked, seen) if asked else ()
    return History(known.finish(att, spans), records, tuple(events), collected, spans,
                   exportwindows.hull(asked), seen)


BATCH = 50_000  # records per attribute_runs call: bounds the list of records held


def _count(att: Attribution, batches: Iterable[Sequence[AcctRecord | SlurmError]], label: str,
           known: _Known, collect: Collector | None = None,
           window: Window = (None, None)) -> tuple[Attribution, int]:
    """Fold a stream of record batches into ``att`` (and ``collect``); only per-node tallies
    and failed runs stay. ``window``: the export's (or the sacct call's); sacct lists a run in
    every window it overlaps, so only runs that ended in it count (runs still going are not
    finished, so not counted yet) and day files never count a run that crossed midnight
    twice. Returns the records counted (malformed ones included)."""
    n, bad, first_bad = 0, 0, ""
    good: list[AcctRecord] = []
    tally = RangeTally()  # exposure of every batch, spread over the nodes once at the end
    lo, hi = window
    bounded = lo is not None or hi is not None

    def fold(records: list[AcctRecord]) -> int:
        cols = Columns(records)
        if bounded:
            cols = cols.ended_in(lo or 0.0, hi if hi is not None else float("inf"))
        if collect is not None:
            collect.add(cols)
        attribute_runs(cols, known.drains, known.grace_s, known.clears, known.failures,
                       into=att, tally=tally)
        return len(cols)

    for batch in batches:
        ok = [r for r in batch if not isinstance(r, SlurmError)]
        if len(ok) < len(batch):
            errors = [r for r in batch if isinstance(r, SlurmError)]
            bad += len(errors)
            first_bad = first_bad or str(errors[0])
        good.extend(ok)
        if len(good) >= BATCH:
            n += fold(good)
            good = []
    if bad:
        # One line per file, with the first record's problem (field and data_parser version).
        log.warning("%s%d malformed record(s), the first: %s", label, bad, first_bad)
        att.skipped[f"{label}malformed record"] += bad
    if good:
        n += fold(good)
    spread_exposure(att.exposure, tally)
    return att, n + bad


def chunks(items: Iterable[AcctJob | SlurmError],
           size: int = 1000) -> Iterator[list[AcctJob | SlurmError]]:
    """``items`` in lists of ``size`` (the last one shorter): what the batch readers take."""
    chunk: list[AcctJob | SlurmError] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


Part = tuple[Attribution, int, "Collector | None", Window]


def _read_one(path: str, known: _Known, collector: CollectorFactory | None = None,
              window: Window = (None, None)) -> Part:
    with paused():
        return _read_one_unpaused(path, known, collector, window)


def _stream_file(path: str, known: _Known, window: Window,
                 collect: Collector | None) -> tuple[Attribution, int, Window, Window]:
    """One pass over an export; returns the window used and the one its own "meta" names."""
    with acctstream.open_regular(path) as fh:
        meta = acctstream.file_meta(fh)
        if window == (None, None) and meta is not None:
            window = parse.acct_window({"meta": meta})
        # With the version the export names, a record without a field the scan needs is
        # reported naming the field and the version.
        stream = acctstream.AcctStream(acctstream.text_reader(fh), "sacct --json",
                                       version=None if meta is None else dataparser.version(meta))
        att, n = _count(Attribution(), stream.run_batches(), f"{path}: ", known, collect,
                        window)
        return att, n, window, parse.acct_window(stream.top)


def _read_one_unpaused(path: str, known: _Known, collector: CollectorFactory | None,
                       window: Window) -> Part:
    """``window``: the export's as `plan_windows` found it, (None, None) when its tail named
    none (the export's own "meta" then decides). Returns the window used too."""
    try:
        collect = collector() if collector is not None else None
        att, n, used, named = _stream_file(path, known, window, collect)
        if window == (None, None) and named not in (used, (None, None)):
            # "meta" was not in the tail looked at first: read again, now holding its window.
            log.info("%s: its window was found only at its end: reading it again", path)
            collect = collector() if collector is not None else None
            att, n, _, _ = _stream_file(path, known, named, collect)
            used = named
        return att, n, collect, used
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


def plan_windows(paths: Sequence[str]
                 ) -> tuple[exportwindows.Planned, list[Window], set[str]]:
    """Each export's window from its own "meta", checked together (`slurm.exportwindows`): a
    lost end is the next export's start, and exports whose windows overlap are refused. The
    plan (its notes are the caller's to log), the windows as the exports name them, and the
    clusters the exports' "meta" name (slurm.cluster)."""
    windows: list[Window] = []
    clusters: set[str] = set()
    for p in paths:
        try:
            with acctstream.open_regular(p) as fh:
                meta = acctstream.file_meta(fh)
        except OSError as exc:
            raise HistoryError(f"{p}: cannot read ({exc.strerror})") from None
        except SlurmError as exc:
            raise HistoryError(f"{p}: {exc}") from None
        windows.append((None, None) if meta is None else parse.acct_window({"meta": meta}))
        slurm = meta.get("slurm") if meta is not None else None
        name = slurm.get("cluster") if isinstance(slurm, Mapping) else None
        if isinstance(name, str) and name:
            clusters.add(name)
    return _plan(paths, windows), windows, clusters


def _plan(paths: Sequence[str], named: Sequence[Window]) -> exportwindows.Planned:
    try:
        return exportwindows.plan(paths, named)
    except exportwindows.OverlapError as exc:
        raise HistoryError(str(exc)) from None


def same_cluster(events: Sequence[NodeEvent], clusters: set[str]) -> list[NodeEvent]:
    """The node events of the cluster the accounting is from. Events are matched to runs by
    node name alone, so another cluster's (a `sacctmgr show events` of every cluster in the
    database) would blame runs on nodes that only share a name. One cluster in the accounting:
    its events are kept (the others' dropped, said); several clusters in the events and none
    known in the accounting, or several there too: an error."""
    named = {e.cluster for e in events if e.cluster}
    if len(clusters) == 1 and named and not named & clusters:
        raise HistoryError(
            f"the node events are of cluster {', '.join(sorted(named))} and the accounting of "
            f"{next(iter(clusters))}: export the events of the accounting's cluster "
            "(sacctmgr show events cluster=NAME)")
    if len(named) <= 1 or (len(clusters) == 1 and named <= clusters):
        return list(events)
    if len(clusters) == 1:
        (mine,) = clusters
        kept = [e for e in events if e.cluster in ("", mine)]
        log.warning("node events of other clusters (%s) left out: %d of %d; the accounting is "
                    "cluster %s's", ", ".join(sorted(named - clusters)), len(events) - len(kept),
                    len(events), mine)
        return kept
    raise HistoryError(
        f"the node events are of several clusters ({', '.join(sorted(named))}) and the "
        f"accounting names {'several: ' + ', '.join(sorted(clusters)) if clusters else 'none'}: "
        "export one cluster's events (sacctmgr show events cluster=NAME) and its accounting")


def workers_for(n_files: int) -> int:
    """Reader processes for ``n_files`` exports: one per file, at most one per usable core."""
    return max(1, min(n_files, len(os.sched_getaffinity(0))))


def from_files(paths: Sequence[str], events: Sequence[NodeEvent], grace_s: float = GRACE_S,
               workers: int | None = None,
               progress: Callable[[int, int], None] | None = None,
               collector: CollectorFactory | None = None) -> History:
    """``collector``: more tallies to fill in the same pass (`History.collected`)."""
    _refuse_repeats(paths)
    planned, named, clusters = plan_windows(paths)
    windows = planned.windows
    events = same_cluster(events, clusters)
    log.info("reading %d accounting file(s), decoding with %s", len(paths),
             acctstream.decoder_name())
    known = _Known.of(events, grace_s)
    read = _read_all(paths, windows, known, collector, workers, progress)
    if read.windows != windows:
        # An export's "meta" was found only past the tail plan_windows looks at: the windows
        # the exports name, that one's included, are planned together now, and where that
        # changes a window (an end lost is the next export's start) every export is read
        # again with the windows planned.
        named = [u if u != w else n for u, w, n in zip(read.windows, windows, named,
                                                         strict=True)]
        planned = _plan(paths, named)
        if planned.windows != read.windows:
            log.warning("an export's \"meta\" was found only when read, and changes the "
                        "windows planned: reading every export again")
            read = _read_all(paths, planned.windows, known, collector, workers, progress)
    for note in planned.notes:
        log.warning("%s", note)
    for note in exportwindows.windowless(paths, read.windows):
        # Alone, nothing can count twice: said, not warned.
        log.log(logging.WARNING if len(paths) > 1 else logging.INFO, "%s", note)
    for note in exportwindows.check_ends(paths, read.windows, read.ends):
        log.warning("%s", note)
    return _history(known, read.att, read.total, events, read.collected,
                    _read_spans(read.windows, read.att.last_end))


@dataclass
class _Read:
    att: Attribution
    total: int
    collected: Collector | None
    windows: list[Window]  # each export's, as read
    ends: list[exportwindows.Span | None]  # each export's runs' first and last end


def _read_all(paths: Sequence[str], windows: Sequence[Window], known: _Known,
              collector: CollectorFactory | None, workers: int | None,
              progress: Callable[[int, int], None] | None) -> _Read:
    out = _Read(Attribution(), 0, collector() if collector is not None else None, [], [])

    def take(i: int, got: Part) -> None:
        part, n, more, used = got
        out.ends.append(_ends(part))
        out.windows.append(used)
        out.att.merge(part)
        if out.collected is not None:
            out.collected.merge(more)
        out.total += n
        if progress:
            progress(i, len(paths))

    workers = workers or workers_for(len(paths))
    if workers > 1 and len(paths) > 1:
        # fork: workers start without re-importing gpuwarden.
        with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
            futures = [pool.submit(_read_one, p, known, collector, w)
                       for p, w in zip(paths, windows, strict=True)]
            try:
                for i, fut in enumerate(futures, 1):
                    take(i, fut.result())
            except BrokenProcessPool:
                pool.shutdown(cancel_futures=True)
                raise HistoryError("a worker reading the history died (out of memory?): "
                                   "split the export into smaller files") from None
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise
    else:
        for i, (p, w) in enumerate(zip(paths, windows, strict=True), 1):
            take(i, _read_one(p, known, collector, w))
    return out


def _ends(att: Attribution) -> exportwindows.Span | None:
    return (att.first_end, att.last_end) if att.first_end <= att.last_end else None


def _read_spans(windows: Sequence[Window], last_end: float) -> tuple[tuple[float, float], ...]:
    """The spans the exports cover, merged; () when one names no start (then unknown). An
    end still open after planning (the newest export's, lost or never given: up to when it
    was exported) is the last run end read."""
    if not windows or any(lo is None for lo, _ in windows):
        return ()
    return exportwindows.merged([(lo, hi if hi is not None else max(lo, last_end))
                                 for lo, hi in windows if lo is not None])


def _slurm_time(at: datetime) -> str:
    # The client runs Slurm's commands with TZ=UTC (gpuwarden.slurm.runner.SLURM_ENV).
    return at.astimezone(UTC).strftime(SLURM_TIME)


SPLIT_FLOOR = timedelta(minutes=15)


class _ClientReader:
    """A SlurmClient's own acct_jobs as an AcctReader (fakes, other backends)."""

    def __init__(self, client: SlurmClient) -> None:
        self._client = client

    def window(self, start: str, end: str) -> Iterator[AcctJob | SlurmError]:
        return self._client.acct_jobs(start, end)


def from_cluster(client: SlurmClient, since: timedelta, grace_s: float = GRACE_S,
                 now: datetime | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 reader: acctstream.AcctReader | None = None,
                 floor: timedelta = SPLIT_FLOOR,
                 collector: CollectorFactory | None = None) -> History:
    """One day per sacct call, so a long scan never asks slurmdbd for everything at once; a
    window sacct cannot answer within its deadline is read again as two halves, down to
    ``floor``. A window's records count only once it has been read whole."""
    end = (now or datetime.now(UTC)).replace(microsecond=0)
    start = end - since
    span = (start.timestamp(), end.timestamp())
    events = client.events(_slurm_time(start), _slurm_time(end))
    known = _Known.of(events, grace_s)
    source = reader or _ClientReader(client)
    att, total = Attribution(), 0
    collected = collector() if collector is not None else None
    days = max(1, -(-int(since.total_seconds()) // 86_400))
    windows: deque[tuple[datetime, datetime]] = deque()
    while start < end:
        windows.append((start, min(start + timedelta(days=1), end)))
        start = windows[-1][1]
    covered = 0.0
    while windows:
        lo, hi = windows.popleft()
        try:
            more = collector() if collector is not None else None
            with paused():
                part, n = _count(Attribution(), chunks(
                    source.window(_slurm_time(lo), _slurm_time(hi))), "", known, more,
                    (lo.timestamp(), hi.timestamp()))
        except CommandTimeoutError as exc:
            if hi - lo <= floor:
                raise HistoryError(f"{exc}, even for {hi - lo} of accounting: slurmdbd is "
                                   "overloaded, or raise [slurm] command_timeout_s") from None
            mid = lo + (hi - lo) / 2
            mid = mid.replace(microsecond=0)
            log.warning("sacct did not answer for %s..%s in time: reading it as two halves",
                        _slurm_time(lo), _slurm_time(hi))
            windows.extendleft([(mid, hi), (lo, mid)])
            continue
        att.merge(part)
        if collected is not None:
            collected.merge(more)
        total += n
        covered += (hi - lo).total_seconds()
        done = days if not windows else min(days, int(covered // 86_400))
        if progress and done:
            progress(done, days)
    return _history(known, att, total, events, collected, (span,))


@paused()  # a million blames and records built at 10M records (`gcpause`)
def from_store(store: str, events: Sequence[NodeEvent] | None = None, grace_s: float = GRACE_S,
               collector: CollectorFactory | None = None,
               since: float | None = None, mttf_only: bool = False) -> History:
    """The history an accounting store holds (`gpuwarden accounting ingest`), the same as
    `from_files` gives for the exports ingested into it. ``events``: None reads the store's
    own; ``since`` (epoch seconds): only the runs that ended from then on. ``mttf_only``: an
    Attribution with only what `mttf.report` reads (`Attribution.blames_on`): no lemon
    scoring from it."""
    # polars: the store's engine, loaded only by the commands that read one.
    try:
        import polars as pl  # noqa: PLC0415
    except ModuleNotFoundError:
        raise HistoryError("reading an accounting store needs polars: pip install "
                           "'gpuwarden[store]'") from None
    from gpuwarden.accounting.store import scan, snapshot  # noqa: PLC0415

    snap = snapshot.opened(store)
    m = snap.manifest
    if not m.exports:
        raise HistoryError(f"{store}: an empty accounting store (nothing ingested yet: "
                           "gpuwarden accounting ingest --from EXPORTS --store DIR)")
    if events is None:
        events = snapshot.events(snap)
    clusters = {e.cluster for e in m.exports if e.cluster}
    events = same_cluster(events, clusters)
    known = _Known.of(events, grace_s)
    att = Attribution(blames_on=drained_nodes(events) if mttf_only else None)
    tally = RangeTally()
    try:
        lf = scan.rows(snap.files, since)
        collected = collector() if collector is not None else None
        scan.attribute(lf, att, known.drains, known.failures, known.clears, grace_s, tally,
                       scan.rolled(snap.files, snap.rollups, since),
                       collected.add_store if collected is not None else None,
                       scan.pieces(snap.files, since))
        spread_exposure(att.exposure, tally)
        total = sum(e.rows for e in m.exports) if since is None else scan.count(lf)
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise HistoryError(f"{store}: a file of the store cannot be read ({exc}); ingest "
                           "the exports again into a new store") from None
    bad = 0
    for e in m.exports:
        if e.malformed:
            att.skipped[f"{e.path}: malformed record"] += e.malformed
            bad += e.malformed
    windows: list[Window] = [e.window for e in m.exports]
    if since is not None:
        windows = [(max(lo, since), hi) for lo, hi in windows if lo is not None
                   and (hi is None or hi > since)] or [(since, None)]
    return _history(known, att, total + bad, events, collected,
                    _read_spans(windows, att.last_end))



def store_events(store: str) -> list[NodeEvent]:
    """The node events an accounting store keeps ([] where none were ingested); StoreError
    for a store or file that cannot be trusted or read."""
    from gpuwarden.accounting.store import snapshot  # noqa: PLC0415

    return snapshot.events(snapshot.opened(store))
