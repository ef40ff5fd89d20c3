"""`gpuwarden report` at fleet scale: N job records (default 10 million) from the calibrated
simulator, the report timed end to end against reading the same records the lemon scan's way.

- floor (physical): the files read and parsed as JSON and nothing kept (msgspec, the fastest
  maintained parser, validating every byte into no object), with as many worker processes as
  the reader uses: no reader of these exports can be faster;
- baseline: `history.from_files` as `lemon scan` reads (streamed decoding, attribution, its
  worker processes), nothing else: the cost of reading the records at all;
- report: the same read with the report's collector filled in the same pass, then every
  figure (MTTF, outcomes, ETTR, tradeoffs, lemon scoring, drains), the charts and the page.
Each runs in a fresh child process. Goal at 10M: the report in < 60 s and < 20 MB of HTML.
Prints seconds, where they go, the HTML size and the ratio report / baseline.

    .venv/bin/python benchmarks/report_scale.py [--records 10000000] [--nodes 12500]
        [--workdir DIR]   # default: /tmp/gpuwarden-bench/lemon-scale-<params> (shared with
                          # benchmarks/lemon_scale.py, kept for reruns)
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import fleetcache
import msgspec

from gpuwarden.accounting.history import from_files, read_events, workers_for
from gpuwarden.lemon.scoring import ScoreConfig
from gpuwarden.report.build import Options, as_json, build
from gpuwarden.report.collect import Blamable, RunTally
from gpuwarden.report.render import render

GOAL_S, GOAL_MB = 60.0, 20.0


class _Nothing(msgspec.Struct):
    """Every field skipped: the parse, no objects."""


def _parse(path: str) -> int:
    data = Path(path).read_bytes()
    msgspec.json.decode(data, type=_Nothing)
    return len(data)


def floor(files: list[str]) -> dict[str, float]:
    t0 = time.perf_counter()
    with ProcessPoolExecutor(workers_for(len(files)), mp_context=get_context("fork")) as pool:
        list(pool.map(_parse, files))
    return {"read": time.perf_counter() - t0, "workers": workers_for(len(files))}


def baseline(files: list[str], events: str) -> dict[str, float]:
    t0 = time.perf_counter()
    hist = from_files(files, read_events(events))
    return {"read": time.perf_counter() - t0, "records": hist.records}


def report(files: list[str], events: str, out: str) -> dict[str, float]:
    t0 = time.perf_counter()
    evs = read_events(events)
    # As `gpuwarden report` does: the tally keeps only failed runs an event can get blamed.
    hist = from_files(files, evs, collector=RunTally.factory(None, Blamable.of(evs)))
    t1 = time.perf_counter()
    rep = build(hist, Options(f"{len(files)} files"), ScoreConfig())
    t2 = time.perf_counter()
    html = render(rep)
    Path(out).write_text(html, encoding="utf-8")
    Path(out).with_suffix(".json").write_text(as_json(rep), encoding="utf-8")
    t3 = time.perf_counter()
    return {"read": t1 - t0, "figures": t2 - t1, "page": t3 - t2, "total": t3 - t0,
            "records": hist.records, "html_mb": len(html.encode()) / 1e6}


def in_child(fn: object, *args: object) -> dict[str, float]:
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()  # type: ignore[arg-type]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=10_000_000)
    ap.add_argument("--nodes", type=int, default=12_500)
    ap.add_argument("--days", type=int, default=30)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    work = fleetcache.history(args.nodes, args.days, args.records, args.workdir)
    files = [str(f) for f in sorted((work / "sacct").glob("*.json"))]
    events = str(work / "events.txt")
    size = sum(Path(f).stat().st_size for f in files) / 1e9
    print(f"history: {args.records:,} records, {args.nodes} nodes, {len(files)} files, "
          f"{size:.1f} GB")
    low = in_child(floor, files)
    print(f"floor (the JSON parsed, nothing kept, {low['workers']:.0f} workers): "
          f"{low['read']:6.1f} s", flush=True)
    base = in_child(baseline, files, events)
    print(f"baseline (lemon scan's read): {base['read']:6.1f} s, "
          f"{base['records'] / base['read']:,.0f} records/s", flush=True)
    rep = in_child(report, files, events, str(work / "report.html"))
    print(f"gpuwarden report:             {rep['total']:6.1f} s, "
          f"{rep['records'] / rep['total']:,.0f} records/s; HTML {rep['html_mb']:.2f} MB "
          f"({work / 'report.html'})")
    print(f"  read with the collector {rep['read']:.1f} s, figures (incl. lemon scoring) "
          f"{rep['figures']:.1f} s, charts and page {rep['page']:.1f} s")
    ok = rep["total"] < GOAL_S and rep["html_mb"] < GOAL_MB
    print(f"report / baseline = {rep['total'] / base['read']:.2f} (read alone: "
          f"{rep['read'] / base['read']:.2f}); < {GOAL_S:g} s and < {GOAL_MB:g} MB: "
          f"{'PASS' if ok else 'FAIL'}")
    print(f"report / floor = {rep['total'] / low['read']:.2f}; CPU-bound and one file per "
          f"worker: on W cores the read takes about {rep['read'] * low['workers']:.0f} s / W")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
