"""Lemon scan at fleet scale: 2,000 nodes and 4 million job records, against a one-pass tally.

The history comes from the calibrated simulator (30 day files of `sacct --json`). Two ways to
read it, timed in the same run:
- baseline: one pass, one process: json.load each file, expand each node list, count runs and
  non-COMPLETED runs per node (what a quick script would do; no rules, no statistics), with
  the same pause of Python's cyclic GC while decoding that the scan uses (without it, decoding
  alone takes 4-5x longer, and the comparison would flatter the scan);
- gpuwarden: `lemon scan --from` as shipped (attribution rules, events, scoring), with its
  worker processes.
Goal: the scan under 60 s on this machine. Prints both times and their ratio.

    .venv/bin/python benchmarks/lemon_scale.py [--nodes 2000] [--records 4000000]
        [--workdir DIR]   # keeps the generated history for reruns
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from gpuwarden.fleet.calibrate import solve
from gpuwarden.fleet.simulate import Fleet, write_history
from gpuwarden.lemon.history import from_files, gc_paused, read_events
from gpuwarden.lemon.scoring import score
from gpuwarden.slurm.hostlist import expand


def baseline(files: list[Path]) -> tuple[int, int]:
    runs: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    for f in files:
        with f.open(encoding="utf-8") as fh, gc_paused():
            doc = json.load(fh)
        for job in doc["jobs"]:
            nodes = expand(job["nodes"])
            runs.update(nodes)
            if job["state"]["current"][0] != "COMPLETED":
                failed.update(nodes)
    return len(runs), sum(runs.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--records", type=int, default=4_000_000)
    ap.add_argument("--days", type=int, default=30)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    tmp = None
    if args.workdir:
        work = Path(args.workdir)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="gpuwarden-scale-")
        work = Path(tmp.name)
    truth = work / "truth.json"
    if not (truth.exists() and json.loads(truth.read_text())["records"] == args.records):
        t0 = time.perf_counter()
        write_history(solve(), Fleet(nodes=args.nodes, days=args.days, records=args.records),
                      work, lambda d, n: print(f"\rgenerating day {d}/{n}", end="",
                                                 file=sys.stderr, flush=True))
        print(f"\ngenerated in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    files = sorted((work / "sacct").glob("*.json"))
    size = sum(f.stat().st_size for f in files) / 1e9
    print(f"history: {args.records:,} records, {args.nodes} nodes, {len(files)} files, "
          f"{size:.1f} GB")

    t0 = time.perf_counter()
    nodes, node_runs = baseline(files)
    t_base = time.perf_counter() - t0
    print(f"baseline one-pass tally: {t_base:6.1f} s ({nodes} nodes, {node_runs:,} node-runs)",
          flush=True)

    t0 = time.perf_counter()
    hist = from_files([str(f) for f in files], read_events(str(work / "events.txt")))
    lemons = [s for s in score(hist.attribution) if s.lemon]
    t_scan = time.perf_counter() - t0
    truth_set = set(json.loads(truth.read_text())["lemons"])
    found = {s.node for s in lemons}
    print(f"gpuwarden lemon scan:    {t_scan:6.1f} s ({hist.records:,} records, "
          f"{len(found)} lemons flagged, {len(found & truth_set)} of {len(truth_set)} true)")
    ok = t_scan < 60
    print(f"scan / baseline = {t_scan / t_base:.2f}; scan {'<' if ok else '>='} 60 s: "
          f"{'PASS' if ok else 'FAIL'}")
    if tmp:
        tmp.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
