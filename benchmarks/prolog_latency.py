"""What gpuwarden's prolog adds to every job start, measured in the running test cluster.

Baseline, in the same run and on the same node: starting the same interpreter the prolog uses
(`/usr/bin/python3 -I -c pass`). Prints median and p95 of both, and the difference per job
start (goal: <= 30 ms at the median, <= 60 ms at p95). Needs `make cluster-up`. Without the
cluster, benchmarks/prolog_local.py measures the same fast path on this machine.

    .venv/bin/python benchmarks/prolog_latency.py [--node c1] [--runs 30]
"""

from __future__ import annotations

import argparse
import json
import statistics

import docker

from gpuwarden.devcluster.cluster import Cluster
from gpuwarden.devcluster.spec import from_env

# Time inside the node, so docker exec overhead is not counted.
_TIMER = r"""
import os, subprocess, sys, time, json
argv = json.loads(sys.argv[1]); n = int(sys.argv[2])
env = dict(os.environ, SLURMD_NODENAME=sys.argv[3], SLURM_JOB_ID="1", SLURM_JOB_UID="2001",
           SLURM_JOB_GID="2001", SLURM_JOB_GPUS="0,1,2,3,4,5,6,7")  # as slurmd sets them
out = []
for _ in range(n):
    t = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    out.append(time.perf_counter() - t)
print(json.dumps(out))
"""


def measure(cluster: Cluster, node: str, argv: list[str], runs: int) -> list[float]:
    res = cluster.exec(node, ["python3", "-c", _TIMER, json.dumps(argv), str(runs), node],
                       timeout=600)
    res.check("timing")
    return [float(x) for x in json.loads(res.out)]


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    ap.add_argument("--node", default="c1")
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    cluster = Cluster(docker.from_env(timeout=600), from_env(), progress=lambda m: None)
    cluster.exec(args.node, ["/opt/gpuwarden/prolog/gpuwarden-healthcheck"], timeout=60)
    # The first prolog after a config change takes the full path and leaves the settings the
    # fast path reads (/run/gpuwarden/prolog-gate.marshal): not part of the steady state measured.
    measure(cluster, args.node, ["/opt/gpuwarden/prolog/gpuwarden-prolog"], 1)
    base = measure(cluster, args.node, ["/usr/bin/python3", "-I", "-c", "pass"], args.runs)
    gate = measure(cluster, args.node, ["/opt/gpuwarden/prolog/gpuwarden-prolog"], args.runs)
    print(f"node {args.node}, {args.runs} runs each (fresh stored verdict: the fast path)")
    print(f"  python3 -I -c pass   median {statistics.median(base) * 1e3:7.1f} ms  "
          f"p95 {pct(base, 0.95) * 1e3:7.1f} ms")
    print(f"  gpuwarden-prolog     median {statistics.median(gate) * 1e3:7.1f} ms  "
          f"p95 {pct(gate, 0.95) * 1e3:7.1f} ms")
    added = statistics.median(gate) - statistics.median(base)
    print(f"  added per job start: {added * 1e3:.1f} ms at the median, "
          f"{(pct(gate, 0.95) - pct(base, 0.95)) * 1e3:.1f} ms at p95 "
          f"(ratio {statistics.median(gate) / statistics.median(base):.1f}x the bare interpreter)")


if __name__ == "__main__":
    main()
