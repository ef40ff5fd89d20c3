"""The accounting store at fleet scale (issue 36): each goal measured in one run on this host,
printed beside its goal.

    .venv/bin/python benchmarks/accounting_store.py [--records 10000000] [--nodes 12500]
        [--days 30] [--year-records 120000000 | --no-year] [--workdir DIR]

- floor: the exports read and parsed as JSON, nothing kept (msgspec into an empty struct, as
  many worker processes as the ingest uses): no reader of these files can be faster. Every
  export is read once before it (`_warm`), so that the floor and the ingest both read from the
  page cache: on a first run the floor read them from disk, and the ingest came out at 1.48x
  of it, against 3.02x with both warm;
- cold ingest of every day but the last into a new store: / floor (goal <= 1.5x), peak RSS of
  any one process (goal <= 1 GiB);
- from the store: the report (HTML and JSON, every figure), the lemon scan, fleet mttf: seconds
  (wall, judged against the goal; and CPU, steadier on a shared core) and peak RSS (goals
  10 / 10 / 5 s, <= 1 GiB each);
- the last day ingested into the store and the report rendered again (goal <= 15 s);
- a year of the same fleet: the month's store laid end to end (`--year-records` / `--records`
  copies, 12 at the defaults: 360 days), written into the store directly, no JSON; the report
  (goal <= 60 s, <= 2 GiB).
Each step runs in a fresh child process (`spawn`); the exports are cached under
/tmp/gpuwarden-bench (shared with benchmarks/report_scale.py and lemon_scale.py).
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from datetime import UTC, datetime
from functools import partial
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import fleetcache
import msgspec

GIB = 1 << 30


class _Nothing(msgspec.Struct):
    """Every field skipped: the parse, no objects."""


def _parse(path: str) -> int:
    data = Path(path).read_bytes()
    msgspec.json.decode(data, type=_Nothing)
    return len(data)


def _rss() -> float:
    """Peak RSS in bytes of this process and of any one of its children."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, kids) * 1024.0


def _cpu() -> float:
    """CPU seconds of this process and of the children it waited for (user + system): on a
    shared core, steadier than the wall time the goals are judged on. The lemon scoring
    tests half the nodes in a forked child (`accounting.aside`)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _warm(files: list[str]) -> None:
    """Each file read through once (into the page cache), nothing kept."""
    buf = bytearray(1 << 24)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def floor(files: list[str]) -> dict[str, float]:
    from gpuwarden.accounting.history import workers_for  # noqa: PLC0415
    n = workers_for(len(files))
    t0 = time.perf_counter()
    with ProcessPoolExecutor(n, mp_context=get_context("fork")) as pool:
        list(pool.map(_parse, files))
    return {"s": time.perf_counter() - t0, "workers": n, "rss": _rss()}


def cold_ingest(store: str, files: list[str], events: str) -> dict[str, float]:
    from gpuwarden.accounting.history import read_events  # noqa: PLC0415
    from gpuwarden.accounting.store.ingest import ingest  # noqa: PLC0415
    t0 = time.perf_counter()
    got = ingest(store, files, read_events(events))
    return {"s": time.perf_counter() - t0, "rows": got.rows, "rss": _rss()}


def report(store: str, out: str) -> dict[str, float]:
    from gpuwarden.accounting.history import from_store, store_events  # noqa: PLC0415
    from gpuwarden.lemon.scoring import ScoreConfig  # noqa: PLC0415
    from gpuwarden.report.build import Options, as_json_bytes, begin, scored  # noqa: PLC0415
    from gpuwarden.report.collect import Blamable, RunTally  # noqa: PLC0415
    from gpuwarden.report.output import write_all  # noqa: PLC0415
    from gpuwarden.report.render import page  # noqa: PLC0415
    t0, c0 = time.perf_counter(), _cpu()
    hist = from_store(store, collector=RunTally.factory(None, Blamable.of(store_events(store))))
    draft = begin(hist, Options(f"the store {store}"))
    # As the command does: the history let go before the JSON is made as it is written.
    rep, data, html = page(draft, partial(scored, draft, hist, ScoreConfig()))
    records = hist.records
    del hist, draft
    write_all([(str(Path(out).with_suffix(".json")), lambda: (as_json_bytes(rep, data),)),
               (out, html)])
    return {"s": time.perf_counter() - t0, "cpu": _cpu() - c0, "records": records,
            "rss": _rss()}


def lemon_scan(store: str) -> dict[str, float]:
    from gpuwarden.accounting.history import from_store  # noqa: PLC0415
    from gpuwarden.lemon.scoring import ScoreConfig, score  # noqa: PLC0415
    t0, c0 = time.perf_counter(), _cpu()
    hist = from_store(store)
    lemons = sum(s.lemon for s in score(hist.attribution, ScoreConfig()))
    return {"s": time.perf_counter() - t0, "cpu": _cpu() - c0, "lemons": lemons, "rss": _rss()}


def fleet_mttf(store: str) -> dict[str, float]:
    from gpuwarden.accounting.history import from_store  # noqa: PLC0415
    from gpuwarden.accounting.mttf import report as mttf  # noqa: PLC0415
    t0, c0 = time.perf_counter(), _cpu()
    hist = from_store(store, mttf_only=True)
    rep = mttf(hist.attribution, hist.events, 8, 30.0, (16384, 131072), windows=hist.windows)
    return {"s": time.perf_counter() - t0, "cpu": _cpu() - c0, "failures": rep.failures,
            "rss": _rss()}


def new_day(store: str, day: str, out: str) -> dict[str, float]:
    from gpuwarden.accounting.store.ingest import ingest  # noqa: PLC0415
    t0 = time.perf_counter()
    got = ingest(store, [day])
    t1 = time.perf_counter()
    rep = report(store, out)
    return {"s": time.perf_counter() - t0, "ingest": t1 - t0, "rows": got.rows,
            "rss": max(_rss(), rep["rss"])}


def year_store(store: str, month: str, copies: int) -> dict[str, float]:
    """A year of the same fleet: the month's store (simulated, ingested from its exports) laid
    end to end ``copies`` times, each copy's times moved on by the month's span and its job
    ids by the month's largest, its node events likewise. Written into the store directly
    (no JSON: 230 GB of exports for 120M records); the simulator alone would take about
    23 us a record here (46 minutes), the copies take a minute."""
    from gpuwarden.accounting.store import storedir  # noqa: PLC0415
    with storedir.writing(store) as root:
        return _write_year(root, month, copies)


def _write_year(root: Any, month: str, copies: int) -> dict[str, float]:
    import polars as pl  # noqa: PLC0415

    from gpuwarden.accounting.store import events as eventstore  # noqa: PLC0415
    from gpuwarden.accounting.store import files, manifest, snapshot  # noqa: PLC0415
    from gpuwarden.accounting.store.ingest import key_of  # noqa: PLC0415
    from gpuwarden.slurm.models import NodeEvent  # noqa: PLC0415
    t0 = time.perf_counter()
    snap = snapshot.opened(month)
    m = snap.manifest
    lo = min(e.lo for e in m.exports if e.lo is not None)
    hi = max(e.hi for e in m.exports if e.hi is not None)
    span = int(hi - lo)
    base = Path(month)
    top = int(pl.scan_parquet([str(base / f) for f in m.files]).select(
        pl.col("job_id").max()).collect().item()) + 1
    evs = snapshot.events(snap)
    fmt = "%Y-%m-%dT%H:%M:%S"

    def moved(t: str, by: int) -> str:
        if not t[:1].isdigit():
            return t  # "Unknown", "None"
        return datetime.fromtimestamp(datetime.strptime(t, fmt).replace(tzinfo=UTC).timestamp()
                                      + by, UTC).strftime(fmt)

    exports, out_events, rows = [], [], 0
    for k in range(copies):
        by = k * span
        for e in m.exports:
            df = pl.read_parquet([str(base / f) for f in e.files]).with_columns(
                pl.col("job_id") + k * top,
                *(pl.col(c) + by for c in ("submit_time", "start_time", "end_time")))
            written = files.write_days(root, f"c{k:02d}{key_of(e.path)}", df)
            exports.append(manifest.Export(
                f"{e.path}#copy{k}", e.size, e.mtime_ns, e.fingerprint, _later(e.lo, by),
                _later(e.hi, by), (_later(e.named[0], by), _later(e.named[1], by)), e.cluster,
                df.height, 0, "", tuple(written)))
            rows += df.height
        out_events += [NodeEvent(ev.cluster, ev.node, moved(ev.start, by), moved(ev.end, by),
                                 ev.state, ev.reason, ev.user) for ev in evs
                       if k == 0 or ev.node]  # the cluster's registration once
        print(f"\ryear store: copy {k + 1}/{copies}", end="", file=sys.stderr, flush=True)
    eventstore.write(root, "events-year.parquet", out_events)
    manifest.save(root, manifest.Manifest(tuple(exports), "events-year.parquet"))
    print(file=sys.stderr)
    return {"s": time.perf_counter() - t0, "rows": rows, "days": copies * span / 86_400}


def _later(t: float | None, by: int) -> float | None:
    return None if t is None else t + by


def in_child(fn: Callable[..., dict[str, float]], *args: Any) -> dict[str, float]:
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _line(what: str, got: str, goal: str, ok: bool) -> str:
    return f"{what:<46} {got:>26}   goal {goal:<18} {'PASS' if ok else 'FAIL'}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=10_000_000)
    ap.add_argument("--nodes", type=int, default=12_500)
    ap.add_argument("--days", type=int, default=30)
    ap.add_argument("--year-records", type=int, default=120_000_000)
    ap.add_argument("--no-year", action="store_true", help="leave the year case out")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    work = fleetcache.history(args.nodes, args.days, args.records, args.workdir)
    files = [str(f) for f in sorted((work / "sacct").glob("*.json"))]
    events = str(work / "events.txt")
    store = work / "store"
    shutil.rmtree(store, ignore_errors=True)
    size = sum(Path(f).stat().st_size for f in files[:-1]) / 1e9
    print(f"history: {args.records:,} records, {args.nodes} nodes, {len(files)} daily exports "
          f"({size:.1f} GB before the last day)", flush=True)
    _warm(files)
    low = in_child(floor, files[:-1])
    cold = in_child(cold_ingest, str(store), files[:-1], events)
    ratio = cold["s"] / low["s"]
    rows = [
        _line(f"cold ingest ({len(files) - 1} days) / JSON floor",
              f"{cold['s']:.1f} s / {low['s']:.1f} s = {ratio:.2f}x", "<= 1.5x", ratio <= 1.5),
        _line("cold ingest peak RSS (any one process)", f"{cold['rss'] / GIB:.2f} GiB",
              "<= 1 GiB", cold["rss"] <= GIB)]
    print("\n".join(rows), flush=True)
    html = str(work / "store-report.html")
    for name, fn, fargs, goal_s, goal_rss in (
            ("report from the store", report, (str(store), html), 10.0, GIB),
            ("lemon scan from the store", lemon_scan, (str(store),), 10.0, GIB),
            ("fleet mttf from the store", fleet_mttf, (str(store),), 5.0, GIB)):
        got = in_child(fn, *fargs)
        rows += [_line(name, f"{got['s']:.1f} s ({got['cpu']:.1f} CPU), "
                       f"{got['rss'] / GIB:.2f} GiB",
                       f"<= {goal_s:g} s, 1 GiB", got["s"] <= goal_s and got["rss"] <= goal_rss)]
        print(rows[-1], flush=True)
    day = in_child(new_day, str(store), files[-1], html)
    rows += [_line("one new day ingested + the report again",
                   f"{day['s']:.1f} s ({day['ingest']:.1f} s ingest)", "<= 15 s",
                   day["s"] <= 15)]
    print(rows[-1], flush=True)
    if not args.no_year:
        copies = max(1, round(args.year_records / max(1, args.records)))
        year = fleetcache.CACHE / f"store-year-{args.nodes}n-{args.records}r-x{copies}"
        if not (year / "manifest.json").exists():
            shutil.rmtree(year, ignore_errors=True)
            made = in_child(year_store, str(year), str(store), copies)
            print(f"year store written in {made['s']:.0f} s ({made['rows']:,} rows, "
                  f"{made['days']:.0f} days: the month {copies} times)", file=sys.stderr)
        got = in_child(report, str(year), str(year.with_suffix(".html")))
        rows += [_line(f"a year ({got['records']:,.0f} records): report",
                       f"{got['s']:.1f} s ({got['cpu']:.1f} CPU), {got['rss'] / GIB:.2f} GiB",
                       "<= 60 s, 2 GiB", got["s"] <= 60 and got["rss"] <= 2 * GIB)]
        print(rows[-1], flush=True)
    print("\nsummary (this host, " + f"{len(__import__('os').sched_getaffinity(0))} cores):")
    print("\n".join(rows))
    return 0 if all(r.endswith("PASS") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
