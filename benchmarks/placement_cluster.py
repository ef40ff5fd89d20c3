"""Placement in the running test cluster, not a model of it: the filter against plain Slurm,
both arms in one run, on the same seeded workloads at several loads.

Each workload is a Poisson stream of jobs over `--span` seconds, sizes from `--mix`: "frag"
(default; 60% one-node jobs, gang jobs of 2 to 4 nodes, at most a leaf: where Slurm alone
splits gang jobs) or "wide" (the independent check's 1 to 8 nodes). Gang jobs ask
`--gpus-per-node=8`; each job `sleep`s 20 to 90 s with a time limit of its run plus a quarter
in whole minutes (`--limits set`), or none (`--limits none`: the partition's MaxTime, as for
users who never set one; compare with `--by fixed`, as `limits` then never waits). The
number of jobs follows from the load (node-seconds asked / node-seconds the cluster has in
the span). Each load runs once per arm, same jobs, same submit times:
- slurm: the placement policy's mode set to "off" (the filter passes every job unchanged, as
  with JobSubmitPlugins commented out): Slurm's own topology/tree;
- fixed N: the filter (mode "preferred") with `wait_s = N`, `wait_by = "fixed"`;
- limits N: the same with `wait_by = "limits"` (gpuwarden's default): a job waits only as long
  as the running jobs' time limits say its fewest switches take to free, at most N.
The arm is switched by editing /etc/gpuwarden/gpuwarden.toml: the daemon reloads it and the
benchmark waits for the snapshot to show the policy; the file is put back at the end.

Printed per load and arm: gang jobs placed in the fewest leaf switches their size allows
(ceil(nodes / nodes per leaf)), mean and p90 wait (start - submit, every job), and makespan
(first submit to last end), from accounting (sacct). Goal (issue 19): at high load >= 20 points
more gang jobs in the fewest switches than plain Slurm at <= 5% added mean wait; never worse
than plain Slurm at low load.

Needs a running cluster with 4 or more leaves: `GPUWARDEN_NODES=16 make cluster-up` (nodes per
leaf: 4). Each arm of each load takes about span + 3 minutes.

    GPUWARDEN_NODES=16 .venv/bin/python benchmarks/placement_cluster.py \\
        [--loads 0.4,1.2] [--waits 300] [--by fixed,limits] [--mix frag] [--span 300] \\
        [--limits set] [--seed 1]
"""

from __future__ import annotations

import argparse
import math
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass

import docker

from devcluster.cluster import Cluster
from devcluster.harness import Harness, wait_until
from devcluster.spec import from_env
from gpuwarden.slurm import topology

CONFIG = "/etc/gpuwarden/gpuwarden.toml"
SNAPSHOT = "/etc/slurm/gpuwarden-placement.lua"
# (nodes, share of jobs): "wide" is the independent check's mix of 1 to 8 nodes; "frag" is
# where Slurm alone splits gang jobs: one-node jobs scatter over the leaves, and gang jobs of
# at most a leaf find the nodes free but never a whole leaf at that moment.
MIXES = {
    "wide": ((1, 0.30), (2, 0.22), (3, 0.12), (4, 0.16), (6, 0.10), (8, 0.10)),
    "frag": ((1, 0.60), (2, 0.10), (3, 0.15), (4, 0.15)),
}
SLEEP_S = (20, 90)


@dataclass(frozen=True)
class Planned:
    at: float  # seconds after the arm's start
    nodes: int
    sleep_s: int

    @property
    def limit_min(self) -> int:
        """The job's time limit: its run plus a quarter, in Slurm's whole minutes (users
        who set limits set them near what the job needs)."""
        return math.ceil(self.sleep_s * 1.25 / 60)


@dataclass(frozen=True)
class Ran:
    nodes: int
    leaves: int
    fewest: int
    submit: int
    start: int
    end: int


def workload(load: float, span: float, total_nodes: int, seed: int,
             mix: tuple[tuple[int, float], ...]) -> list[Planned]:
    rng = random.Random(seed)  # noqa: S311 - a reproducible workload
    mean_node_s = sum(n * share for n, share in mix) * sum(SLEEP_S) / 2
    count = max(2, round(load * total_nodes * span / mean_node_s))
    sizes, weights = zip(*mix, strict=True)
    t, out = 0.0, []
    for _ in range(count):
        out.append(Planned(t, rng.choices(sizes, weights)[0], rng.randint(*SLEEP_S)))
        t += rng.expovariate(count / span)
    return out


def set_policy(h: Harness, mode: str, wait_s: int, wait_by: str) -> None:
    """The default policy's mode, wait and wait_by in the cluster's config; back when the
    snapshot shows them (a fit line only where wait_by is "limits" in mode "preferred")."""
    section = r"/^\[placement.default\]/,/^\[/"
    h.exec("slurmctld", ["sed", "-i", f"{section} {{/^wait_by = /d}}", CONFIG]).check("policy")
    h.exec("slurmctld", ["sed", "-i", f'{section} s/^mode = .*/mode = "{mode}"/; '
                         f'{section} s/^wait_s = .*/wait_s = {wait_s}\\nwait_by = "{wait_by}"/',
                         CONFIG]).check("policy")
    want = f" mode={mode} wait={wait_s} "
    fits = mode == "preferred" and wait_by == "limits"

    def shown() -> bool:
        text = h.exec("slurmctld", ["cat", SNAPSHOT]).out
        return want in text and ("\nfit " in text) == fits
    wait_until(shown, 60, f"a snapshot with{want}wait_by={wait_by}")
    time.sleep(2.5)  # the filter re-reads the snapshot's header at most every 2 s


def run_arm(h: Harness, jobs: list[Planned], leaf_of: dict[str, str], per_leaf: int,
            label: str, limits: bool) -> list[Ran]:
    wait_until(lambda: h.exec("slurmctld", ["squeue", "-h"]).out.strip() == "", 600, "an empty queue")
    t0 = time.monotonic()
    ids: list[tuple[int, Planned]] = []
    for j in jobs:
        time.sleep(max(0.0, t0 + j.at - time.monotonic()))
        gpus = ["--gpus-per-node=8"] if j.nodes > 1 else []
        limit = [f"--time={j.limit_min}"] if limits else []
        ids.append((h.sbatch(f"-N{j.nodes}", *gpus, *limit, name="bench",
                             wrap=f"sleep {j.sleep_s}"), j))
    print(f"  {label}: {len(ids)} jobs submitted in {time.monotonic() - t0:.0f} s; waiting",
          flush=True)
    said: set[str] = set()

    def progress(m: str) -> None:
        if m not in said:  # a line when the count changes, not every poll
            said.add(m)
            print(f"  {label}: {m}", flush=True)
    h.wait_finished([i for i, _ in ids], timeout=3600, on_poll=progress)
    out = []
    for jid, j in ids:
        rec = next(r for r in h.acct(jid) if r.start_time)
        names = h.exec("slurmctld", ["scontrol", "show", "hostnames", rec.nodes]).out.split()
        out.append(Ran(j.nodes, len({leaf_of[n] for n in names}), math.ceil(j.nodes / per_leaf),
                       rec.submit_time or 0, rec.start_time or 0, rec.end_time or 0))
    return out


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1] if len(xs) > 1 else xs[0]


def summary(ran: list[Ran]) -> dict[str, float]:
    gang = [r for r in ran if r.nodes > 1]
    waits = [float(r.start - r.submit) for r in ran]
    return {"gang": len(gang), "fewest": sum(r.leaves == r.fewest for r in gang),
            "mean_wait": statistics.fmean(waits), "p90_wait": p90(waits),
            "makespan": float(max(r.end for r in ran) - min(r.submit for r in ran))}


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--loads", default="0.4,1.2", help="offered loads, comma-separated")
    ap.add_argument("--waits", default="300", help="the filter's wait_s arms, seconds")
    ap.add_argument("--by", default="fixed,limits",
                    help="the filter's wait_by arms: fixed (always wait_s), limits (by the "
                         "running jobs' time limits, at most wait_s)")
    ap.add_argument("--mix", choices=sorted(MIXES), default="frag", help="the job sizes")
    ap.add_argument("--span", type=float, default=300.0, help="seconds of arrivals per arm")
    ap.add_argument("--limits", choices=("set", "none"), default="set",
                    help="set: each job asks its run plus a quarter (--time); none: no --time, "
                         "as users who never set one (the partition's MaxTime, INFINITE here)")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    waits = [int(x) for x in a.waits.split(",")]
    bys = a.by.split(",")
    h = Harness(Cluster(docker.from_env(timeout=600), from_env(), progress=lambda m: None))
    topo = topology.parse(h.exec("slurmctld", ["cat", "/etc/slurm/topology.conf"]).out)
    leaf_of = topo.leaf_of()
    sizes = {len(leaf.nodes) for leaf in topo.leaves}
    if len(topo.leaves) < 4 or len(sizes) != 1:
        print(f"placement_cluster: needs 4 or more leaves of equal size, the cluster has "
              f"{len(topo.leaves)}: GPUWARDEN_NODES=16 make cluster-up", file=sys.stderr)
        return 2
    per_leaf = sizes.pop()
    config = h.exec("slurmctld", ["cat", CONFIG]).out
    found = re.search(r'^\[placement\.default\]\nmode = "(\w+)"\nwait_s = (\d+)$', config, re.M)
    if not found:
        print("placement_cluster: the cluster's config has no [placement.default] with mode "
              "and wait_s lines: is this the test cluster?", file=sys.stderr)
        return 2
    before = (found.group(1), int(found.group(2)))
    h.prepare_jobs_dir()
    rows: list[tuple[float, str, dict[str, float]]] = []
    arms = [("slurm", "off", before[1], "fixed")] + [
        (f"{by} {w}", "preferred", w, by) for w in waits for by in bys]
    try:
        for i, load in enumerate(float(x) for x in a.loads.split(",")):
            jobs = workload(load, a.span, len(leaf_of), a.seed + i, MIXES[a.mix])
            asked = sum(j.nodes * j.sleep_s for j in jobs) / (len(leaf_of) * a.span)
            print(f"load {load:g}: {len(jobs)} jobs over {a.span:g} s (node-seconds asked: "
                  f"{asked:.2f} of the cluster's)", flush=True)
            for arm, mode, w, by in arms:
                set_policy(h, mode, w, by)
                rows.append((load, arm, summary(run_arm(h, jobs, leaf_of, per_leaf,
                                                        f"load {load:g} {arm}",
                                                        a.limits == "set"))))
    finally:
        set_policy(h, *before, "limits")
    print(f"\n{len(topo.leaves)} leaves x {per_leaf} nodes, mix {a.mix}, seed {a.seed}, time "
          f"limits {a.limits}; slurm: "
          "the filter off; fixed N: the filter waiting wait_s = N; limits N: waiting as the "
          "running jobs' time limits say, at most N")
    print(f"{'load':>5} {'arm':>10} {'fewest switches':>16} {'mean wait':>10} {'p90 wait':>9} "
          f"{'makespan':>9}")
    by = {(load, arm): st for load, arm, st in rows}
    for load, arm, st in rows:
        pct = 100 * st["fewest"] / st["gang"] if st["gang"] else 0.0
        print(f"{load:>5g} {arm:>10} {int(st['fewest']):>5}/{int(st['gang']):<3} {pct:>5.1f}% "
              f"{st['mean_wait']:>8.1f} s {st['p90_wait']:>7.1f} s {st['makespan']:>7.0f} s")
    for load in sorted({r[0] for r in rows}):
        plain = by[(load, "slurm")]
        for arm, *_ in arms[1:]:
            filt = by[(load, arm)]
            points = 100 * (filt["fewest"] / filt["gang"] - plain["fewest"] / plain["gang"]) \
                if plain["gang"] and filt["gang"] else 0.0
            added = (filt["mean_wait"] / plain["mean_wait"] - 1) * 100 \
                if plain["mean_wait"] else 0.0
            print(f"load {load:g}, {arm} vs slurm: {points:+.1f} points in the fewest "
                  f"switches, mean wait {added:+.1f}% ({filt['mean_wait'] - plain['mean_wait']:+.1f} s), "
                  f"makespan x{filt['makespan'] / plain['makespan']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
