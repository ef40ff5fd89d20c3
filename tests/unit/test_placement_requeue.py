"""Issue 39 item 1: a gang job that Slurm requeued (its prolog failed on a bad node) does not
wait for one leaf switch again: the placement daemon sets the switch wait the filter gave it
to 0, and leaves every wait that is not the filter's alone."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from gpuwarden.config.placement import PartitionPolicy, PlacementConfig
from gpuwarden.core.errors import SlurmError
from gpuwarden.placement import daemon, requeue
from gpuwarden.slurm import parse
from gpuwarden.slurm.client import CliSlurmClient
from gpuwarden.slurm.models import Job
from gpuwarden.slurm.settings import SlurmConfig
from tests.fakes import FakeRunner, FakeSlurm, ok
from tests.unit.test_placement import TREE, node

PLACED = "gpuwarden placement (snapshot 1764900000123): switches=1 wait=300s"
TOLD = ("gpuwarden: this job may wait up to 300 s for 2 nodes under one leaf switch (fewer "
        "network hops), then runs wherever it fits; to start anywhere at once, submit with "
        "--switches=2")
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "slurm_versions"


def gang(job_id: int = 7, *, state: str = "PENDING", restarts: int = 1,
         admin: str = PLACED, comment: str = TOLD, switches: int = 1, wait: int = 300) -> Job:
    """A gang job as `scontrol show job --json` shows it after Slurm requeued it."""
    return Job(job_id, "train", "alice", (state,), "BeginTime", "gpu", "", 2, restarts, None,
               admin, comment, None, switches, wait)


def test_a_requeued_job_gets_no_wait_and_is_told_so() -> None:
    r = requeue.relax(gang())
    assert r is not None and (r.job_id, r.switches, r.was_s, r.restarts) == (7, 1, 300, 1)
    assert r.admin_comment.startswith(PLACED + "; ")
    assert "requeued: switch wait relaxed (restart 1): 300s -> 0s" in r.admin_comment
    assert r.comment is not None and "requeued (restart 1)" in r.comment
    assert "starts wherever it fits" in r.comment


def test_the_users_own_comment_is_kept() -> None:
    r = requeue.relax(gang(comment="my run 42"))
    assert r is not None and r.comment is None


def test_a_wait_slurm_capped_shorter_is_still_the_filters() -> None:
    # [placement] wait_s=600 with max_switch_wait=300: Slurm holds 300.
    r = requeue.relax(gang(admin=PLACED.replace("300s", "600s"), wait=300))
    assert r is not None and r.was_s == 300


def test_the_last_placement_note_counts_after_an_admins_own() -> None:
    admin = "ticket 123; " + PLACED.replace("switches=1 wait=300s",
                                            "switches=1 wait=80s (by the running jobs' time "
                                            "limits); exclude c3")
    r = requeue.relax(gang(admin=admin, wait=80))
    assert r is not None and r.was_s == 80 and r.admin_comment.startswith("ticket 123; ")


@pytest.mark.parametrize(("job", "why"), [
    (gang(restarts=0), "never requeued: its first wait"),
    (gang(state="RUNNING"), "already running"),
    (gang(admin="gpuwarden placement (snapshot 5): --switches=1 kept", wait=300),
     "the user's own --switches"),
    (gang(admin=""), "not placed by gpuwarden"),
    (gang(admin="gpuwarden placement (snapshot 5): exclude c3", switches=0, wait=0),
     "only exclusions"),
    (gang(switches=2), "the user changed the switch count since"),
    (gang(wait=900), "the user made the wait longer since"),
    (gang(wait=0), "no wait (relaxed already, or Slurm's)"),
    (gang(admin="gpuwarden placement (snapshot 5): switches=1 wait=604800s"),
     "a required partition: the admin chose locality over start time"),
    (gang(admin="gpuwarden placement (snapshot 5): switches=1 wait=0s", wait=0),
     "the filter set no wait"),
    (gang(admin=PLACED + "; gpuwarden placement: requeued: switch wait relaxed (restart 1): "
          "300s -> 0s", restarts=2), "relaxed once already"),
])
def test_waits_that_are_not_the_filters_are_left_alone(job: Job, why: str) -> None:
    assert requeue.relax(job) is None, why


def test_an_oversized_admin_comment_is_not_parsed() -> None:
    assert requeue.relax(gang(admin="x" * 70_000 + PLACED)) is None


# ---- the daemon ------------------------------------------------------------------------------
class Slurm(FakeSlurm):
    def partitions(self) -> dict[str, tuple[str, ...]]:
        return {"gpu": tuple(self.table)}


def setup(tmp_path: Path, policy: PartitionPolicy | None = None
          ) -> tuple[PlacementConfig, Slurm, str]:
    topo = tmp_path / "topology.conf"
    topo.write_text(TREE)
    cfg = PlacementConfig(topology_file=str(topo), snapshot_file=str(tmp_path / "snap.lua"),
                          interval_s=1, stale_after_s=10,
                          default=policy or PartitionPolicy())
    return cfg, Slurm({f"c{i}": node(f"c{i}") for i in range(1, 9)}), str(tmp_path / "none")


@pytest.mark.parametrize("policy", [PartitionPolicy(), PartitionPolicy(wait_by="fixed")])
def test_the_daemon_relaxes_a_requeued_job_once(tmp_path: Path, policy: PartitionPolicy,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    cfg, slurm, lemons = setup(tmp_path, policy)
    slurm.job_table = {7: gang(7), 8: gang(8, restarts=0), 9: gang(9, comment="mine")}
    state = daemon.State()
    assert daemon.step(cfg, slurm, lemons, state, 1000.0) is not None  # type: ignore[arg-type]
    after = slurm.job_table
    assert after[7].switch_wait_s == 0 and requeue.RELAXED in after[7].admin_comment
    assert after[7].req_switch == 1  # the count stays: Slurm still prefers one leaf
    assert after[8] == gang(8, restarts=0)  # not requeued: waits as the filter said
    assert after[9].switch_wait_s == 0 and after[9].comment == "mine"
    assert "job 7 was requeued (restart 1): its switch wait (300 s" in caplog.text
    # The daemon's job list may be a minute old: a job is relaxed once, not every round.
    for t in (1005.0, 1010.0):
        daemon.step(cfg, slurm, lemons, state, t)  # type: ignore[arg-type]
    assert slurm.log.count("switch wait 7 0") == 1


def test_a_failed_update_is_logged_and_the_snapshot_still_written(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg, slurm, lemons = setup(tmp_path)
    slurm.job_table = {7: gang(7)}

    def refuse(*_args: object) -> None:
        raise SlurmError("scontrol update failed (exit 1): Job has already finished")

    slurm.set_switch_wait = refuse  # type: ignore[method-assign,assignment]
    assert daemon.step(cfg, slurm, lemons, daemon.State(), 1000.0) is not None  # type: ignore[arg-type]
    assert "job 7 was requeued (restart 1) but its switch wait" in caplog.text
    assert "Job has already finished" in caplog.text


def test_placement_off_reads_no_jobs(tmp_path: Path) -> None:
    cfg, slurm, lemons = setup(tmp_path, PartitionPolicy(mode="off"))
    slurm.job_table = {7: gang(7)}
    daemon.step(cfg, slurm, lemons, daemon.State(), 1000.0)  # type: ignore[arg-type]
    assert slurm.job_table[7] == gang(7)


def test_the_update_is_one_scontrol_call_on_the_job() -> None:
    runner = FakeRunner([ok(["scontrol"])])
    CliSlurmClient(SlurmConfig(), runner).set_switch_wait(7, 0, "a;\nb", "told")
    assert runner.calls == [("scontrol", "update", "jobid=7", "wait-for-switch=0",
                             "admincomment=a; b", "comment=told")]


@pytest.mark.parametrize("version", ["40", "41", "42", "43", "44", "45"])
def test_every_data_parser_version_gives_the_switches_and_wait(version: str) -> None:
    text = (FIXTURES / f"scontrol_show_job_v0.0.{version}.json").read_text()
    (job,) = parse.parse_jobs(text)
    assert (job.req_switch, job.switch_wait_s) == (1, 300)
    # The strict reader names a version that stops printing them.
    doc = json.loads(text)
    del doc["jobs"][0]["maximum_switch_wait_time"]
    with pytest.raises(SlurmError, match="maximum_switch_wait_time"):
        parse.parse_jobs(json.dumps(doc))
    assert replace(job, req_switch=0).req_switch == 0


def test_a_job_requeued_just_after_its_node_drained_is_relaxed_the_next_round(
        tmp_path: Path) -> None:
    """The prolog drains its node and then exits 1: the read prompted by the drain may see
    the job before Slurm requeued it. The daemon reads again for SETTLE_S after a change,
    not only a minute later."""
    cfg, slurm, lemons = setup(tmp_path)
    slurm.job_table = {7: gang(7, state="RUNNING", restarts=0)}
    state = daemon.State()
    daemon.step(cfg, slurm, lemons, state, 1000.0)  # type: ignore[arg-type]
    slurm.table["c4"] = node("c4", ("IDLE", "DRAIN"), "gpuwarden: prolog: xid 79")
    daemon.step(cfg, slurm, lemons, state, 1005.0)  # type: ignore[arg-type]
    slurm.job_table[7] = gang(7)  # Slurm requeues it a moment later
    daemon.step(cfg, slurm, lemons, state, 1010.0)  # type: ignore[arg-type]
    assert slurm.job_table[7].switch_wait_s == 0
