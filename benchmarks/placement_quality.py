"""Placement quality on a 64-leaf x 16-node fabric: the filter's policy against plain Slurm.

A discrete-event simulation of one mixed job stream (one-node jobs and gang jobs of 2 to 128
nodes, Poisson arrivals, 90% load by default), scheduled twice by the same greedy backfill:
- plain Slurm with topology/tree: a job that fits in one leaf now goes to the best-fitting
  leaf, otherwise it starts at once on the leaves with most free nodes;
- with the filter (`--switches=k@wait`, k = the fewest leaves that can hold the job): a gang
  job starts only when k leaves can hold it, or once it has waited `wait`, then as plain Slurm.
Printed: the share of multi-node jobs placed in the fewest possible switches, and the mean and
p95 queue wait, each policy measured on the same stream (same seed).

    .venv/bin/python benchmarks/placement_quality.py [--jobs 20000] [--wait 300] [--seeds 3]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import sys
from dataclasses import dataclass
from itertools import accumulate

LEAVES, PER_LEAF = 64, 16
# (nodes, share of jobs, mean hours)
MIX = ((1, 0.45, 2.0), (2, 0.15, 3.0), (4, 0.12, 3.0), (8, 0.10, 4.0), (16, 0.08, 4.0),
       (32, 0.05, 4.0), (64, 0.03, 3.0), (128, 0.02, 2.0))


@dataclass
class Job:
    jid: int
    nodes: int
    arrive: float
    hours: float
    start: float = -1.0
    leaves: int = 0


def stream(n: int, seed: int, load: float) -> list[Job]:
    rng = random.Random(seed)  # noqa: S311 - a reproducible simulation
    node_hours = sum(share * nodes * hours for nodes, share, hours in MIX)
    rate = load * LEAVES * PER_LEAF / node_hours  # arrivals per hour
    cum = list(accumulate(share for _, share, _ in MIX))
    t, out = 0.0, []
    for jid in range(n):
        t += rng.expovariate(rate)
        r = rng.random() * cum[-1]
        nodes, _, hours = MIX[next((i for i, c in enumerate(cum) if r <= c), len(MIX) - 1)]
        out.append(Job(jid, nodes, t, rng.expovariate(1 / hours)))
    return out


def fewest(nodes: int) -> int:
    return math.ceil(nodes / PER_LEAF)


def take(free: list[int], nodes: int, max_leaves: int | None) -> list[tuple[int, int]] | None:
    """Leaves and counts to take, or None. One leaf: best fit; more: most free first."""
    fits = [i for i, f in enumerate(free) if f >= nodes]
    if fits:
        best = min(fits, key=lambda i: (free[i], i))
        return [(best, nodes)]
    order = sorted(range(len(free)), key=lambda i: (-free[i], i))
    got, left = [], nodes
    for i in order:
        if left == 0 or free[i] == 0:
            break
        n = min(free[i], left)
        got.append((i, n))
        left -= n
    if left or (max_leaves is not None and len(got) > max_leaves):
        return None
    return got


def simulate(jobs: list[Job], wait_h: float | None) -> list[Job]:
    """wait_h None: plain Slurm. Otherwise the filter's --switches=k@wait."""
    jobs = [Job(j.jid, j.nodes, j.arrive, j.hours) for j in jobs]
    free = [PER_LEAF] * LEAVES
    events: list[tuple[float, int, int]] = []  # (time, kind 0=end 1=arrive 2=wake, jid)
    for j in jobs:
        heapq.heappush(events, (j.arrive, 1, j.jid))
    queue: list[Job] = []
    running: dict[int, list[tuple[int, int]]] = {}
    while events:
        now, kind, jid = heapq.heappop(events)
        if kind == 0:
            for leaf, n in running.pop(jid):
                free[leaf] += n
        elif kind == 1:
            queue.append(jobs[jid])
            if wait_h is not None and jobs[jid].nodes > 1:
                heapq.heappush(events, (now + wait_h, 2, jid))
        still = []
        for j in queue:
            limit = None
            if wait_h is not None and j.nodes > 1 and now - j.arrive < wait_h:
                limit = fewest(j.nodes)
            got = take(free, j.nodes, limit)
            if got is None:
                still.append(j)
                continue
            for leaf, n in got:
                free[leaf] -= n
            j.start, j.leaves = now, len(got)
            running[j.jid] = got
            heapq.heappush(events, (now + j.hours, 0, j.jid))
        queue = still
    return jobs


def summary(jobs: list[Job]) -> tuple[float, float, float, float]:
    gang = [j for j in jobs if j.nodes > 1]
    packed = sum(1 for j in gang if j.leaves == fewest(j.nodes)) / len(gang)
    waits = [(j.start - j.arrive) * 60 for j in jobs]
    gang_waits = [(j.start - j.arrive) * 60 for j in gang]
    p95 = statistics.quantiles(waits, n=20)[-1]
    return packed, statistics.mean(waits), p95, statistics.mean(gang_waits)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=20_000)
    ap.add_argument("--wait", type=float, default=300, help="seconds (the policy's wait_s)")
    ap.add_argument("--load", type=float, default=0.9)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    print(f"{LEAVES} leaves x {PER_LEAF} nodes, {args.jobs} jobs per seed, load {args.load:.0%},"
          f" wait {args.wait:g} s")
    print(f"{'SEED':>4} {'POLICY':<14} {'FEWEST SWITCHES':>15} {'MEAN WAIT':>10} "
          f"{'P95 WAIT':>9} {'GANG WAIT':>10}")
    rows = []
    for seed in range(args.seeds):
        stream_ = stream(args.jobs, seed, args.load)
        for name, wait in (("plain Slurm", None), ("gpuwarden", args.wait / 3600)):
            packed, mean, p95, gang = summary(simulate(stream_, wait))
            rows.append((name, packed, mean, gang))
            print(f"{seed:>4} {name:<14} {100 * packed:>14.1f}% {mean:>8.1f} m {p95:>7.1f} m "
                  f"{gang:>8.1f} m", flush=True)
    for name in ("plain Slurm", "gpuwarden"):
        sel = [r for r in rows if r[0] == name]
        print(f"mean over seeds, {name:<12}: {100 * statistics.mean(r[1] for r in sel):.1f}% in "
              f"the fewest switches, mean wait {statistics.mean(r[2] for r in sel):.1f} min "
              f"(gang jobs {statistics.mean(r[3] for r in sel):.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
