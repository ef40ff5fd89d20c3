"""`gpuwarden accounting sync`: the windows slurmdbd has recorded since the store's last sync,
pulled with `sacct --json` (one day per call, halved when sacct does not answer in time, as
the lemon scan's live read does) into the store, with the node events of the same span.

Each window is kept in the manifest as an export named `slurmdbd:START..END`: its runs are
those that ended in it, so a run still going at the end of one sync is stored by the sync in
which it ends. A window that overlaps an export already ingested is refused, as for files.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gpuwarden.accounting import history
from gpuwarden.accounting import stream as acctstream
from gpuwarden.accounting.store import events as eventstore
from gpuwarden.accounting.store import files, manifest, schema
from gpuwarden.accounting.store.ingest import frames, in_window, key_of, locked, plan
from gpuwarden.accounting.store.manifest import Export, StoreError
from gpuwarden.core.errors import SlurmError
from gpuwarden.slurm.client import SlurmClient
from gpuwarden.slurm.models import AcctJob
from gpuwarden.slurm.runner import CommandTimeoutError

log = logging.getLogger(__name__)

DAY = timedelta(days=1)
FLOOR = timedelta(minutes=15)
FMT = "%Y-%m-%dT%H:%M:%S"  # Slurm's, in UTC (the client runs it with TZ=UTC)


@dataclass(frozen=True)
class Synced:
    windows: int
    rows: int
    events: int
    start: datetime
    end: datetime


def _chunks(items: Iterable[AcctJob | SlurmError],
            size: int = 10_000) -> Iterator[list[AcctJob | SlurmError]]:
    chunk: list[AcctJob | SlurmError] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _pull(reader: acctstream.AcctReader, lo: datetime, hi: datetime,
          store: Path) -> Export:
    bad: list[str] = []
    name = f"slurmdbd:{lo.strftime(FMT)}..{hi.strftime(FMT)}"
    with history.gc_paused():
        got = list(frames(_chunks(reader.window(lo.strftime(FMT), hi.strftime(FMT))), bad))
    import polars as pl  # noqa: PLC0415 - the store's engine

    window = (lo.timestamp(), hi.timestamp())
    df = in_window(pl.concat(got) if got else schema.SCHEMA.to_frame(), window)
    written = files.write_days(store, key_of(name), df)
    if bad:
        log.warning("%s: %d malformed record(s), the first: %s", name, len(bad), bad[0])
    return Export(name, 0, 0, "", window[0], window[1], window, "", df.height, len(bad),
                  bad[0] if bad else "", tuple(written))


def sync(store: str, client: SlurmClient, reader: acctstream.AcctReader, since: timedelta,
         now: datetime | None = None,
         progress: Callable[[int, int], None] | None = None) -> Synced:
    """Pull from the end of the last sync (else ``since`` back) up to ``now``."""
    root = Path(store)
    end = (now or datetime.now(UTC)).replace(microsecond=0)
    with locked(root):
        m = manifest.load(root)
        start = (datetime.fromtimestamp(m.synced_to, UTC) if m.synced_to is not None
                 else end - since)
        if start >= end:
            return Synced(0, 0, 0, start, end)
        windows: deque[tuple[datetime, datetime]] = deque()
        at = start
        while at < end:
            windows.append((at, min(at + DAY, end)))
            at = windows[-1][1]
        # Refused before anything is pulled when the span overlaps an export in the store.
        plan([e.path for e in m.exports] + ["slurmdbd"],
              [e.named for e in m.exports] + [(start.timestamp(), end.timestamp())])
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
            old = eventstore.read(root / m.events) if m.events else []
            merged = eventstore.merged(old, evs)
            ev_name = f"events-{key_of(str(end.timestamp()))}.parquet"
            eventstore.write(root / ev_name, merged)
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
