"""Issue 38: the placement daemon's gpuwarden_placement.prom after good and failed rounds, read
back with Prometheus's parser; no job or reason text ever becomes a label value."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from gpuwarden import config as configmod
from gpuwarden.config.placement import PartitionPolicy, PlacementConfig
from gpuwarden.core import metrics
from gpuwarden.core.errors import SlurmError
from gpuwarden.lemon.scoring import NodeScore
from gpuwarden.placement import daemon, promfile, reload, requeue
from gpuwarden.slurm.client import gpuwarden_reason
from gpuwarden.slurm.models import Job, Node
from gpuwarden.slurm.reasons import drain_owner, health_reason
from tests.promtext import parse, value
from tests.unit.test_placement import node
from tests.unit.test_placement_requeue import PLACED, Slurm, gang, setup

FILE = "gpuwarden_placement.prom"
HEALTH = gpuwarden_reason(health_reason("XID 79 on GPU 2", "periodic"))
LEMON = gpuwarden_reason("lemon, 6 of 40 jobs failed, fleet rate 1.2%")


def fleet() -> dict[str, Node]:
    """c1 drained by health gating, c2 by the lemon scanner, c3 by an operator, c4 down
    (health's reason, no drain), c5 mixed, c6 allocated, c7-c8 idle."""
    t = {f"c{i}": node(f"c{i}") for i in range(1, 9)}
    t["c1"] = replace(t["c1"], state=("IDLE", "DRAIN"), reason=HEALTH, reason_changed_at=900)
    t["c2"] = replace(t["c2"], state=("IDLE", "DRAIN"), reason=LEMON, reason_changed_at=800)
    t["c3"] = replace(t["c3"], state=("MIXED", "DRAIN"), reason="fan replacement",
                      reason_set_by="alice", reason_changed_at=700)
    t["c4"] = replace(t["c4"], state=("DOWN", "NOT_RESPONDING"), reason="Not responding",
                      reason_changed_at=600)
    t["c5"] = replace(t["c5"], state=("MIXED",))
    t["c6"] = replace(t["c6"], state=("ALLOCATED", "COMPLETING"))
    return t


def job(job_id: int, admin: str = "", *, nodes: int = 2, state: str = "PENDING",
        switches: int = 0, wait: int = 0, restarts: int = 0, partition: str = "gpu") -> Job:
    return Job(job_id, "train", "alice", (state,), "", partition, "", nodes, restarts, None,
               admin, "", None, switches, wait)


def jobs() -> dict[int, Job]:
    note = "gpuwarden placement (snapshot 17): "
    return {
        1: gang(1, restarts=0),  # placed
        2: job(2, PLACED, switches=1, wait=300, state="RUNNING"),  # placed, running
        3: job(3, f"{PLACED}; gpuwarden placement: {requeue.RELAXED} (restart 1): 300s -> 0s",
               switches=1, restarts=1),  # relaxed
        4: job(4, note + "only 1 healthy nodes; excluded c1 (suspect)"),  # excluded
        5: job(5, note + "--switches=2 kept; excluded c1 (suspect)", switches=2),  # user_set
        6: job(6, switches=2, wait=60),  # user_set: --switches, nothing from the filter
        7: job(7),  # unchanged: failed open, or not a gang job by the filter's rules
        8: job(8, nodes=1),  # one node: never a gang job
        9: job(9, PLACED, state="COMPLETED", switches=1, wait=300),  # over
    }


def round_(tmp_path: Path, cfg: PlacementConfig, slurm: Slurm, state: daemon.State,
           now: float) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    snap = daemon.step(cfg, slurm, str(tmp_path / "none"), state, now)  # type: ignore[arg-type]
    daemon.publish(cfg, state, snap is not None, now)
    return parse(tmp_path / "prom" / FILE)[0]


def get(values: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
        **labels: str) -> float | None:
    return values.get((name, tuple(sorted(labels.items()))))


def test_a_round_writes_nodes_by_state_drains_by_owner_and_jobs_by_outcome(tmp_path: Path) -> None:
    cfg, slurm, _ = setup(tmp_path)
    slurm.table = fleet()
    slurm.job_table = jobs()
    state = daemon.State(prom_dir=str(tmp_path / "prom"))
    v = round_(tmp_path, cfg, slurm, state, 1000.0)
    _, kinds = parse(tmp_path / "prom" / FILE)
    assert kinds["gpuwarden_placement_rounds_total"] == "counter"
    assert {kinds[m.name] for m in metrics.FILES[FILE] if m.name in kinds} == {"gauge", "counter"}
    assert get(v, "gpuwarden_placement_snapshot_timestamp_seconds") == 1000.0
    assert get(v, "gpuwarden_placement_rounds_total", outcome="ok") == 1
    assert get(v, "gpuwarden_placement_rounds_total", outcome="failed") == 0
    by_state = {s: get(v, "gpuwarden_slurm_nodes", state=s) for s in metrics.NODE_STATES}
    assert by_state == {"idle": 2, "allocated": 1, "mixed": 1, "drained_health": 1,
                        "drained_lemon": 1, "drained_other": 1, "down": 1, "other": 0}
    since = {k: val for k, val in v.items()
             if k[0] == "gpuwarden_node_drained_since_timestamp_seconds"}
    assert since == {
        ("gpuwarden_node_drained_since_timestamp_seconds",
         (("node", "c1"), ("owner", "health"))): 900.0,
        ("gpuwarden_node_drained_since_timestamp_seconds",
         (("node", "c2"), ("owner", "lemon"))): 800.0}
    # c4 is down: Slurm knows it, but no verdict is expected from it (nothing to miss).
    assert {k[1][0][1] for k in v if k[0] == "gpuwarden_slurm_node_info"} == \
        {f"c{i}" for i in range(1, 9)} - {"c4"}
    outcomes = {o: get(v, "gpuwarden_placement_jobs", outcome=o) for o in metrics.JOB_OUTCOMES}
    assert outcomes == {"placed": 2, "excluded": 1, "user_set": 2, "relaxed": 1, "shadow": 0,
                        "unchanged": 1}


def test_a_failed_round_counts_and_the_snapshot_s_time_stays_where_it_was(tmp_path: Path) -> None:
    cfg, slurm, _ = setup(tmp_path)
    state = daemon.State(prom_dir=str(tmp_path / "prom"))
    round_(tmp_path, cfg, slurm, state, 1000.0)
    Path(cfg.topology_file).unlink()  # the next rounds fail: the snapshot goes stale
    v = round_(tmp_path, cfg, slurm, state, 1005.0)
    assert get(v, "gpuwarden_placement_rounds_total", outcome="failed") == 1
    assert get(v, "gpuwarden_placement_snapshot_timestamp_seconds") == 1000.0
    assert get(v, "gpuwarden_slurm_node_info", node="c1") == 1  # read 5 s ago: still shown
    # Nodes last read longer ago than the snapshot's stale_after_s: left out, never made up.
    v = round_(tmp_path, cfg, slurm, state, 1000.0 + cfg.stale_after_s + 1)
    assert get(v, "gpuwarden_placement_rounds_total", outcome="failed") == 2
    assert not any(k[0] in ("gpuwarden_slurm_node_info", "gpuwarden_slurm_nodes") for k in v)


def test_jobs_read_before_slurm_became_unreachable_are_not_shown_as_now(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm unreachable: the jobs by outcome go the way the nodes go (left out once their
    read is stale), not frozen at the last read's numbers for as long as it lasts."""
    cfg, slurm, _ = setup(tmp_path)
    slurm.job_table = jobs()
    state = daemon.State(prom_dir=str(tmp_path / "prom"))
    v = round_(tmp_path, cfg, slurm, state, 1000.0)
    assert get(v, "gpuwarden_placement_jobs", outcome="placed") == 2

    def unreachable() -> list[Node]:
        raise SlurmError("sinfo: Unable to contact slurm controller (connect failure)")

    monkeypatch.setattr(slurm, "nodes", unreachable)
    later = 1000.0 + max(cfg.stale_after_s, daemon.JOBS_MAX_AGE_S) + 1
    v = round_(tmp_path, cfg, slurm, state, later)
    assert get(v, "gpuwarden_placement_rounds_total", outcome="failed") == 1
    assert not any(k[0] in ("gpuwarden_placement_jobs", "gpuwarden_slurm_nodes") for k in v)


def test_no_snapshot_the_filter_would_read_is_time_0(tmp_path: Path) -> None:
    cfg, slurm, _ = setup(tmp_path)
    Path(cfg.topology_file).unlink()
    state = daemon.State(prom_dir=str(tmp_path / "prom"))
    v = round_(tmp_path, cfg, slurm, state, 1000.0)
    assert get(v, "gpuwarden_placement_snapshot_timestamp_seconds") == 0


def test_jobs_of_a_shadow_or_off_partition(tmp_path: Path) -> None:
    shadow = PlacementConfig(default=PartitionPolicy(shadow=True),
                             partitions={"cpu": PartitionPolicy(mode="off")})
    assert promfile.job_outcome(job(1), shadow) == "shadow"
    assert promfile.job_outcome(job(1, partition="cpu"), shadow) is None
    assert promfile.job_outcome(job(1, partition="cpu,gpu"), shadow) is None  # the first
    required = PlacementConfig(default=PartitionPolicy(mode="required", min_nodes=4))
    assert promfile.job_outcome(job(1, nodes=3), required) is None


def test_hostile_job_and_reason_text_never_becomes_a_label(tmp_path: Path) -> None:
    evil = '"}\ngpuwarden_placement_jobs{outcome="pwned"} 1e9\n# TYPE x counter\n\\'
    cfg, slurm, _ = setup(tmp_path)
    slurm.table = fleet()
    slurm.table["c7"] = replace(slurm.table["c7"], state=("IDLE", "DRAIN"),
                                reason=gpuwarden_reason(f"lemon, 1 of 2 jobs failed {evil}"),
                                reason_changed_at=5)
    slurm.table["c8"] = replace(slurm.table["c8"], state=("IDLE", "DRAIN"), reason=evil,
                                reason_changed_at=5)
    slurm.table['c"9'] = node('c"9')  # no Slurm node name: left out, not escaped in
    slurm.job_table = {1: job(1, evil + PLACED + evil), 2: job(2, "x" * 70_000 + PLACED),
                       3: replace(job(3), name=evil, user=evil, comment=evil,
                                  partition=evil)}
    state = daemon.State(prom_dir=str(tmp_path / "prom"))
    v = round_(tmp_path, cfg, slurm, state, 1000.0)
    labels = {(name, k, val) for name, pairs in v for k, val in pairs}
    allowed = {"outcome": set(metrics.ROUND_OUTCOMES) | set(metrics.JOB_OUTCOMES),
               "state": set(metrics.NODE_STATES), "owner": set(metrics.OWNERS),
               "node": {f"c{i}" for i in range(1, 9)},
               "job_state": set(metrics.LOST_JOB_STATES)}
    for name, key, val in labels:
        assert val in allowed[key], (name, key, val)
    assert get(v, "gpuwarden_slurm_nodes", state="drained_lemon") == 2
    assert get(v, "gpuwarden_slurm_nodes", state="drained_other") == 2
    assert get(v, "gpuwarden_placement_jobs", outcome="placed") == 1
    assert get(v, "gpuwarden_placement_jobs", outcome="unchanged") == 2
    assert sum(val for (name, _), val in v.items() if name == "gpuwarden_placement_jobs") == 3
    text = (tmp_path / "prom" / FILE).read_text()
    assert "pwned" not in text and "c\"9" not in text


def test_render_refuses_a_label_outside_its_set() -> None:
    with pytest.raises(metrics.LabelError, match="outcome"):
        metrics.render(FILE, {metrics.JOBS: [(("pwned",), 1.0)]})
    with pytest.raises(metrics.LabelError, match="node"):
        metrics.render(FILE, {metrics.NODE_INFO: [(('c1"} 1\nx',), 1.0)]})
    with pytest.raises(ValueError, match="not its series"):
        metrics.render(FILE, {metrics.DRAINS: []})


def test_a_textfile_that_cannot_be_written_is_logged_once_and_the_snapshot_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg, slurm, _ = setup(tmp_path)
    prom = tmp_path / "prom"
    prom.mkdir()
    prom.chmod(0o777)
    state = daemon.State(prom_dir=str(prom))
    with caplog.at_level(logging.ERROR):
        for t in (1000.0, 1005.0, 1010.0):
            assert daemon.step(cfg, slurm, str(tmp_path / "none"), state, t) is not None  # type: ignore[arg-type]
            daemon.publish(cfg, state, True, t)
    said = [r for r in caplog.records if FILE in r.getMessage()]
    assert len(said) == 1 and "writable by group or others" in said[0].getMessage()
    prom.chmod(0o755)
    daemon.publish(cfg, state, True, 1015.0)
    assert value(prom / FILE, "gpuwarden_placement_rounds_total", outcome="ok") == 4


def test_no_prom_dir_no_file_and_no_job_reads_without_a_preferred_policy(tmp_path: Path) -> None:
    cfg, slurm, _ = setup(tmp_path, PartitionPolicy(mode="required"))
    slurm.job_table = jobs()
    state = daemon.State()
    daemon.step(cfg, slurm, str(tmp_path / "none"), state, 1000.0)  # type: ignore[arg-type]
    daemon.publish(cfg, state, True, 1000.0)
    assert state.jobs is None and not (tmp_path / "prom").exists()
    # With the textfile on, the jobs are read for it (as often as for the fit tables).
    state = daemon.State(prom_dir=str(tmp_path / "prom"))
    v = round_(tmp_path, cfg, slurm, state, 1000.0)
    assert get(v, "gpuwarden_placement_jobs", outcome="placed") == 2


def test_the_daemon_command_writes_to_health_prom_dir_and_follows_a_reload(
        tmp_path: Path) -> None:
    cfg, slurm, _ = setup(tmp_path)
    conf = tmp_path / "gw.toml"
    conf.write_text(f"[health]\nprom_dir = '{tmp_path / 'a'}'\n[placement]\ntopology_file = "
                    f"'{cfg.topology_file}'\nsnapshot_file = '{cfg.snapshot_file}'\n")
    loaded = configmod.load(conf)
    reloader = reload.Reloader(conf, loaded)

    class Stop(Exception):
        pass

    rounds = [0]

    def sleep(seconds: float) -> None:
        rounds[0] += 1
        if rounds[0] == 1:
            conf.write_text(conf.read_text().replace(f"{tmp_path / 'a'}", f"{tmp_path / 'b'}")
                            + "\n")
        else:
            raise Stop

    with pytest.raises(Stop):
        daemon.run(loaded.placement, lambda: slurm, "", clock=lambda: 1000.0, sleep=sleep,  # type: ignore[arg-type,return-value]
                   reload=reloader, prom_dir=loaded.health.prom_dir)
    assert value(tmp_path / "a" / FILE, "gpuwarden_placement_rounds_total", outcome="ok") == 1
    assert value(tmp_path / "b" / FILE, "gpuwarden_placement_rounds_total", outcome="ok") == 2


def test_the_owners_are_told_apart_by_their_reasons() -> None:
    score = NodeScore("c1", 40, 10.0, 6, 0.5, 0.9, 0.012, 1e-6, 1e-5, True, ())
    assert drain_owner(gpuwarden_reason(score.summary)) == "lemon"
    assert drain_owner(HEALTH) == "health"
    assert drain_owner(HEALTH + " : Not responding") == "health"
    assert drain_owner(gpuwarden_reason("lemon suspicion, by hand")) == ""  # `gpuwarden drain`
    assert drain_owner("lemon, 6 of 40 jobs failed") == ""  # not gpuwarden's reason
    assert drain_owner("") == ""


def test_nodes_the_launchers_lost_are_counted_by_their_job_s_state() -> None:
    lost = "gpuwarden-launch: lost c3 (rank 1: no heartbeat for 6.0 s); c7 (rank 0)"
    js = [replace(job(1, state="RUNNING"), comment=lost),  # two ranks now on spares
          replace(job(2), comment="gpuwarden-launch: lost c4 (rank 2)"),  # requeued
          replace(job(3, state="COMPLETED"), comment=lost),  # over: not counted
          replace(job(4, state="RUNNING"), comment="gpuwarden-launch: lost c9 (x"),  # not a note
          replace(job(5, state="RUNNING"), comment="my own comment")]
    assert promfile.lost_nodes(js) == {"running": 2, "pending": 1}
    # The same nodes named by many jobs count once; a job names at most its own node count;
    # with Slurm's nodes known, a name it does not know is not counted.
    many = [replace(job(10 + i), comment="gpuwarden-launch: lost c4 (rank 0); x9 (rank 1)",
                    num_nodes=1) for i in range(100)]
    assert promfile.lost_nodes(many) == {"running": 0, "pending": 1}
    wide = [replace(job(20), comment="gpuwarden-launch: lost c4 (rank 0); x9 (rank 1)")]
    assert promfile.lost_nodes(wide, known=["c4"]) == {"running": 0, "pending": 1}
    got = promfile.samples(None, {}, js, None, PlacementConfig())[metrics.LAUNCH_NODES_LOST]
    assert got == [(("running",), 2.0), (("pending",), 1.0)]


def test_nodes_asleep_or_down_are_not_expected_to_report() -> None:
    up = node("c1")
    assert promfile.should_report(up)
    for state in (("IDLE", "POWERED_DOWN"), ("IDLE", "POWERING_DOWN"), ("FUTURE",),
                  ("DOWN", "NOT_RESPONDING"), ("IDLE", "FAIL")):
        assert not promfile.should_report(replace(up, state=state)), state
    assert promfile.should_report(replace(up, state=("IDLE", "DRAIN")))  # drained: still checks
