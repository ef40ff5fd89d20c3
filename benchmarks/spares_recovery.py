"""Hot spares against the requeue path, in the running test cluster: both arms in one run.

The same training (3 ranks, `--mb` MiB of state per rank, a checkpoint every 5 steps) loses
the same training node (`docker kill`) once the job has its step 10 on the shared tier:
- spare: `ckpt/train_spares.sbatch` with one spare (`sbatch -N4`, `--deadline-s 5`);
- requeue: `ckpt/train.sbatch` (`sbatch -N3`): Slurm notices the node (SlurmdTimeout), requeues
  the job, holds it `cred_expire` + 1 s (31 s in the test cluster, 121 s by Slurm's default),
  starts it on other nodes, the prolog stages the checkpoint in, the ranks restore.
Recovery: from the kill to every rank's "restored step" line in the job's output (the ranks
train again right after). Goal: spare / requeue <= 0.25, with the test cluster's hold and with
the default one (the default's figure adds the 90 s of hold the test cluster leaves out: the
rest of the path does not depend on it). Needs `make cluster-up`.

    .venv/bin/python benchmarks/spares_recovery.py [--mb 8]
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import docker

from devcluster.cluster import Cluster
from devcluster.harness import JOBS_DIR, TRAIN_SBATCH, Harness, wait_until
from devcluster.spec import from_env

SPARES_SBATCH = "/opt/gpuwarden/ckpt/train_spares.sbatch"
TEST_HOLD_S, DEFAULT_HOLD_S = 31.0, 121.0


def arm(h: Harness, script: str, nodes: int, args: list[str], env: dict[str, str]) -> float:
    job = h.sbatch(f"-N{nodes}", "--gpus-per-node=8", name="train", script=[script, *args],
                   env=env)
    wait_until(lambda: max(h.shared_steps(job, 2), default=0) >= 10, 240, f"job {job} at step 10",
               poll_s=0.5)
    allocated = h.exec("slurmctld", ["scontrol", "show", "hostnames",
                                     h.job_fields(job)["NodeList"]]).out.split()
    victim = allocated[1]
    out = f"{JOBS_DIR}/train-{job}.out"

    def restored() -> int:
        text = h.exec("slurmctld", ["cat", out]).out
        return len(re.findall(r"rank \d: restored step \d+ from \w+", text))

    before = restored()
    killed = time.monotonic()
    h.kill(victim)
    try:
        wait_until(lambda: restored() >= before + 3, 600, f"job {job}'s ranks restored",
                   poll_s=0.5)
        took = time.monotonic() - killed
        h.wait_job(job, timeout=600)
    finally:
        h.heal(victim)
    wait_until(lambda: "down" not in h.exec("slurmctld", ["sinfo", "-h", "-n", victim, "-o",
                                                          "%T"]).out.lower(), 180,
               f"{victim} back", poll_s=0.5)
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--mb", type=int, default=8)
    a = ap.parse_args()
    h = Harness(Cluster(docker.from_env(timeout=600), from_env(), progress=lambda m: None))
    h.prepare_jobs_dir()
    args = ["--steps", "100", "--every", "5", "--mb", str(a.mb)]
    spare = arm(h, SPARES_SBATCH, 4, args,
                {"SPARES": "1", "LAUNCH_OPTS": "--deadline-s 5"})
    requeue = arm(h, TRAIN_SBATCH, 3, args, {})
    default = requeue + DEFAULT_HOLD_S - TEST_HOLD_S
    print(f"state {a.mb} MiB per rank, 3 ranks; recovery from the kill to every rank restored")
    print(f"spare path:   {spare:6.1f} s")
    print(f"requeue path: {requeue:6.1f} s with the test cluster's {TEST_HOLD_S:.0f} s hold; "
          f"{default:.1f} s with Slurm's default {DEFAULT_HOLD_S:.0f} s")
    print(f"spare / requeue: {spare / requeue:.2f} (test hold), {spare / default:.2f} "
          "(default hold); goal <= 0.25")
    return 0


if __name__ == "__main__":
    sys.exit(main())
