"""Issue 6, scenario 1: a 4-node training job loses a node mid-run; Slurm requeues it, it
resumes on healthy nodes from the shared-filesystem tier (node memory died with the node), and
its final state is bit-identical to an uninterrupted run's."""

from __future__ import annotations

import json
import time

import pytest

from gpuwarden.devcluster.harness import Harness
from tests.e2e.test_foundation import wait_for
from tests.e2e.test_health import nodes

pytestmark = pytest.mark.timeout(600)
TRAIN = "/opt/gpuwarden/ckpt/train_example.py"
# Long enough that the surviving ranks are still training when Slurm notices the dead node
# (SlurmdTimeout=30 s) and stops them.
ARGS = ["--steps", "90", "--every", "5", "--mb", "8"]


def test_a_killed_node_costs_a_requeue_and_nothing_else(cluster: Harness) -> None:
    h = cluster
    ref = h.exec("c1", ["python3", TRAIN, "--reference", "4", *ARGS], timeout=120)
    expected = json.loads(ref.check("reference run").out.strip().splitlines()[-1])
    job = h.sbatch("-N4", "--gpus-per-node=8", "--requeue", name="train",
                   wrap=f"srun python3 {TRAIN} {' '.join(ARGS)}")
    shared = f"/fsx/gpuwarden-ckpt/job-{job}"

    def durable_step() -> int:
        out = h.sh("slurmctld", f"ls {shared}/rank-00003 2>/dev/null || true").out.split()
        steps = [int(n[5:]) for n in out if n.startswith("step-")]
        return max(steps, default=0)
    wait_for(lambda: durable_step() >= 10, 180, "step 10 durable on the shared filesystem")
    victim = sorted(h.job_fields(job)["NodeList"] and h.exec(
        "slurmctld", ["scontrol", "show", "hostnames", h.job_fields(job)["NodeList"]]
    ).out.split())[-1]
    h.kill(victim)
    try:
        wait_for(lambda: h.job_fields(job).get("Restarts", "0") != "0", 180,
                 "Slurm to requeue the job")
        h.wait_job(job, timeout=400)
    finally:
        h.heal(victim)
    fields = h.job_fields(job)
    assert victim not in h.exec("slurmctld", ["scontrol", "show", "hostnames",
                                              fields["NodeList"]]).out.split()
    finals = [h.exec("slurmctld", ["cat", f"{shared}/final-rank-{r}.txt"]).check("final").out
              .strip() for r in range(4)]
    assert finals == expected, "the resumed run ends bit-identical to an uninterrupted one"
    log = h.exec("slurmctld", ["bash", "-c", f"cat /fsx/jobs/train-{job}.out"]).out
    assert "restored step" in log and "from shared" in log, log[-1500:]
    wait_for(lambda: not nodes(h)[victim].down, 120, f"{victim} back in service")
    time.sleep(1)
