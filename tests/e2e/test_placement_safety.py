"""Issue 11, item 6 in the real cluster: a filter decision never makes a runnable job
unrunnable. A gang job in an exact-size reservation that holds a suspect node still starts
there (the filter leaves --reservation jobs alone), and the snapshot the daemon writes is
refused by nobody: root's, 0644, beside job_submit.lua."""

from __future__ import annotations

import pytest

from devcluster.harness import Harness
from tests.e2e.test_foundation import wait_for
from tests.e2e.test_placement import SNAPSHOT, fresh_snapshot, placement  # noqa: F401

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_an_exact_size_reservation_holding_a_suspect_still_runs_its_job(
        placement: Harness) -> None:  # noqa: F811
    h = placement
    h.exec("slurmctld", ["scontrol", "update", "nodename=c3",
                         "comment=gpuwarden: would drain: lemon, 9 of 12 jobs failed "
                         "(blast-radius cap)"]).check("c3")
    h.exec("slurmctld", ["scontrol", "create", "reservation", "reservationname=gw_exact",
                         "nodes=c3,c4", "starttime=now", "duration=10", "users=alice",
                         "flags=ignore_jobs"]).check("reservation")
    try:
        fresh_snapshot(h)
        job = h.sbatch("-N2", "--gpus-per-node=8", "--reservation=gw_exact", name="gang",
                       wrap="srun hostname")
        wait_for(lambda: h.job_fields(job).get("JobState") in ("RUNNING", "COMPLETED"), 90,
                 f"job {job} to start in its reservation")
        fields = h.job_fields(job)
        assert fields.get("ExcNodeList", "(null)") == "(null)"
        assert fields["NodeList"] in ("c[3-4]", "c3,c4")
    finally:
        h.exec("slurmctld", ["scontrol", "delete", "reservationname=gw_exact"])


def test_the_daemons_snapshot_is_roots_read_only_and_beside_job_submit_lua(
        placement: Harness) -> None:  # noqa: F811
    h = placement
    out = h.exec("slurmctld", ["stat", "-L", "-c", "%U %a", SNAPSHOT,
                               "/etc/slurm/job_submit.lua"]).check("stat").out.split("\n")
    assert out[0] == "root 644"
    assert out[1].startswith("root ")
