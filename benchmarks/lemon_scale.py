"""Lemon scan at fleet scale: 12,500 nodes and 10 million job records, against a one-pass tally.

The history comes from the calibrated simulator (30 day files of `sacct --json`). Two ways to
read it, timed in the same run:
- baseline: one pass, one process: decode each file with the same decoder as the scan
  (acctstream, msgspec where installed), expand each node list, count runs and non-COMPLETED
  runs per node (what a quick script would do; no rules, no statistics), with the same pause
  of Python's cyclic GC that the scan uses, so the ratio is the cost of the analysis over
  merely reading;
- gpuwarden: `lemon scan --from` as shipped (streamed decoding, attribution rules, events,
  scoring), with its worker processes.
Each runs in a fresh child process, so that its peak RSS is its own (the baseline's whole-file
decode is measured apart from the scan's). Goal: the scan in <= 120 s with peak RSS <= 1 GiB
in every process. Prints records/s, peak RSS and the ratio to the baseline.

    .venv/bin/python benchmarks/lemon_scale.py [--nodes 12500] [--records 10000000]
        [--workdir DIR]   # default: /tmp/gpuwarden-bench/lemon-scale-<params>, kept for reruns
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import fleetcache

from gpuwarden.accounting import stream as acctstream
from gpuwarden.accounting.gcpause import paused
from gpuwarden.accounting.history import from_files, read_events
from gpuwarden.lemon.scoring import score
from gpuwarden.slurm.hostlist import expand
from gpuwarden.slurm.models import AcctJob


def baseline(files: list[Path]) -> tuple[int, int]:
    runs: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    for f in files:
        with acctstream.open_regular(str(f)) as fh, paused():
            for job in acctstream.AcctStream(acctstream.text_reader(fh)):
                if not isinstance(job, AcctJob):
                    continue
                nodes = expand(job.nodes)
                runs.update(nodes)
                if job.state != "COMPLETED":
                    failed.update(nodes)
    return len(runs), sum(runs.values())


def _measured(fn: Callable[..., Any], *args: Any) -> tuple[float, Any, float, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    dt = time.perf_counter() - t0
    me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    return dt, out, me, kids


def in_child(fn: Callable[..., Any], *args: Any) -> tuple[float, Any, float, float]:
    """Seconds, result, peak RSS (GiB) of the child and of its largest worker."""
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(_measured, fn, *args).result()


def scan(files: list[Path], events: str) -> tuple[int, list[str], float]:
    t0 = time.perf_counter()
    hist = from_files([str(f) for f in files], read_events(events))
    t_read = time.perf_counter() - t0
    return hist.records, [s.node for s in score(hist.attribution) if s.lemon], t_read


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=12_500)
    ap.add_argument("--records", type=int, default=10_000_000)
    ap.add_argument("--days", type=int, default=30)
    ap.add_argument("--workdir", default=None,
                    help=f"where the generated history is kept (default: under {fleetcache.CACHE})")
    args = ap.parse_args()
    work = fleetcache.history(args.nodes, args.days, args.records, args.workdir)
    files = sorted((work / "sacct").glob("*.json"))
    size = sum(f.stat().st_size for f in files) / 1e9
    print(f"history: {args.records:,} records, {args.nodes} nodes, {len(files)} files, "
          f"{size:.1f} GB")

    t_base, (nodes, node_runs), rss_base, _ = in_child(baseline, files)
    print(f"baseline one-pass tally: {t_base:6.1f} s, {node_runs / t_base:,.0f} node-runs/s, "
          f"peak RSS {rss_base:.2f} GiB ({nodes} nodes, {node_runs:,} node-runs)", flush=True)
    t_scan, (records, lemons, t_read), rss_main, rss_worker = in_child(
        scan, files, str(work / "events.txt"))
    truth_set = set(json.loads((work / "truth.json").read_text())["lemons"])
    found = set(lemons)
    print(f"gpuwarden lemon scan:    {t_scan:6.1f} s, {records / t_scan:,.0f} records/s, peak "
          f"RSS {rss_main:.2f} GiB (main), {rss_worker:.2f} GiB (largest worker) "
          f"({records:,} records, {len(found)} lemons flagged, {len(found & truth_set)} of "
          f"{len(truth_set)} true)")
    print(f"  of which reading {t_read:.1f} s ({records / t_read:,.0f} records/s, decoder: "
          f"{acctstream.decoder_name()}), scoring {t_scan - t_read:.1f} s")
    ok = t_scan <= 120 and max(rss_main, rss_worker) <= 1.0
    print(f"scan / baseline = {t_scan / t_base:.2f}; scan <= 120 s and <= 1 GiB per process: "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
