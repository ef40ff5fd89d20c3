"""Issue 6 through Slurm: a 4-node training job submitted with ckpt/train.sbatch.

Scenario 1: a node is killed mid-run; Slurm requeues the job, the prolog stages the newest
checkpoint every rank holds into the new nodes' memory, the job resumes from there and ends
bit-identical to an uninterrupted run. And the time limit: Slurm's `--signal=B:USR1@N` makes
the ranks save at once, the template requeues the job, and it finishes from that step.
"""

from __future__ import annotations

import re
import time

import pytest

from devcluster.harness import JOBS_DIR, TRAIN_SBATCH, Harness
from tests.e2e.test_foundation import wait_for
from tests.e2e.test_health import nodes

pytestmark = pytest.mark.timeout(600)


def output(h: Harness, job: int) -> str:
    return h.exec("slurmctld", ["cat", f"{JOBS_DIR}/train-{job}.out"]).out


def hostnames(h: Harness, expr: str) -> list[str]:
    return h.exec("slurmctld", ["scontrol", "show", "hostnames", expr]).out.split()


def ran_on(h: Harness, log: str, restart: int) -> list[str]:
    """The nodes run ``restart`` of the job had, as its batch script printed them: once the
    job ends, scontrol's NodeList shrinks as each node's epilog ends (COMPLETING), so it may
    name one node of several."""
    got = re.findall(rf"start \(restart {restart}\) on \d+ node\(s\) (\S+), GPUs", log)
    assert len(got) == 1, log[-3000:]
    return hostnames(h, got[0])


def lose_node(h: Harness, job: int, victim: str) -> None:
    """Kill one of the job's nodes; wait until Slurm requeued the job and it ended."""
    h.kill(victim)
    try:
        wait_for(lambda: h.job_fields(job).get("Restarts", "0") != "0", 180,
                 "Slurm to requeue the job")
        h.wait_job(job, timeout=400)
    finally:
        h.heal(victim)


@pytest.mark.versions
def test_a_killed_node_costs_a_requeue_and_nothing_else(cluster: Harness) -> None:
    h = cluster
    # Long enough that the surviving ranks are still training when Slurm notices the dead node
    # (SlurmdTimeout=30 s) and stops them.
    args = ["--steps", "90", "--every", "5", "--mb", "8"]
    expected = h.train_reference(4, args)
    job = h.sbatch("-N4", "--gpus-per-node=8", name="train", script=[TRAIN_SBATCH, *args])
    wait_for(lambda: max(h.shared_steps(job, 3), default=0) >= 10, 180,
             "step 10 durable on the shared filesystem")
    first = hostnames(h, h.job_fields(job)["NodeList"])
    # Peer replicas: every rank's steps are also in another node's memory, pushed with the
    # job's key.
    held = {n: h.sh(n, f"ls /dev/shm/gpuwarden-ckpt/job-{job}.peer 2>/dev/null || true").out
            .split() for n in first}
    assert sorted(r for rs in held.values() for r in rs) == [f"rank-0000{r}" for r in range(4)]
    victim = first[-1]
    lose_node(h, job, victim)
    log = output(h, job)
    again = ran_on(h, log, 1)
    assert len(again) == 4 and victim not in again, (first, again)
    assert h.train_finals(job, 4) == expected, \
        "the resumed run ends bit-identical to an uninterrupted one"
    restored = re.findall(r"rank (\d): restored step (\d+) from (\w+) \(restart 1\)", log)
    assert len(restored) == 4, log[-2000:]
    assert len({step for _, step, _ in restored}) == 1, "every rank resumed from the same step"
    assert int(restored[0][1]) >= 10
    # The prolog staged that step into the new nodes' memory before the job started.
    assert {tier for _, _, tier in restored} == {"memory"}, restored
    wait_for(lambda: not nodes(h)[victim].down, 120, f"{victim} back in service")
    time.sleep(1)


def test_the_time_limit_warning_saves_requeues_and_loses_nothing(cluster: Harness) -> None:
    """Slurm signals USR1 up to a minute before `--signal`'s 60 s (so 60-120 s into a 3-minute
    job); 140 s of training always outlives that first warning. One warning is what this test
    is about: once the job is requeued its time limit is raised, so the resumed run finishes
    (on a loaded host a second warning could come before a resumed run got anywhere, and the
    job went round again and again: 5 requeues in 420 s)."""
    h = cluster
    # No regular checkpoint (--every is past the last step): what is restored can only be
    # what the warning saved.
    args = ["--steps", "200", "--every", "1000", "--mb", "4", "--step-s", "0.7"]
    expected = h.train_reference(4, args)
    job = h.sbatch("-N4", "--gpus-per-node=8", "--time=3", "--signal=B:USR1@60", name="train",
                   script=[TRAIN_SBATCH, *args])
    wait_for(lambda: h.job_fields(job).get("Restarts", "0") != "0", 300,
             "the time-limit warning to requeue the job")
    h.exec("slurmctld", ["scontrol", "update", f"jobid={job}", "TimeLimit=20"]).check("limit")
    h.wait_job(job, timeout=420)
    log = output(h, job)
    saved = re.findall(r"rank (\d): emergency save of step (\d+) durable", log)
    assert len(saved) == 4, log[-2000:]  # one warning, one save per rank
    step = int(saved[0][1])
    assert {int(s) for _, s in saved[:4]} == {step}, "the ranks agreed on one step to stop at"
    assert 0 < step < 200, "saved on the warning, mid-run"
    assert len(re.findall(rf"restored step {step} from \w+ \(restart 1\)", log)) == 4, log[-2000:]
    assert "requeueing job" in log
    assert h.job_fields(job)["Restarts"] == "1"
    assert h.train_finals(job, 4) == expected
