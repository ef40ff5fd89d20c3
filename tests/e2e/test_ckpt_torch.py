"""A PyTorch DDP job through Slurm: four ranks over gloo, one per node, checkpointed as the
model's and the optimizer's state_dict (ckpt/train_torch_example.py under ckpt/train.sbatch).
A node is killed mid-run; Slurm requeues the job, the prolog stages the newest common step into
the new nodes' memory, every rank restores it, and the final weights are bit-identical to an
uninterrupted run of the same training (four local ranks over loopback, no checkpoints)."""

from __future__ import annotations

import json
import re

import pytest

from devcluster.cluster import VENV_PYTHON
from devcluster.harness import TRAIN_SBATCH, Harness
from tests.e2e.test_ckpt_requeue import hostnames, lose_node, output
from tests.e2e.test_foundation import wait_for
from tests.e2e.test_health import nodes

pytestmark = pytest.mark.timeout(600)
TORCH_EXAMPLE = "/opt/gpuwarden/ckpt/train_torch_example.py"


def test_a_ddp_job_loses_a_node_and_ends_bit_identical(cluster: Harness) -> None:
    h = cluster
    args = ["--steps", "70", "--every", "5", "--width", "256"]
    ref = h.exec("c1", [VENV_PYTHON, "-I", TORCH_EXAMPLE, "--reference", "4", *args],
                 timeout=300).check("reference run")
    expected = json.loads(ref.out.strip().splitlines()[-1])
    job = h.sbatch("-N4", "--gpus-per-node=8", name="train", script=[TRAIN_SBATCH, *args],
                   env={"TRAIN": f"{VENV_PYTHON} -I {TORCH_EXAMPLE}"})
    def durable_10() -> bool:
        state = h.job_fields(job).get("JobState", "")
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), \
            f"job {job} is {state}: " + output(h, job)[-3000:]
        return max(h.shared_steps(job, 3), default=0) >= 10

    wait_for(durable_10, 240, "step 10 durable on the shared filesystem")
    victim = hostnames(h, h.job_fields(job)["NodeList"])[-1]
    lose_node(h, job, victim)
    out = output(h, job)
    assert h.train_finals(job, 4) == expected, \
        "the resumed DDP run ends bit-identical to an uninterrupted one: " + out[-2000:]
    restored = re.findall(r"rank (\d): restored step (\d+) from (\w+) \(restart 1\)", out)
    assert len(restored) == 4, out[-2000:]
    assert len({step for _, step, _ in restored}) == 1, "every rank resumed from the same step"
    assert int(restored[0][1]) >= 10
    wait_for(lambda: not nodes(h)[victim].down, 120, f"{victim} back in service")
