"""What the job_submit filter adds to every sbatch, measured in the running test cluster.

slurmctld logs `_slurm_rpc_submit_batch_job: JobId=N ... usec=U` for each submit: the time it
spent on the RPC, filter included. Batches of held 2-node GPU jobs are submitted alternately
with the filter (JobSubmitPlugins=lua, snapshot fresh) and without it (the line commented out,
`scontrol reconfigure`), in the same run. Prints the median and p99 of usec for both and the
sbatch throughput ratio. Goals: under 0.5 ms added at the median; throughput ratio >= 0.95.
Needs `make cluster-up`.

    .venv/bin/python benchmarks/placement_submit.py [--batch 100] [--rounds 2]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time

import docker

from devcluster.cluster import Cluster
from devcluster.spec import from_env

_SUBMIT = r"""
set -e
cd /fsx/jobs
t0=$(date +%s.%N)
for i in $(seq {n}); do
  sbatch --hold -N2 --gpus-per-node=8 -o /dev/null --wrap true >/dev/null
done
t1=$(date +%s.%N)
echo "$t0 $t1"
scancel --user=alice --state=PENDING || true
"""
_USEC = re.compile(r"_slurm_rpc_submit_batch_job: JobId=\d+ .*usec=(\d+)")


def set_filter(cluster: Cluster, on: bool) -> None:
    sed = ("s/^#JobSubmitPlugins=lua/JobSubmitPlugins=lua/" if on
           else "s/^JobSubmitPlugins=lua/#JobSubmitPlugins=lua/")
    cluster.exec("slurmctld", ["sed", "-i", sed, "/etc/slurm/slurm.conf"]).check("edit")
    cluster.exec("slurmctld", ["scontrol", "reconfigure"], timeout=60).check("reconfigure")
    for _ in range(60):
        if cluster.exec("slurmctld", ["scontrol", "ping"], timeout=10).rc == 0:
            break
        time.sleep(1)
    time.sleep(3)


def batch(cluster: Cluster, n: int) -> tuple[list[int], float]:
    since = int(time.time())
    res = cluster.exec("slurmctld", ["bash", "-c", _SUBMIT.format(n=n)], timeout=600,
                       user="alice").check("submit")
    t0, t1 = (float(x) for x in res.out.split()[-2:])
    time.sleep(1)
    log = cluster.container("slurmctld").logs(since=since, stdout=True, stderr=True).decode(
        errors="replace")
    usec = [int(m.group(1)) for m in _USEC.finditer(log)][-n:]
    return usec, n / (t1 - t0)


def pct(xs: list[int], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    cluster = Cluster(docker.from_env(timeout=600), from_env(), progress=lambda m: None)
    results: dict[bool, tuple[list[int], list[float]]] = {True: ([], []), False: ([], [])}
    try:
        for r in range(args.rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                set_filter(cluster, on)
                usec, rate = batch(cluster, args.batch)
                results[on][0].extend(usec)
                results[on][1].append(rate)
                print(f"round {r + 1}, filter {'on ' if on else 'off'}: {len(usec)} submits, "
                      f"median {statistics.median(usec):.0f} us, {rate:.1f} sbatch/s",
                      file=sys.stderr, flush=True)
    finally:
        set_filter(cluster, True)
    (on_u, on_r), (off_u, off_r) = results[True], results[False]
    print(f"{'':<14}{'MEDIAN':>9}{'P99':>9}{'SBATCH/S':>10}")
    for name, u, rates in (("filter off", off_u, off_r), ("filter on", on_u, on_r)):
        print(f"{name:<14}{statistics.median(u):>7.0f}us{pct(u, 0.99):>7.0f}us"
              f"{statistics.mean(rates):>10.1f}")
    added = (statistics.median(on_u) - statistics.median(off_u)) / 1000
    ratio = statistics.mean(on_r) / statistics.mean(off_r)
    ok = added < 0.5 and ratio >= 0.95
    print(f"added at the median: {added:.3f} ms (goal < 0.5); throughput ratio {ratio:.2f} "
          f"(goal >= 0.95): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
