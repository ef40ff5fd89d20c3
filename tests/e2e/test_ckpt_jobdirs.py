"""Issue 12, item 1 through Slurm: another user pre-creates tier-0 directories for the next job
ids; the prolog moves them aside, the job checkpoints and finishes, and the epilog leaves
nothing of it in node memory. Needs `jobdirs.for_prolog`/`for_epilog` wired into
gpuwarden/hooks/entry.py."""

from __future__ import annotations

import pytest

from devcluster.harness import TRAIN_SBATCH, Harness
from tests.e2e.test_foundation import wait_for

pytestmark = pytest.mark.timeout(300)
SPOOL = "/dev/shm/gpuwarden-ckpt"


def listing(h: Harness, node: str) -> list[str]:
    res = h.exec(node, ["ls", "-A", SPOOL])
    return res.out.split() if res.rc == 0 else []


def test_a_squatted_job_id_still_runs_and_its_node_memory_is_freed(cluster: Harness) -> None:
    h = cluster
    probe = h.sbatch("-N1", "-w", "c1", wrap="true", name="jobdirs-probe")
    h.wait_job(probe)
    squatted = [f"job-{probe + i}" for i in range(1, 6)]
    # bob, an ordinary user, takes the next job ids' directories on c1 (the spool is 1777).
    h.sh("c1", f"mkdir -p {SPOOL} 2>/dev/null; cd {SPOOL} && for d in {' '.join(squatted)}; "
               "do mkdir -m 777 $d $d.peer; done", user="bob").check("bob squats")
    job = h.sbatch("-N1", "-w", "c1", "--gpus-per-node=8", name="jobdirs",
                   script=[TRAIN_SBATCH, "--steps", "4", "--every", "2", "--mb", "1"])
    assert f"job-{job}" in squatted, "the job id was not one bob took; widen the range"
    h.wait_job(job, timeout=240)
    wait_for(lambda: not [n for n in listing(h, "c1") if n.startswith((f"job-{job}",
                                                                       f".squatted.job-{job}."))],
             60, f"the epilog removed job-{job}'s tier 0 on c1")
    assert h.shared_steps(job, 0)[-1] == 4  # the job really checkpointed
