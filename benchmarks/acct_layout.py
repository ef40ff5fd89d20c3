"""Does the layout of a `sacct --json` export change how long the lemon scan takes to read it?

The same records (tests/fixtures/sacct.json's, renumbered) are written to files as Slurm
prints them (two-space indent), compact (`jq -c`), and with newlines but no indent, then read
with the stream reader a scan uses (acctstream, msgspec where installed), each timed in the
same run (median of --repeat reads). Prints each time and its ratio to Slurm's layout; the
goal is at most 2x for every layout of sacct's records (before the span finder, 20,000
records: compact 43x, newlines without indent 26x).

A fourth file, "nested like records", is compact with a list of objects in each record whose
first key is the records' own ("account"), which sacct's records never have: the text between
two records is then inside every record too, and the reader finds each record's end by
scanning, its slowest route. It is printed apart, with no goal but linear cost (it was 205x).

    .venv/bin/python benchmarks/acct_layout.py [--records 20000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuwarden.accounting import stream as acctstream
from gpuwarden.accounting.gcpause import paused

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "sacct.json"


def records(n: int, nested: bool) -> dict[str, Any]:
    base = json.loads(FIXTURE.read_text())
    jobs = []
    for i in range(n):
        rec = copy.deepcopy(base["jobs"][i % len(base["jobs"])])
        rec["job_id"] = i + 1
        if nested:
            rec["licenses_used"] = [{"account": f"a{k}", "count": k} for k in range(8)]
        jobs.append(rec)
    return {"jobs": jobs, "meta": base["meta"], "errors": [], "warnings": []}


LAYOUTS: dict[str, tuple[bool, Callable[[dict[str, Any]], str]]] = {
    "slurm (indent 2)": (False, lambda d: json.dumps(d, indent=2)),
    "compact": (False, lambda d: json.dumps(d, separators=(",", ":"))),
    "newlines, no indent": (False, lambda d: json.dumps(d, indent=0)),
    "nested like records": (True, lambda d: json.dumps(d, separators=(",", ":"))),
}


def read(path: Path) -> int:
    n = 0
    with acctstream.open_regular(str(path)) as fh, paused():
        for _ in acctstream.AcctStream(acctstream.text_reader(fh)).runs():
            n += 1
    return n


def timed(path: Path, repeat: int, want: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        got = read(path)
        times.append(time.perf_counter() - t0)
        if got != want:
            raise SystemExit(f"{path.name}: read {got} records, expected {want}")
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"{args.records} records, decoding with {acctstream.decoder_name()}")
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for i, (name, (nested, dump)) in enumerate(LAYOUTS.items()):
            paths[name] = Path(tmp) / f"layout{i}.json"
            paths[name].write_text(dump(records(args.records, nested)))
        times = {name: timed(p, args.repeat, args.records) for name, p in paths.items()}
        ref = times["slurm (indent 2)"]
        for name, t in times.items():
            size = paths[name].stat().st_size / 1e6
            print(f"  {name:22s} {size:7.1f} MB  {t * 1e3:8.1f} ms  {size / t:6.0f} MB/s  "
                  f"ratio {t / ref:5.2f}")
        worst = max(t / ref for name, t in times.items() if name != "nested like records")
        print(f"compact / indented: {times['compact'] / ref:.2f}   "
              f"worst layout of sacct's records / indented: {worst:.2f} (goal <= 2.0)")


if __name__ == "__main__":
    main()
