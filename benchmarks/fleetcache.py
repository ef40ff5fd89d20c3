"""The simulated fleet history the accounting benchmarks share: generated once per
(nodes, days, records) under the system's temp directory and kept for reruns."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from gpuwarden.accounting.calibrate import solve
from gpuwarden.fleet.simulate import Fleet, write_history

CACHE = Path(tempfile.gettempdir()) / "gpuwarden-bench"


def history(nodes: int, days: int, records: int, workdir: str | None = None) -> Path:
    """The history's directory (sacct/*.json, events.txt, truth.json), made when missing or
    when it holds another number of records."""
    work = Path(workdir) if workdir else CACHE / f"lemon-scale-{nodes}n-{days}d-{records}r"
    truth = work / "truth.json"
    if not (truth.exists() and json.loads(truth.read_text())["records"] == records):
        t0 = time.perf_counter()
        write_history(solve(), Fleet(nodes=nodes, days=days, records=records), work,
                      lambda d, n: print(f"\rgenerating day {d}/{n}", end="", file=sys.stderr,
                                         flush=True))
        print(f"\ngenerated in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return work
