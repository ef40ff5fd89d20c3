"""`gpuwarden accounting sync`: the windows slurmdbd has recorded since the store's last sync,
pulled with `sacct --json` (one day per call, halved when sacct does not answer in time, as
the lemon scan's live read does) into the store, with the node events of the same span.

Each window is kept in the manifest as an export named `slurmdbd:START..END`: its runs are
those that ended in it, so a run still going at the end of one sync is stored by the sync in
which it ends. A sync reads only up to ``settle`` (`[accounting] sync_settle_s`) before now:
slurmctld hands a finished run to slurmdbd through its agent queue, so the last minutes are
not complete yet, and the next sync starts where this one stopped (a run recorded later than
that is missed: the settle must exceed slurmdbd's lag). Spans the store already holds from
exports (`accounting ingest`) are skipped: only the gaps between them are pulled.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from gpuwarden.accounting import history
from gpuwarden.accounting import stream as acctstream
from gpuwarden.accounting.gcpause import paused
from gpuwarden.accounting.store import events as eventstore
from gpuwarden.accounting.store import files, manifest, schema, storedir, upgrade
from gpuwarden.accounting.store.ingest import frames, in_window, key_of, locked
from gpuwarden.accounting.store.manifest import Export
from gpuwarden.accounting.store.storedir import Dir, StoreError
from gpuwarden.slurm.client import SlurmClient
from gpuwarden.slurm.runner import CommandTimeoutError

log = logging.getLogger(__name__)

DAY = timedelta(days=1)
FLOOR = timedelta(minutes=15)
SETTLE = timedelta(seconds=900)  # `[accounting] sync_settle_s`'s default
FMT = "%Y-%m-%dT%H:%M:%S"  # Slurm's, in UTC (the client runs it with TZ=UTC)


@dataclass(frozen=True)
class Synced:
    windows: int
    rows: int
    events: int
    start: datetime
    end: datetime


def _pull(reader: acctstream.AcctReader, lo: datetime, hi: datetime,
          store: Dir) -> Export:
    bad: list[str] = []
    name = f"slurmdbd:{lo.strftime(FMT)}..{hi.strftime(FMT)}"
    with paused():
        got = list(frames(history.chunks(reader.window(lo.strftime(FMT), hi.strftime(FMT)), 10_000), bad))
    import polars as pl  # noqa: PLC0415 - the store's engine

    window = (lo.timestamp(), hi.timestamp())
    df = in_window(pl.concat(got) if got else schema.SCHEMA.to_frame(), window)
    written = files.write_days(store, key_of(name), df)
    if bad:
        log.warning("%s: %d malformed record(s), the first: %s", name, len(bad), bad[0])
    return Export(name, 0, 0, "", window[0], window[1], window, "", df.height, len(bad),
                  bad[0] if bad else "", tuple(written))


def gaps(start: float, end: float, exports: Sequence[Export]) -> list[tuple[float, float]]:
    """The parts of [start, end) no export's window holds, in order. An export that names no
    window is not one (as when exports are planned); one whose window has no end cannot be
    synced after: StoreError, saying how to give it one."""
    held: list[tuple[float, float]] = []
    for e in exports:
        if e.window == (None, None):
            continue
        if e.hi is None:
            raise StoreError(
                f"{e.path}: its window names no end (an end such as 'now', or one Slurm "
                "before 26.05.2 dropped from the command), so a sync cannot tell where it "
                "stops and would count its runs twice: export that span again with an "
                "absolute --endtime (and --json last), ingest it under the same path (it "
                "replaces the old one), then sync")
        held.append((-math.inf if e.lo is None else e.lo, e.hi))
    out: list[tuple[float, float]] = []
    at = start
    for lo, hi in sorted(held):
        if lo > at:
            out.append((at, min(lo, end)))
        at = max(at, hi)
        if at >= end:
            break
    if at < end:
        out.append((at, end))
    return [(a, b) for a, b in out if a < b]


def _days(spans: Sequence[tuple[float, float]]) -> deque[tuple[datetime, datetime]]:
    """Each span as windows of at most a day (a `sacct --json` call each)."""
    out: deque[tuple[datetime, datetime]] = deque()
    for a, b in spans:
        at, end = datetime.fromtimestamp(a, UTC), datetime.fromtimestamp(b, UTC)
        while at < end:
            out.append((at, min(at + DAY, end)))
            at = out[-1][1]
    return out


def sync(store: str, client: SlurmClient, reader: acctstream.AcctReader, since: timedelta,
         now: datetime | None = None,
         progress: Callable[[int, int], None] | None = None,
         settle: timedelta = SETTLE) -> Synced:
    """Pull from the end of the last sync (else ``since`` back) up to ``settle`` before
    ``now``, skipping what the store's exports hold."""
    end = ((now or datetime.now(UTC)) - settle).replace(microsecond=0)
    with locked(store) as root:
        m = upgrade.upgraded(root, manifest.load_at(root, upgradable=True))
        start = (datetime.fromtimestamp(m.synced_to, UTC) if m.synced_to is not None
                 else end - since)
        if start >= end:
            return Synced(0, 0, 0, start, end)
        windows = _days(gaps(start.timestamp(), end.timestamp(), m.exports))
        pulled: list[Export] = []
        total = len(windows)
        try:
            while windows:
                lo, hi = windows.popleft()
                try:
                    pulled.append(_pull(reader, lo, hi, root))
                except CommandTimeoutError as exc:
                    if hi - lo <= FLOOR:
                        raise StoreError(f"{exc}, even for {hi - lo} of accounting: slurmdbd "
                                         "is overloaded, or raise [slurm] command_timeout_s"
                                         ) from None
                    mid = (lo + (hi - lo) / 2).replace(microsecond=0)
                    log.warning("sacct did not answer for %s..%s in time: reading it as two "
                                "halves", lo.strftime(FMT), hi.strftime(FMT))
                    windows.extendleft([(mid, hi), (lo, mid)])
                    total += 1
                    continue
                if progress:
                    progress(len(pulled), total)
            evs = client.events((start - DAY).strftime(FMT), end.strftime(FMT))
            old = eventstore.read(*storedir.vetted(root, [m.events])) if m.events else []
            merged = eventstore.merged(old, evs)
            ev_name = f"events-{key_of(str(end.timestamp()))}.parquet"
            eventstore.write(root, ev_name, merged)
            new = replace(m, exports=m.exports + tuple(pulled), events=ev_name,
                          synced_to=end.timestamp())
            manifest.save(root, new)
        except BaseException:
            files.remove(root, [f for e in pulled for f in e.files])
            raise
        files.sweep(root, {*new.files, new.events})
    rows = sum(e.rows for e in pulled)
    log.info("synced %s..%s: %d rows, %d node events in the store", start.strftime(FMT),
             end.strftime(FMT), rows, len(merged))
    return Synced(len(pulled), rows, len(merged), start, end)
