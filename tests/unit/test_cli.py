"""The gpuwarden command, with the Slurm client swapped for a fake through ctx.obj."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwarden.cli import cli
from gpuwarden.config import Config
from gpuwarden.config.context import Context
from gpuwarden.core.errors import NotOurDrainError, SlurmError, SlurmUnavailableError
from gpuwarden.slurm.client import NodeBusyError, gpuwarden_reason, refuse_unless_ours
from gpuwarden.slurm.models import Node


def node(name: str, state: tuple[str, ...] = ("IDLE",), reason: str = "", by: str = "",
         extra: str = "") -> Node:
    return Node(name, state, reason, by, None, ("gpu",), "gpu:h100:8", (), None, extra=extra)


@dataclass
class FakeClient:
    """In-memory Slurm with the real drain rules applied."""

    table: dict[str, Node] = field(default_factory=dict)
    down: bool = False

    def nodes(self) -> list[Node]:
        if self.down:
            raise SlurmUnavailableError("`scontrol show nodes --json` failed after 4 attempts")
        return list(self.table.values())

    def node(self, name: str) -> Node:
        if name not in self.table:
            raise SlurmError(f"node {name} is not known to slurmctld")
        return self.table[name]

    def drain(self, name: str, reason: str, *, in_service_only: bool = False) -> None:
        n = self.node(name)
        refuse_unless_ours(n, "drain")
        if in_service_only and (n.drained or n.down):
            raise NodeBusyError(f"not draining {name}: already {n.state_text}")
        self.table[name] = node(name, ("IDLE", "DRAIN"), gpuwarden_reason(reason), "root")

    def resume(self, name: str) -> bool:
        n = self.node(name)
        if not n.drained:
            return False
        refuse_unless_ours(n, "resume")
        self.table[name] = node(name)
        return True


def run(client: FakeClient, *args: str, config: str | None = None) -> tuple[int, str, str]:
    ctx = Context(config_path=config, client_factory=lambda cfg: client)  # type: ignore[arg-type,return-value]
    res = CliRunner().invoke(cli, list(args), obj=ctx)
    return res.exit_code, res.stdout, res.stderr


@pytest.fixture(autouse=True)
def config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Commands that act on nodes need a config file: an empty one (all defaults)."""
    p = tmp_path / "gpuwarden.toml"
    p.write_text("")
    monkeypatch.setenv("GPUWARDEN_CONFIG", str(p))
    return p


@pytest.fixture
def fleet() -> FakeClient:
    return FakeClient({
        "c1": node("c1"),
        "c3": node("c3", ("IDLE", "DRAIN"), "gpuwarden: xid 79 on GPU 5", "root"),
        "c4": node("c4", ("IDLE", "DRAIN"), "maintenance", "alice"),
        "c8": node("c8", ("DOWN",), "Not responding", "slurm"),
    })


def test_nodes_shows_state_reason_and_who_set_it(fleet: FakeClient) -> None:
    code, out, _ = run(fleet, "nodes")
    assert code == 0
    # Nodes without a health marker are flagged after the reason ("  [no health marker ...]").
    rows = {ln.split()[0]: ln.split("  [")[0].split(None, 3) for ln in out.splitlines()[1:]}
    assert rows["c3"][1:] == ["IDLE+DRAIN", "gpuwarden", "gpuwarden: xid 79 on GPU 5"]
    assert rows["c4"][1:] == ["IDLE+DRAIN", "alice", "maintenance"]
    assert rows["c8"][2] == "slurm"
    assert rows["c1"][1:] == ["IDLE", "-", "-"]


def test_nodes_json_is_machine_readable(fleet: FakeClient) -> None:
    code, out, _ = run(fleet, "nodes", "--json")
    assert code == 0
    by_name = {r["name"]: r for r in json.loads(out)}
    assert by_name["c3"]["owner"] == "gpuwarden" and by_name["c4"]["owner"] == "alice"


def test_nodes_when_the_controller_is_down_says_so(fleet: FakeClient) -> None:
    fleet.down = True
    code, _, err = run(fleet, "nodes")
    assert code == 1 and "failed after 4 attempts" in err


def test_resume_refuses_an_operators_drain_with_exit_3(fleet: FakeClient) -> None:
    code, _, err = run(fleet, "resume", "c4")
    assert code == 3 and "refusing to resume c4" in err and "maintenance" in err
    assert fleet.table["c4"].reason == "maintenance"


def test_drain_then_resume_round_trip(fleet: FakeClient) -> None:
    assert run(fleet, "drain", "c1", "--reason", "bad NVLink")[0] == 0
    assert fleet.table["c1"].reason == "gpuwarden: bad NVLink"
    code, out, _ = run(fleet, "resume", "c1")
    assert code == 0 and "resumed" in out and not fleet.table["c1"].drained


def test_drain_of_a_node_gpuwarden_drained_keeps_the_first_evidence(fleet: FakeClient) -> None:
    code, out, _ = run(fleet, "drain", "c3", "--reason", "second look: flaky")
    assert code == 0 and "reason kept" in out and "xid 79 on GPU 5" in out
    assert fleet.table["c3"].reason == "gpuwarden: xid 79 on GPU 5"
    code, _, _ = run(fleet, "drain", "c3", "--reason", "replaced on purpose", "--replace")
    assert code == 0 and fleet.table["c3"].reason == "gpuwarden: replaced on purpose"


def test_drain_refuses_a_slurm_down_node(fleet: FakeClient) -> None:
    code, _, err = run(fleet, "drain", "c8", "--reason", "x")
    assert code == 3 and "Not responding" in err


def test_a_bad_config_stops_every_action_with_exit_2(fleet: FakeClient, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[slurm]\ncommand_timeout_s = -1\n")
    code, _, err = run(fleet, "drain", "c1", "--reason", "x", config=str(bad))
    assert code == 2 and "slurm.command_timeout_s" in err and str(bad) in err
    assert not fleet.table["c1"].drained


def test_nodes_that_never_reported_say_which_command_reports_now(
        config_file: Path) -> None:
    """Right after the slurm.conf step no node has run its HealthCheckProgram yet: the notes
    name the command that makes a node report now, and the summary lists those nodes."""
    from gpuwarden.health import marker
    from gpuwarden.slurmconf.needs import HOOKS

    fresh = marker.encode_into("", marker.Marker(int(time.time()), "OK")) or ""
    client = FakeClient({**{f"gn{i}": node(f"gn{i}") for i in (1, 2, 3, 7)},
                         "gn4": node("gn4", extra=fresh)})
    code, out, err = run(client, "nodes")
    assert code == 0
    command = HOOKS["HealthCheckProgram"]
    lines = {ln.split()[0]: ln for ln in out.splitlines()}
    for name in ("gn1", "gn2", "gn3", "gn7"):
        assert "no health marker" in lines[name] and command in lines[name], lines[name]
        assert "HealthCheckInterval" in lines[name]
    assert "health" not in lines["gn4"]
    assert "4 node(s) never reported" in err and "gn[1-3,7]" in err
    assert f"`{command}` once as root on each" in err and "admin-guide.md, step 8" in err
    assert "off or stale" not in err  # nothing else is wrong


def test_config_check_and_show(tmp_path: Path, fleet: FakeClient) -> None:
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir(mode=0o755)
    (bin_dir / "scontrol").write_text("#!/bin/sh\n")
    (bin_dir / "scontrol").chmod(0o755)
    good = tmp_path / "good.toml"
    good.write_text(f"[cluster]\nnodes = 16\n[slurm]\nbin_dir = '{bin_dir}'\n")
    code, out, _ = run(fleet, "config", "check", str(good))
    assert code == 0 and "OK" in out and str(bin_dir) in out
    code, out, _ = run(fleet, "config", "show", config=str(good))
    assert code == 0 and "nodes = 16" in out and "retries = 3" in out


def test_config_check_reports_the_key(tmp_path: Path, fleet: FakeClient) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[cluster]\nnodes_per_leaf = 'four'\n")
    code, _, err = run(fleet, "config", "check", str(bad))
    assert code == 2 and "cluster.nodes_per_leaf: expected an integer" in err


def test_slurm_conf_prints_all_three_files(fleet: FakeClient) -> None:
    code, out, _ = run(fleet, "slurm-conf", "--nodes", "16")
    assert code == 0
    assert "### slurm.conf" in out and "### gres.conf" in out and "### topology.conf" in out
    assert "NodeName=c[1-16]" in out and "SwitchName=leaf4 Nodes=c[13-16]" in out
    assert "AutoDetect=nvml" in out


def test_slurm_conf_rejects_impossible_overrides(fleet: FakeClient) -> None:
    code, _, err = run(fleet, "slurm-conf", "--nodes", "0")
    assert code == 2 and "nodes" in err


def test_unknown_node_is_a_clear_error(fleet: FakeClient) -> None:
    code, _, err = run(fleet, "resume", "c99")
    assert code == 1 and "c99 is not known" in err


def test_not_our_drain_error_is_distinct() -> None:
    assert issubclass(NotOurDrainError, SlurmError)
    assert Config().slurm.backend == "cli"


def test_slurm_entry_points_fail_open_on_a_bad_config(fleet: FakeClient, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[health]\ncheck_timeout_s = 'soon'\n")
    for cmd in ("prolog", "epilog", "periodic"):
        code, _, err = run(fleet, "health", cmd, config=str(bad))
        assert code == 0 and "health.check_timeout_s" in err and "skipped" in err
        assert "OFF on this node" in err
    code, _, err = run(fleet, "health", "check", config=str(bad))
    assert code == 3 and "UNKNOWN" in err
