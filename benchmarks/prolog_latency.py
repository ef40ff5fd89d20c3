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
import time

import docker

from devcluster.cluster import Cluster
from devcluster.harness import JOBS_DIR
from devcluster.spec import from_env

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


# Submit, then poll the shared file system for the line the batch script writes first; the
# next job only once this one has left the queue. Run as alice on the controller.
_STARTS = r"""
import json, os, subprocess, sys, time
n, nodes, jobs = int(sys.argv[1]), sys.argv[2], sys.argv[3]
out = []
for _ in range(n):
    t = time.time()
    jid = subprocess.run(["sbatch", "--parsable", "-N2", "-w", nodes, "--gpus-per-node=8",
                          f"--chdir={jobs}", "--output=/dev/null",
                          f"--wrap=date +%s.%N > {jobs}/bench-start-$SLURM_JOB_ID"],
                         capture_output=True, text=True, check=True).stdout.split(";")[0].strip()
    path, text = f"{jobs}/bench-start-{jid}", ""
    while not text:
        try:
            text = open(path).read().strip()
        except FileNotFoundError:
            time.sleep(0.005)
    out.append(float(text) - t)
    while subprocess.run(["squeue", "-h", "-j", jid], capture_output=True, text=True).stdout.strip():
        time.sleep(0.05)
    os.unlink(path)
print(json.dumps(out))
"""
FLAGS = "PrologFlags=Alloc,DeferBatch"


def set_flags(cluster: Cluster, on: bool) -> None:
    """The cluster's PrologFlags line on (as rendered) or commented out, on every host, then
    `scontrol reconfigure` (Slurm 23.11+ restarts the daemons in place); waits for every node."""
    sed = f"s/^#*{FLAGS}$/{'' if on else '#'}{FLAGS}/"
    for host in ["slurmctld", *cluster.spec.node_names]:
        cluster.exec(host, ["sed", "-i", sed, "/etc/slurm/slurm.conf"]).check("sed")
    cluster.exec("slurmctld", ["scontrol", "reconfigure"]).check("reconfigure")
    want = "Alloc,DeferBatch" if on else "(null)"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        conf = cluster.exec("slurmctld", ["scontrol", "show", "config"], timeout=20).out
        flags = [ln.split("=", 1)[1].strip() for ln in conf.splitlines()
                 if ln.startswith("PrologFlags")]
        idle = cluster.exec("slurmctld", ["sinfo", "-h", "-o", "%t"], timeout=20).out.split()
        if flags == [want] and idle and all(t == "idle" for t in idle):
            return
        time.sleep(1)
    raise SystemExit(f"PrologFlags not {want} with every node idle after 120 s")


def job_starts(cluster: Cluster, nodes: str, n: int) -> list[float]:
    res = cluster.exec("slurmctld", ["python3", "-c", _STARTS, str(n + 1), nodes, JOBS_DIR],
                       timeout=600, user="alice").check("job starts")
    return [float(x) for x in json.loads(res.out)][1:]  # the first after a restart: warm-up


def show(label: str, xs: list[float]) -> None:
    print(f"  {label:<32} median {statistics.median(xs) * 1e3:7.0f} ms  "
          f"p95 {pct(xs, 0.95) * 1e3:7.0f} ms")


def compare_flags(cluster: Cluster, n: int) -> None:
    nodes = ",".join(cluster.spec.node_names[:2])
    try:
        set_flags(cluster, False)
        without = job_starts(cluster, nodes, n)
    finally:
        set_flags(cluster, True)
    with_flags = job_starts(cluster, nodes, n)
    print(f"2-node job ({nodes}), submit to the batch script's first line, {n} jobs each:")
    show("without PrologFlags", without)
    show(FLAGS, with_flags)
    print(f"  ratio {statistics.median(with_flags) / statistics.median(without):.2f}x at the "
          f"median, +{(statistics.median(with_flags) - statistics.median(without)) * 1e3:.0f} "
          "ms per job start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    ap.add_argument("--node", default="c1")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--job-starts", type=int, default=0, metavar="N",
                    help="measure PrologFlags=Alloc,DeferBatch per job start instead")
    args = ap.parse_args()
    cluster = Cluster(docker.from_env(timeout=600), from_env(), progress=lambda m: None)
    if args.job_starts:
        compare_flags(cluster, args.job_starts)
        return
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
