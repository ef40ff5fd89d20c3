"""What the placement filter tells sbatch agrees with what Slurm does (issue 14, section 3): a
job larger than its partition, in nodes or in GPUs per node, is refused by Slurm at submission,
and the filter says so instead of promising a wait."""

from __future__ import annotations

import pytest

from devcluster.harness import Harness
from tests.e2e.test_placement import placement  # noqa: F401 - the fixture, with its clean-up

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("args,ours", [
    (["-N20", "--gpus-per-node=8"],
     "gpuwarden: this job asks for 20 nodes but partition gpu has 8 in all: Slurm refuses it"),
    (["-N2", "--gpus-per-node=16"],
     "gpuwarden: this job asks for 16 GPUs per node but no node of partition gpu has more "
     "than 8: Slurm refuses it"),
])
def test_a_job_slurm_refuses_is_told_so_not_promised_a_wait(
        placement: Harness, args: list[str], ours: str) -> None:  # noqa: F811
    res = placement.exec("slurmctld", ["sbatch", "--parsable", "--job-name=too-large", *args,
                                       "--wrap=true"], user="alice", timeout=30)
    said = res.out + res.err
    assert res.rc != 0, f"Slurm accepted the job: {said}"
    assert ours in said and "waits" not in said, said
