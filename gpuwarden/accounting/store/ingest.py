"""`gpuwarden accounting ingest`: `sacct --json` exports into the store, each read once.

An export already in the store and unchanged (same path, size, mtime and fingerprint) is
skipped at the cost of a stat and two small reads. One whose file changed (re-exported) has
its rows replaced. Exports are planned together with those in the store, as the readers plan
exports given together (`accounting.windows`): windows that overlap are refused, naming both,
and nothing is written; an export whose end was lost ends at the next one's start (its rows
past that are dropped, said). A run is stored once: where it ended, in its export's window.
Writes are atomic: new files first (names no manifest holds), the manifest last, then the
replaced files removed.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from multiprocessing import get_context

import polars as pl

from gpuwarden.accounting import history
from gpuwarden.accounting import stream as acctstream
from gpuwarden.accounting import windows as exportwindows
from gpuwarden.accounting.gcpause import paused
from gpuwarden.accounting.store import events as eventstore
from gpuwarden.accounting.store import files, manifest, schema, storedir, upgrade
from gpuwarden.accounting.store.manifest import Export, Manifest
from gpuwarden.accounting.store.storedir import Dir, StoreError
from gpuwarden.core.errors import SlurmError
from gpuwarden.slurm import dataparser, parse
from gpuwarden.slurm.models import AcctJob, NodeEvent

log = logging.getLogger(__name__)

Window = tuple[float | None, float | None]
BATCH = 100_000  # records per frame while reading


@dataclass(frozen=True)
class Ingested:
    added: tuple[str, ...]
    replaced: tuple[str, ...]
    unchanged: tuple[str, ...]
    rows: int  # rows written
    events: int  # node events in the store after
    store: Manifest


@contextmanager
def locked(store: str | os.PathLike[str]) -> Iterator[Dir]:
    """The store open to write (made 0750 when missing, refused unless ours alone: `storedir`),
    one writer at a time (a timer's sync and a hand ingest)."""
    with storedir.writing(store) as d, storedir.locked(d):
        yield d


def key_of(path: str) -> str:
    return "e" + hashlib.blake2b(path.encode(), digest_size=6).hexdigest()


@dataclass(frozen=True)
class _Read:
    path: str
    window: Window
    named: Window
    cluster: str
    rows: int
    malformed: int
    first_bad: str
    files: tuple[str, ...]


def frames(batches: Iterable[Sequence[AcctJob | SlurmError | acctstream.AcctRecord]],
           bad: list[str]) -> Iterator[pl.DataFrame]:
    """Record batches as store frames; malformed records' messages go to ``bad``."""
    held: list[acctstream.AcctRecord] = []
    for batch in batches:
        # A batch's types first: most hold no error, and are taken whole.
        if any(issubclass(t, SlurmError) for t in set(map(type, batch))):
            for r in batch:
                if isinstance(r, SlurmError):
                    bad.append(str(r))
                else:
                    held.append(r)
        else:
            held += batch  # type: ignore[arg-type]
        if len(held) >= BATCH:
            yield schema.frame(held, bad)
            held = []
    if held:
        yield schema.frame(held, bad)


def in_window(df: pl.DataFrame, window: Window) -> pl.DataFrame:
    """The runs that ended in ``window`` (`Columns.ended_in`); every run without one."""
    lo, hi = window
    if lo is None and hi is None:
        return df
    end = pl.col("end_time")
    keep = end.is_not_null() & (end > 0) & (end >= (lo or 0.0))
    if hi is not None:
        keep &= end < hi
    return df.filter(keep)


def _read_export_at(store: str, path: str, window: Window) -> _Read:
    """`_read_export` in a worker process: the store reopened through safefs's walk."""
    with storedir.writing(store) as d:
        return _read_export(d, path, window)


def _read_export(store: Dir, path: str, window: Window) -> _Read:
    with paused():
        try:
            with acctstream.open_regular(path) as fh:
                meta = acctstream.file_meta(fh)
                version = None if meta is None else dataparser.version(meta)
                stream = acctstream.AcctStream(acctstream.text_reader(fh), "sacct --json",
                                               version=version)
                bad: list[str] = []
                parts = list(frames(stream.run_batches(), bad))
        except OSError as exc:
            raise StoreError(f"{path}: cannot read ({exc.strerror})") from None
        except SlurmError as exc:
            raise StoreError(f"{path}: {exc} (expected `sacct --json` output)") from None
    named = parse.acct_window(stream.top) if meta is None else parse.acct_window({"meta": meta})
    used = named if window == (None, None) else window
    top_meta = stream.top.get("meta", meta)
    slurm = top_meta.get("slurm") if isinstance(top_meta, dict) else None
    cluster = slurm.get("cluster") if isinstance(slurm, dict) else None
    df = in_window(pl.concat(parts) if parts else schema.SCHEMA.to_frame(), used)
    written = files.write_days(store, key_of(path), df)
    return _Read(path, used, named, cluster if isinstance(cluster, str) else "", df.height,
                 len(bad), bad[0] if bad else "", tuple(written))


def plan(paths: Sequence[str], named: Sequence[Window]) -> exportwindows.Planned:
    try:
        return exportwindows.plan(paths, named)
    except exportwindows.OverlapError as exc:
        raise StoreError(f"{exc}; nothing was ingested") from None


def _stat(path: str) -> tuple[int, int, str]:
    try:
        st = os.stat(path)
        return st.st_size, st.st_mtime_ns, manifest.fingerprint(path, st.st_size)
    except OSError as exc:
        raise StoreError(f"{path}: cannot read ({exc.strerror})") from None


def _restrict(store: Dir, e: Export, window: Window) -> Export:
    """An export in the store whose window shrank (its lost end is now the next export's
    start): its rows past the new end dropped, its files rewritten."""
    if not e.files:
        return replace(e, lo=window[0], hi=window[1])
    df = in_window(pl.read_parquet(storedir.vetted(store, e.files), glob=False), window)
    written = files.write_days(store, key_of(e.path), df)
    log.warning("%s: its window now ends at the next export's start: %d of its %d rows "
                "dropped", e.path, e.rows - df.height, e.rows)
    return replace(e, lo=window[0], hi=window[1], rows=df.height, files=tuple(written))


def ingest(store: str | os.PathLike[str], paths: Sequence[str],
           events: Sequence[NodeEvent] | None = None, workers: int | None = None,
           progress: Callable[[int, int], None] | None = None) -> Ingested:
    """``paths``: export files; ``events``: node events to merge into the store's."""
    with locked(store) as root:
        return _ingest(root, [os.path.realpath(p) for p in paths], events, workers, progress)


def _ingest(root: Dir, paths: list[str], events: Sequence[NodeEvent] | None,
            workers: int | None, progress: Callable[[int, int], None] | None) -> Ingested:
    m = upgrade.upgraded(root, manifest.load_at(root, upgradable=True))
    if len(set(paths)) < len(paths):
        raise StoreError("an export named twice (a repeated --from, overlapping globs): give "
                         "each export once")
    known = {e.path: e for e in m.exports}
    todo: list[str] = []
    unchanged: list[str] = []
    replaced: list[str] = []
    stats = {}
    for p in paths:
        stats[p] = _stat(p)
        e = known.get(p)
        if e is not None and e.same_file(*stats[p]):
            unchanged.append(p)
            log.info("%s: unchanged since ingested: skipped", p)
        else:
            if e is not None:
                replaced.append(p)
                log.warning("%s: changed since it was ingested: its rows are replaced", p)
            todo.append(p)
    kept = [e for e in m.exports if e.path not in set(todo)]
    # Planned with the store's exports, by the windows each names, before anything is read.
    _, named, _ = history.plan_windows(todo)
    everything = [e.path for e in kept] + todo
    planned = plan(everything, [e.named for e in kept] + named)
    reads = _read_all(root, todo, planned.windows[len(kept):], workers, progress)
    written = [f for r in reads for f in r.files]
    try:
        if any(r.named != n for r, n in zip(reads, named, strict=True)):
            # A "meta" found only at an export's end names its window now: planned again.
            planned = plan(everything, [e.named for e in kept] + [r.named for r in reads])
            if planned.windows[len(kept):] != [r.window for r in reads]:
                raise StoreError("an export's window was found only at its end and changes "
                                 "the plan: ingest it again (it is read with its window now)")
        for note in planned.notes:
            log.warning("%s", note)
        for note in exportwindows.windowless(todo, [r.window for r in reads]):
            log.warning("%s", note)
        now = [_restrict(root, e, w) if e.window != w else e
               for e, w in zip(kept, planned.windows[: len(kept)], strict=True)]
        entries = [Export(r.path, *stats[r.path], r.window[0], r.window[1], r.named, r.cluster,
                          r.rows, r.malformed, r.first_bad, r.files) for r in reads]
        for r in reads:
            if r.malformed:
                log.warning("%s: %d malformed record(s), the first: %s", r.path, r.malformed,
                            r.first_bad)
        ev_name, n_events = m.events, 0
        if events is not None:
            old = eventstore.read(*storedir.vetted(root, [m.events])) if m.events else []
            merged = eventstore.merged(old, events)
            ev_name = f"events-{os.urandom(4).hex()}.parquet"
            eventstore.write(root, ev_name, merged)
            n_events = len(merged)
        new = replace(m, exports=tuple(now) + tuple(entries), events=ev_name)
        manifest.save(root, new)
    except BaseException:
        files.remove(root, written)
        raise
    files.sweep(root, {*new.files, new.events})
    for r in reads:
        log.info("%s: %d rows stored (window %s)", r.path, r.rows, _shown(r.window))
    return Ingested(tuple(p for p in todo if p not in replaced), tuple(replaced),
                    tuple(unchanged), sum(r.rows for r in reads), n_events, new)


def _shown(w: Window) -> str:
    lo, hi = w
    return f"{_iso(lo) if lo is not None else 'open'} to {_iso(hi) if hi is not None else 'open'}"


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S")


def _read_all(root: Dir, paths: list[str], windows: Sequence[Window], workers: int | None,
              progress: Callable[[int, int], None] | None) -> list[_Read]:
    out: list[_Read] = []
    n = workers or history.workers_for(len(paths))
    try:
        if n > 1 and len(paths) > 1:
            # Spawned, not forked: a child forked while polars' threads run (the parent read
            # the store, or a test did) inherits their locks held and hangs for good. A spawned
            # child cannot inherit the store's descriptor: it reopens the store the same vetted
            # way (`_read_export_at`).
            with ProcessPoolExecutor(n, mp_context=get_context("spawn")) as pool:
                futures = [pool.submit(_read_export_at, str(root.path), p, w)
                           for p, w in zip(paths, windows, strict=True)]
                try:
                    for fut in futures:
                        out.append(fut.result())
                        if progress:
                            progress(len(out), len(paths))
                except BaseException:
                    pool.shutdown(cancel_futures=True)
                    raise
        else:
            for p, w in zip(paths, windows, strict=True):
                out.append(_read_export(root, p, w))
                if progress:
                    progress(len(out), len(paths))
    except BaseException:
        files.remove(root, [f for r in out for f in r.files])
        raise
    return out
