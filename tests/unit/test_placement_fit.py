"""Issue 19: the wait a gang job gets, chosen from what the snapshot knows (free nodes per
leaf, the running jobs' time limits) instead of one fixed wait_s; the Lua filter decides as
the Python reference."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gpuwarden.config.placement import PartitionPolicy, PlacementConfig
from gpuwarden.placement import daemon, snapshot
from gpuwarden.placement.decide import SCHED_MARGIN_S, JobRequest, decide
from gpuwarden.slurm import topology
from gpuwarden.slurm.models import Job
from tests.fakes import FakeSlurm
from tests.unit.test_placement import TREE, node, run_filter

NOW = 1_800_000_000


def running(job_id: int, nodes: str, ends_in: float | None, state: str = "RUNNING") -> Job:
    return Job(job_id, "j", "alice", (state,), "", "gpu", nodes, 1, 0, None, "", "",
               None if ends_in is None else int(NOW + ends_in))


def fitted(jobs: list[Job], policy: PartitionPolicy | None = None) -> snapshot.Snapshot:
    """Two leaves of four (c1-c4, c5-c8); a node a job runs on is ALLOCATED."""
    busy = {n for j in jobs for n in __import__("gpuwarden.slurm.hostlist",
                                                 fromlist=["expand"]).expand(j.nodes)}
    nodes = [node(f"c{i}", ("ALLOCATED",) if f"c{i}" in busy else ("IDLE",))
             for i in range(1, 9)]
    cfg = PlacementConfig(default=policy or PartitionPolicy(wait_s=300))
    return snapshot.build(cfg, topology.parse(TREE), nodes,
                          {"gpu": tuple(n.name for n in nodes)}, (), 7, NOW, jobs)


def test_a_leaf_that_frees_soon_is_waited_for_only_that_long() -> None:
    # leaf1: c1, c2 free, c3-c4 end in 45 s; leaf2: c5-c8 busy for an hour.
    s = fitted([running(1, "c[3-4]", 45), running(2, "c[5-8]", 3600)])
    d = decide(s, JobRequest(4, True), now=NOW)
    assert (d.switches, d.wait_s) == (1, 50 + SCHED_MARGIN_S)  # 45 s rounded up to 10 s
    assert "by the running jobs' time limits" in d.why and "up to 80 s" in d.user_message
    # Two nodes fit now: the policy's wait (Slurm starts it at once).
    assert decide(s, JobRequest(2, True), now=NOW).wait_s == 300


def test_no_leaf_freeing_within_the_wait_means_no_wait() -> None:
    s = fitted([running(1, "c[1-2]", 3600), running(2, "c[5-6]", 3600)])
    d = decide(s, JobRequest(4, True), now=NOW)
    assert (d.switches, d.wait_s) == (1, 0) and "not within 300s" in d.why
    assert d.user_message == "" and d.comment is None  # nothing to wait for, nothing said


@pytest.mark.parametrize("job", [
    running(1, "c[1-8]", None),  # no end time at all
    running(1, "c[1-8]", 365 * 86_400),  # unlimited: Slurm dates its end a year on
    running(1, "c[1-8]", -60),  # past its end: OverTimeLimit, or a year-old unlimited job
    running(1, "c[1-8]", 30, state="SUSPENDED"),  # its end moves while it is suspended
])
def test_an_end_that_cannot_be_told_is_never_promised(job: Job) -> None:
    assert decide(fitted([job]), JobRequest(4, True), now=NOW).wait_s == 0


def test_a_node_list_that_cannot_be_read_makes_every_busy_node_unknown() -> None:
    s = fitted([running(1, "c[3-4]", 45), running(2, "c[5-8]", 3600)])
    jobs = [running(1, "c[3-4]", 45), running(2, "c[5-8", 40)]
    nodes = [node(f"c{i}", ("ALLOCATED",) if i > 2 else ("IDLE",)) for i in range(1, 9)]
    free_at = snapshot.releases(nodes, jobs, NOW)
    assert free_at["c1"] == 0 and all(math.isinf(free_at[f"c{i}"]) for i in range(3, 9))
    assert decide(s, JobRequest(4, True), now=NOW).wait_s == 80  # the readable case


@pytest.mark.parametrize("state, free", [
    (("IDLE",), True), (("IDLE", "DYNAMIC_NORM"), True), (("IDLE", "CLOUD"), True),
    (("IDLE", "POWERED_DOWN"), True), (("IDLE", "COMPLETING"), False),
    (("IDLE", "PLANNED"), False), (("IDLE", "RESERVED"), False),
    (("IDLE", "NOT_RESPONDING"), False), (("MIXED",), False), (("ALLOCATED",), False),
])
def test_an_idle_node_is_free_unless_a_flag_says_otherwise(state: tuple[str, ...],
                                                           free: bool) -> None:
    got = snapshot.releases([node("c1", state)], [], NOW)["c1"]
    assert (got == 0) is free


def test_a_job_that_starts_later_waits_the_policys_wait() -> None:
    """Slurm starts the wait clock when it first looks at the job: for --begin later, a
    dependency or a held job, today's cluster state says nothing."""
    s = fitted([running(1, "c[1-2]", 3600), running(2, "c[5-6]", 3600)])
    d = decide(s, JobRequest(4, True, deferred=True), now=NOW)
    assert (d.switches, d.wait_s) == (1, 300)


@pytest.mark.parametrize("extra", [
    'dependency = "afterok:9", ', f"begin_time = {NOW + 600}, ", "priority = 0, "])
def test_the_lua_filter_gives_a_deferred_job_the_policys_wait(tmp_path: Path,
                                                               extra: str) -> None:
    s = fitted([running(1, "c[1-2]", 3600), running(2, "c[5-6]", 3600)])
    got = run_filter(tmp_path, snapshot.render(s), [JobRequest(4, True)], now=NOW,
                     extra=extra)[0]
    assert got.get("wait4switch") == "300", got
    now = run_filter(tmp_path, snapshot.render(s), [JobRequest(4, True)], now=NOW,
                     extra=f"begin_time = {NOW - 5}, ")[0]
    assert now.get("wait4switch") == "0", now


def test_the_daemon_reads_jobs_only_when_nodes_change_and_survives_a_failed_read(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from gpuwarden.core.errors import SlurmError
    topo = tmp_path / "topology.conf"
    topo.write_text(TREE)
    cfg = PlacementConfig(topology_file=str(topo), snapshot_file=str(tmp_path / "snap.lua"),
                          interval_s=1, stale_after_s=10)
    reads: list[int] = []
    broken = [False]

    class Slurm(FakeSlurm):
        def partitions(self) -> dict[str, tuple[str, ...]]:
            return {"gpu": tuple(self.table)}

        def jobs(self) -> list[Job]:
            reads.append(1)
            if broken[0]:
                raise SlurmError("scontrol show job --json: timed out after 30 s")
            return super().jobs()

    slurm = Slurm({f"c{i}": node(f"c{i}", ("ALLOCATED",) if i <= 2 else ("IDLE",))
                   for i in range(1, 9)})
    slurm.job_table[1] = running(1, "c[1-2]", 95)
    state, lemons = daemon.State(), str(tmp_path / "none.json")
    for t in range(0, 20, 5):
        assert daemon.step(cfg, slurm, lemons, state, NOW + t) is not None  # type: ignore[arg-type]
    assert len(reads) == 1  # nodes unchanged: the jobs read once
    slurm.table["c3"] = node("c3", ("ALLOCATED",))
    broken[0] = True
    snap = daemon.step(cfg, slurm, lemons, state, NOW + 25)  # type: ignore[arg-type]
    assert snap is not None and snap.partitions["gpu"].fit == ()  # fixed waits, not stale
    assert "running jobs not read" in caplog.text
    assert decide(snap, JobRequest(4, True), now=NOW + 25).wait_s == 300


def test_fixed_and_required_policies_keep_their_wait() -> None:
    jobs = [running(1, "c[1-2]", 3600), running(2, "c[5-6]", 3600)]
    fixed = fitted(jobs, PartitionPolicy(wait_by="fixed"))
    assert fixed.partitions["gpu"].fit == () and decide(fixed, JobRequest(4, True)).wait_s == 300
    req = fitted(jobs, PartitionPolicy(mode="required"))
    assert decide(req, JobRequest(4, True), now=NOW).wait_s == 7 * 86_400


def test_the_fit_table_takes_the_fewest_leaves_and_rounds_ends_up() -> None:
    leaves = [[0, 0, NOW + 50, NOW + 55], [NOW + 200] * 4, [0, NOW + 400, NOW + 400, NOW + 400],
              [math.inf] * 4]
    assert snapshot.fit_table(leaves, 300, NOW) == (
        (1, 0), (3, NOW + 50), (4, NOW + 60), (6, NOW + 200), (10, snapshot.NO_FIT))


def test_the_table_and_its_generation_do_not_change_while_the_jobs_do_not(
        tmp_path: Path) -> None:
    topo = tmp_path / "topology.conf"
    topo.write_text(TREE)
    cfg = PlacementConfig(topology_file=str(topo), snapshot_file=str(tmp_path / "snap.lua"),
                          interval_s=1, stale_after_s=10)
    slurm = FakeSlurm({f"c{i}": node(f"c{i}", ("ALLOCATED",) if i <= 2 else ("IDLE",))
                       for i in range(1, 9)})
    slurm.partitions = lambda: {"gpu": tuple(slurm.table)}  # type: ignore[method-assign]
    slurm.job_table[1] = running(1, "c[1-2]", 95)
    state = daemon.State()
    first = daemon.step(cfg, slurm, str(tmp_path / "none.json"), state, NOW)  # type: ignore[arg-type]
    assert first is not None and first.partitions["gpu"].fit[0] == (1, 0)
    later = daemon.step(cfg, slurm, str(tmp_path / "none.json"), state, NOW + 7)  # type: ignore[arg-type]
    assert later is not None and later.generation == first.generation
    # Six free now; seven or eight once c1-c2's limit (95 s, up to a 10 s step) is up.
    assert f"\nfit gpu 1:0 7:{NOW + 100}\n" in Path(cfg.snapshot_file).read_text()
    slurm.job_table[2] = running(2, "c[5-8]", 30)
    for n in ("c5", "c6", "c7", "c8"):
        slurm.table[n] = node(n, ("ALLOCATED",))
    busy = daemon.step(cfg, slurm, str(tmp_path / "none.json"), state, NOW + 9)  # type: ignore[arg-type]
    assert busy is not None and busy.generation > first.generation
    assert busy.partitions["gpu"].fit[:2] == ((1, 0), (3, NOW + 30))


def test_the_lua_filter_waits_as_the_python_reference(tmp_path: Path) -> None:
    jobs = [running(1, "c[3-4]", 45), running(2, "c[5-6]", 3600), running(3, "c7", 250)]
    s = fitted(jobs)
    cases = [JobRequest(n, True) for n in range(2, 9)]
    results = run_filter(tmp_path, snapshot.render(s), cases, now=NOW)
    for job, got in zip(cases, results, strict=True):
        want = decide(s, job, now=NOW)
        assert got.get("req_switch") == str(want.switches), job
        assert got.get("wait4switch") == str(want.wait_s), job
        assert got["admin_comment"] == f"gpuwarden placement (snapshot 7): {want.why}", job
        said = [x for x in got["logs"] if x.startswith("user: ")]  # type: ignore[attr-defined]
        assert said == ([f"user: {want.user_message}"] if want.user_message else []), job
    assert {r.get("wait4switch") for r in results} >= {"80", "0", "300"}


@pytest.mark.parametrize("line", [
    "fit gpu 3:0 1:5",  # not ascending
    "fit gpu 1:-2",
    "fit gpu",
    "fit gpu 1:0  2:5",
    "fit cpu 1:0",  # no such partition
    "fit gpu 1:-0", "fit gpu 0:5", "fit gpu 2:0",  # never written: N from 1, -1 or a time
    "fit gpu 1:0 2:0",  # a run repeated
    "fit gpu 1:0 99:-1",  # more nodes than the partition's healthy ones
    "fit gpu 1:0 ",
    "fit gpu 1:0 2:123456789012345",
])
def test_a_bad_fit_line_lets_the_job_through_unchanged(tmp_path: Path, line: str) -> None:
    text = snapshot.render(fitted([running(1, "c[1-2]", 45)]))
    head, _, rest = text.partition("\nfit gpu ")
    text = head + "\n" + line + "\n" + rest.split("\n", 1)[1]
    got = run_filter(tmp_path, text, [JobRequest(4, True)], now=NOW)[0]
    assert "req_switch" not in got and any("unchanged" in x for x in got["logs"])  # type: ignore[attr-defined]
