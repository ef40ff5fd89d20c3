"""Issue 11 item 6 in the real cluster: nodes a reservation holds are not spare. slurmctld gives
the filter slurm.reservations; a suspect is kept in play when, without it and the reserved
nodes, too few nodes would be left for the job (unit tests: test_placement_review.py)."""

from __future__ import annotations

import json
import time

import pytest

from devcluster.harness import Harness
from tests.e2e.test_placement import LEMONS, fresh_snapshot, gang, placement  # noqa: F401

pytestmark = pytest.mark.timeout(420)
RESV = "gw-e2e-held"


def test_nodes_a_reservation_holds_do_not_count_as_spare(placement: Harness) -> None:  # noqa: F811
    h = placement
    lemon_list = {"version": 1, "generated_at": time.time(), "nodes": [
        {"node": "c2", "summary": "lemon, 9 of 12 jobs failed, fleet rate 3.0%", "failures": 9,
         "jobs": 12, "q_value": 0.001, "action": "held"}]}
    h.exec("slurmctld", ["install", "-d", "-m", "0755", "/var/lib/gpuwarden-lemons"])
    h.exec("slurmctld", ["python3", "-c",
                         f"open({LEMONS!r}, 'w').write({json.dumps(lemon_list)!r})"]).check("list")
    h.exec("slurmctld", ["scontrol", "create", "reservation", f"ReservationName={RESV}",
                         "Users=root", "Nodes=c[5-8]", "StartTime=now", "Duration=30",
                         "Flags=IGNORE_JOBS"]).check("reservation")
    try:
        fresh_snapshot(h)
        # 8 nodes, c2 a lemon, c5-c8 reserved for root: alice's 4-node job needs c2.
        job = gang(h, 4)
        assert job.get("ExcNodeList", "(null)") in ("", "(null)"), job
        assert "not excluded c2: too few nodes like them" in job["AdminComment"], job
        assert job["NodeList"] == "c[1-4]"
    finally:
        h.exec("slurmctld", ["scontrol", "delete", f"reservation={RESV}"])
