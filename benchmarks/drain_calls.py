"""Slurm calls, whole node-table loads and bytes read per drain decision, against cluster size.

The real CliSlurmClient and the real gate talk to a stand-in slurmctld (tests/ctld.py) that
answers in the JSON shapes captured from the 24.11 test cluster and counts every command, every
byte it prints, and every read for which slurmctld packs its WHOLE node table: in 24.11 every
`scontrol show node[s]` (scontrol_load_nodes, filtered client-side) and every sinfo but
`sinfo -n ONE` (slurm_load_node_single). What slurmctld sends for such a load grows with the
cluster whatever is printed, so "table loads" is the column that matters on big clusters.
Three cases per size: a drain within the cap, a node held back at the cap
(what every further node does in a cluster-wide transient), and a drain undone because another
one landed in the same second. Baseline, from the same run: what the earlier protocol read for
one drain (`scontrol show nodes --json` of every node, twice).

    .venv/bin/python benchmarks/drain_calls.py [--sizes 16,1000,10000]
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))




from gpuwarden.slurm import drain
from gpuwarden.slurm.client import CliSlurmClient
from gpuwarden.slurm.drain_cap import BlastRadius
from gpuwarden.slurm.settings import SlurmConfig
from tests.ctld import FakeCtld

CAP = BlastRadius(max_drained_pct=10.0, settle_s=0)
DRAIN = drain.Decision(drain.Kind.DRAIN, "xid 79 on GPU 5", 0)


def measure(ctld: FakeCtld, name: str) -> tuple[str, int, int, int]:
    """(outcome, calls, table loads, bytes) of one drain decision for ``name``, its own first
    read excluded (one more table load: `scontrol show node NAME`, for its boot time)."""
    client = CliSlurmClient(SlurmConfig(retries=0), ctld)
    node = client.node(name)
    calls, loads, read = len(ctld.calls), ctld.table_loads, ctld.bytes_out
    applied = drain.apply(DRAIN, node, client, CAP, sleep=lambda s: None)
    return (applied.action, len(ctld.calls) - calls, ctld.table_loads - loads,
            ctld.bytes_out - read)


def at_cap(n: int) -> FakeCtld:
    ctld = FakeCtld.cluster(n)
    for i in range(1, max(1, n // 10) + 1):
        ctld.set(f"c{n - i + 1}", state=("IDLE", "DRAIN"), reason="gpuwarden: ecc",
                 reason_changed_at=int(ctld.now) - 60)
    return ctld


def same_second(n: int) -> FakeCtld:
    ctld = at_cap(n)
    last = f"c{n - max(1, n // 10) + 1}"
    early = ctld.table[last]
    ctld.set(last, state=("IDLE",), reason="", reason_changed_at=None)
    fired: list[bool] = []

    def land(argv: tuple[str, ...]) -> None:
        if not fired and "state=drain" in argv:
            fired.append(True)
            ctld.table[last] = early

    ctld.before = land
    return ctld


def baseline_bytes(n: int) -> int:
    ctld = FakeCtld.cluster(n)
    client = CliSlurmClient(SlurmConfig(retries=0), ctld)
    client.nodes()
    client.nodes()
    return ctld.bytes_out


def main() -> None:
    logging.basicConfig(level=logging.ERROR)  # the held nodes' warnings are the expected outcome
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,1000,10000")
    sizes = [int(s) for s in ap.parse_args().sizes.split(",")]
    cases: list[tuple[str, Callable[[int], FakeCtld]]] = [
        ("drain within the cap", FakeCtld.cluster), ("held at the cap", at_cap),
        ("drained, then undone", same_second)]
    print(f"{'nodes':>6}  {'case':<22} {'outcome':<8} {'calls':>5} {'table loads':>11} "
          f"{'bytes':>10}  {'baseline bytes':>14}  {'ratio':>8}")
    for n in sizes:
        base = baseline_bytes(n)
        for label, build in cases:
            action, calls, loads, read = measure(build(n), "c3")
            print(f"{n:>6}  {label:<22} {action:<8} {calls:>5} {loads:>11} {read:>10}  "
                  f"{base:>14}  {read / base:>8.5f}")
    print("baseline: the earlier protocol, two `scontrol show nodes --json` (2 table loads)")


if __name__ == "__main__":
    main()
