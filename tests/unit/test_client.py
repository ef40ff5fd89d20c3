import pytest

from gpuwarden.config import SlurmConfig
from gpuwarden.errors import NotOurDrainError, SlurmError, SlurmUnavailableError
from gpuwarden.slurm.client import CliSlurmClient, gpuwarden_reason
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
