import pytest

from gpuwarden.core.errors import NotOurDrainError, SlurmError, SlurmUnavailableError
from gpuwarden.slurm.client import CliSlurmClient, gpuwarden_reason
from gpuwarden.slurm.settings import SlurmConfig
from tests.fakes import FakeRunner, fail, node_json, ok, timeout

UPDATE = ("scontrol", "update")


def make(script: list, retries: int = 3) -> tuple[CliSlurmClient, FakeRunner, list[float]]:
    runner = FakeRunner(script=script)
    sleeps: list[float] = []
    client = CliSlurmClient(SlurmConfig(retries=retries), runner, sleep=sleeps.append,
                            jitter=lambda: 1.0)
    return client, runner, sleeps


def test_drain_sets_a_namespaced_reason() -> None:
    client, runner, _ = make([lambda a: ok(a, node_json("c3", ["IDLE"])), lambda a: ok(a)])
    client.drain("c3", "xid 79 on GPU 5")
    assert runner.calls[-1] == (*UPDATE, "nodename=c3", "state=drain",
                                "reason=gpuwarden: xid 79 on GPU 5")


def test_drain_refuses_to_overwrite_an_operators_drain() -> None:
    client, runner, _ = make([lambda a: ok(a, node_json("c4", ["IDLE", "DRAIN"], "maintenance", "root"))])
    with pytest.raises(NotOurDrainError, match="maintenance.*root"):
        client.drain("c4", "xid 79")
    assert all(call[:2] != UPDATE for call in runner.calls)


def test_drain_may_rewrite_its_own_reason() -> None:
    client, runner, _ = make([
        lambda a: ok(a, node_json("c3", ["IDLE", "DRAIN"], "gpuwarden: old", "root")),
        lambda a: ok(a),
    ])
    client.drain("c3", "new evidence")
    assert runner.calls[-1][-1] == "reason=gpuwarden: new evidence"


def test_drain_refuses_a_node_slurm_marked_down() -> None:
    client, _, _ = make([lambda a: ok(a, node_json("c2", ["DOWN"], "Not responding", "slurm"))])
    with pytest.raises(NotOurDrainError, match="Not responding"):
        client.drain("c2", "x")


def test_resume_only_its_own_drains() -> None:
    client, runner, _ = make([
        lambda a: ok(a, node_json("c3", ["IDLE", "DRAIN"], "gpuwarden: xid 79", "root")),
        lambda a: ok(a),
    ])
    assert client.resume("c3") is True
    assert runner.calls[-1] == (*UPDATE, "nodename=c3", "state=resume")


def test_resume_refuses_an_operators_drain_and_changes_nothing() -> None:
    client, runner, _ = make([lambda a: ok(a, node_json("c4", ["IDLE", "DRAIN"], "maintenance", "root"))])
    with pytest.raises(NotOurDrainError, match="refusing to resume c4"):
        client.resume("c4")
    assert len(runner.calls) == 1


def test_resume_of_a_healthy_node_is_a_no_op() -> None:
    client, runner, _ = make([lambda a: ok(a, node_json("c1", ["IDLE"]))])
    assert client.resume("c1") is False
    assert len(runner.calls) == 1


def test_resume_refuses_a_drain_without_reason() -> None:
    client, _, _ = make([lambda a: ok(a, node_json("c1", ["DOWN"]))])
    with pytest.raises(NotOurDrainError, match="without a reason"):
        client.resume("c1")


def test_transient_errors_are_retried_with_growing_backoff() -> None:
    client, runner, sleeps = make([
        lambda a: fail(a, "slurm_load_node error: Unable to contact slurm controller (connect failure)"),
        timeout(["scontrol"]),
        lambda a: ok(a, node_json("c1", ["IDLE"])),
    ])
    assert client.node("c1").name == "c1"
    assert len(runner.calls) == 3
    assert sleeps == [0.5, 1.0]


def test_gives_up_after_the_configured_retries_and_says_what_to_check() -> None:
    client, _, sleeps = make([timeout(["scontrol"])] * 3, retries=2)
    with pytest.raises(SlurmUnavailableError, match="3 attempts.*scontrol ping"):
        client.nodes()
    assert len(sleeps) == 2


def test_permanent_errors_are_not_retried() -> None:
    client, runner, _ = make([lambda a: fail(a, "Invalid node name specified")])
    with pytest.raises(SlurmError, match="Invalid node name"):
        client.node("c99")
    assert len(runner.calls) == 1


@pytest.mark.parametrize("bad", ["c1;reboot", "../x", "", "c1 c2", "-rf"])
def test_node_names_are_validated_before_any_command(bad: str) -> None:
    client, runner, _ = make([])
    with pytest.raises(SlurmError, match="not a valid node name"):
        client.drain(bad, "x")
    assert runner.calls == []


def test_reason_text_is_normalised() -> None:
    assert gpuwarden_reason("  xid\n79 ") == "gpuwarden: xid 79"
    assert gpuwarden_reason("gpuwarden: twice") == "gpuwarden: twice"
    assert len(gpuwarden_reason("x" * 500)) == 200
    with pytest.raises(ValueError, match="why"):
        gpuwarden_reason("   ")


def test_bin_dir_prefixes_commands() -> None:
    runner = FakeRunner(script=[lambda a: ok(a, '{"nodes": []}')])
    CliSlurmClient(SlurmConfig(bin_dir="/opt/slurm/bin"), runner).nodes()
    assert runner.calls[0][0] == "/opt/slurm/bin/scontrol"


def test_windowed_sacct_asks_for_one_window() -> None:
    runner = FakeRunner(script=[lambda a: ok(a, '{"jobs": []}')])
    assert list(CliSlurmClient(SlurmConfig(), runner).acct_jobs("2026-11-01", "2026-11-02")) == []
    assert "--starttime=2026-11-01" in runner.calls[0] and "--endtime=2026-11-02" in runner.calls[0]


SINFO_OUT = ("sinfo", "--all", "--noheader", "--states=drain,down,fail", "--format=%N")


def nodes_json(*nodes: tuple[str, list[str], str]) -> str:
    import json

    docs = [json.loads(node_json(n, s, r, "root" if r else ""))["nodes"][0] for n, s, r in nodes]
    return json.dumps({"nodes": docs, "last_update": {"set": True, "infinite": False,
                                                       "number": 1795945096}})


def test_out_of_service_reads_only_the_nodes_out_of_service_and_the_ones_asked_for() -> None:
    client, runner, _ = make([
        lambda a: ok(a, "c[4,7]\nc[4,7]\ngpu-b[01-02]\n"),
        lambda a: ok(a, nodes_json(("c4", ["IDLE", "DRAIN"], "maintenance"),
                                   ("c7", ["IDLE", "DRAIN"], "gpuwarden: xid 79"),
                                   ("c3", ["IDLE"], ""))),
    ])
    view = client.out_of_service(also=("c3",))
    assert runner.calls == [SINFO_OUT,
                            ("scontrol", "--all", "show", "node", "c[4,7],gpu-b[01-02],c3",
                             "--json")]
    assert [n.name for n in view.nodes] == ["c4", "c7", "c3"] and view.ctld_time == 1795945096


def test_out_of_service_with_nothing_out_makes_one_call() -> None:
    client, runner, _ = make([lambda a: ok(a, "")])
    view = client.out_of_service()
    assert view.nodes == () and len(runner.calls) == 1


def test_out_of_service_drops_nodes_back_in_service_since_sinfo_ran() -> None:
    client, _, _ = make([lambda a: ok(a, "c4\n"),
                         lambda a: ok(a, nodes_json(("c4", ["IDLE"], "")))])
    assert client.out_of_service().nodes == ()


def test_a_huge_scattered_out_of_service_list_falls_back_to_one_whole_read() -> None:
    names = ",".join(f"gpu-node-{i:05d}" for i in range(0, 20_000, 2))
    client, runner, _ = make([lambda a: ok(a, names + "\n"), lambda a: ok(a, '{"nodes": []}')])
    client.out_of_service()
    assert runner.calls[1] == ("scontrol", "--all", "show", "nodes", "--json")


def test_partition_sizes_come_from_one_partition_read() -> None:
    doc = ('{"partitions": [{"name": "gpu", "nodes": {"configured": "c[1-8]", "total": 8}},'
           ' {"name": "debug", "nodes": {"configured": "c1", "total": 1}}]}')
    client, runner, _ = make([lambda a: ok(a, doc)])
    assert client.partition_sizes() == {"gpu": 8, "debug": 1}
    assert runner.calls == [("scontrol", "--all", "show", "partition", "--json")]


def test_drain_in_service_only_never_takes_over_another_gpuwarden_drain() -> None:
    from gpuwarden.slurm.client import NodeBusyError

    client, runner, _ = make([
        lambda a: ok(a, node_json("c3", ["IDLE", "DRAIN"], "gpuwarden: lemon, 7 of 41", "root"))])
    with pytest.raises(NodeBusyError, match="already IDLE\\+DRAIN.*lemon"):
        client.drain("c3", "xid 79", in_service_only=True)
    assert all(call[:2] != UPDATE for call in runner.calls)


def test_resume_with_an_expected_reason_refuses_a_drain_made_since() -> None:
    client, runner, _ = make([
        lambda a: ok(a, node_json("c3", ["IDLE", "DRAIN"], "gpuwarden: lemon, 7 of 41", "root"))])
    with pytest.raises(NotOurDrainError, match="drained again since"):
        client.resume("c3", expect_reason="gpuwarden: xid 79")
    assert all(call[:2] != UPDATE for call in runner.calls)


def _two_jobs_json() -> str:
    """An array's `scontrol show job <id> --json`: every member, the asked one not first."""
    import copy
    import json
    from pathlib import Path

    doc = json.loads((Path(__file__).parent.parent / "fixtures" / "slurm_versions" /
                      "scontrol_show_job_v0.0.42.json").read_text())
    other = copy.deepcopy(doc["jobs"][0])
    other["job_id"], other["comment"] = 1236, "someone else's"
    doc["jobs"].insert(0, other)
    return json.dumps(doc)


def test_job_returns_the_asked_job_not_the_first_member() -> None:
    text = _two_jobs_json()
    client, _, _ = make([lambda a: ok(a, text)])
    assert client.job(1235).job_id == 1235
    client, _, _ = make([lambda a: ok(a, text)])
    with pytest.raises(SlurmError, match="job 99 is not known"):
        client.job(99)


def test_bytes_that_are_not_utf8_in_slurms_output_do_not_fail_the_reader() -> None:
    from gpuwarden.slurm.runner import SubprocessRunner

    res = SubprocessRunner().run(["printf", "caf\\351 ok"], 10.0)
    assert res.returncode == 0 and res.stdout == "caf\ufffd ok"
