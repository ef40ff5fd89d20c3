"""Draining lemons under the blast-radius cap, and the published lemon list."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwarden.accounting import lemonlist as listfile
from gpuwarden.cli import cli
from gpuwarden.config import Config
from gpuwarden.config.context import Context
from gpuwarden.lemon.drain import drain_lemons
from gpuwarden.lemon.scoring import NodeScore
from gpuwarden.slurm.drain_cap import BlastRadius
from gpuwarden.slurm.models import Node
from tests.fakes import FakeSlurm
from tests.unit.test_lemon_core import fleet_history, sacct_export

CAP = BlastRadius(max_drained_pct=25, settle_s=0)


def node(name: str, state: tuple[str, ...] = ("IDLE",), reason: str = "") -> Node:
    return Node(name, state, reason, "root" if reason else "", None, ("gpu",), "gpu:h100:8", (),
                None, "")


def lemon(name: str, q: float = 1e-6, k: int = 7, n: int = 41) -> NodeScore:
    return NodeScore(name, n, 10.0, k, k / 2, 0.4, 0.009, q, q, True, ())


def cluster(*special: Node, n: int = 8) -> FakeSlurm:
    table = {f"c{i}": node(f"c{i}") for i in range(1, n + 1)}
    table.update({s.name: s for s in special})
    return FakeSlurm(table)


def test_a_lemon_is_drained_with_the_evidence_in_its_reason() -> None:
    slurm = cluster()
    [o] = drain_lemons([lemon("c6")], slurm, CAP, sleep=lambda s: None)
    assert o.action == "drained"
    assert slurm.table["c6"].reason == "gpuwarden: lemon, 7 of 41 jobs failed, fleet rate 0.9%"
    assert slurm.table["c6"].comment == ""  # the claim is cleared


def test_the_cap_stops_lemon_drains_worst_first() -> None:
    slurm = cluster(node("c1", ("IDLE", "DRAIN"), "gpuwarden: xid 79 on GPU 5"))
    out = drain_lemons([lemon("c5", q=1e-3), lemon("c6", q=1e-9), lemon("c7", q=1e-4)], slurm,
                       CAP, sleep=lambda s: None)
    # 25% of 8 = 2: the health drain on c1 holds one place, the worst lemon (c6) the other.
    assert [(o.node, o.action) for o in out] == [("c6", "drained"), ("c7", "held"),
                                                 ("c5", "held")]
    assert slurm.table["c7"].comment.startswith("gpuwarden: would drain: lemon")
    assert not slurm.table["c7"].drained


def test_a_node_already_out_is_left_alone_whoever_drained_it() -> None:
    slurm = cluster(node("c4", ("IDLE", "DRAIN"), "maintenance"),
                    node("c3", ("IDLE", "DRAIN"), "gpuwarden: xid 79 on GPU 5"))
    out = drain_lemons([lemon("c4"), lemon("c3")], slurm, CAP, sleep=lambda s: None)
    assert {o.node: o.action for o in out} == {"c4": "already out", "c3": "already out"}
    assert slurm.table["c4"].reason == "maintenance"
    assert slurm.table["c3"].reason == "gpuwarden: xid 79 on GPU 5"
    assert slurm.log == []


def test_health_gating_never_resumes_a_lemon_drain() -> None:
    from gpuwarden.health import gate
    from gpuwarden.health.model import CheckResult, Status, Verdict
    from gpuwarden.slurm import drain

    drained = node("c6", ("IDLE", "DRAIN"), "gpuwarden: lemon, 7 of 41 jobs failed")
    healthy = Verdict("c6", 0, "periodic", (CheckResult("gpu", Status.OK, "ok", 1, ""),))
    own = "gpuwarden: xid 79 on GPU 5"  # what health gating itself drained c6 for once
    for passes in range(10):
        assert gate.decide(healthy, drained, passes, 2, own).kind is not drain.Kind.RESUME


def test_list_file_round_trip_and_safe_reads(tmp_path: Path) -> None:
    path = str(tmp_path / "lemons.json")
    entries = [listfile.LemonEntry("c6", "lemon, 7 of 41 jobs failed", 7, 41, 1e-6, "drained")]
    listfile.write(path, entries, now=123.0)
    got = listfile.read(path)
    assert got.nodes == ("c6",) and got.generated_at == 123.0
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
    link = tmp_path / "link.json"
    link.symlink_to(path)
    with pytest.raises(listfile.LemonListError, match="cannot read"):
        listfile.read(str(link))


@pytest.mark.parametrize("text,needle", [
    ("not json", "not JSON"),
    ('{"version": 9, "nodes": []}', "expected a version 1"),
    ('{"version": 1, "generated_at": 1, "nodes": [{"node": "c6"}]}', "nodes[0] has no 'summary'"),
    ('{"version": 1, "generated_at": 1, "nodes": [{"node": "../etc", "summary": "x", '
     '"failures": 1, "jobs": 1, "q_value": 0.1, "action": "x"}]}', "not a valid node name"),
])
def test_a_bad_list_file_is_a_clear_error(tmp_path: Path, text: str, needle: str) -> None:
    p = tmp_path / "lemons.json"
    p.write_text(text)
    with pytest.raises(listfile.LemonListError, match=None) as err:
        listfile.read(str(p))
    assert needle in str(err.value) and str(p) in str(err.value)


def test_scan_drain_on_the_live_cluster_drains_and_publishes(tmp_path: Path) -> None:
    """`lemon scan --drain` end to end through the CLI, with a fake Slurm behind the seam."""
    import time

    from tests.unit.test_lemon_core import T0

    shift = int(time.time()) - 80 * 3600 - T0  # the history's 67 hours end well inside 7 days
    export = [replace(j, start_time=(j.start_time or 0) + shift, end_time=(j.end_time or 0) + shift)
              for j in fleet_history({"n7"}, seed=5, nodes=16)]
    slurm = FakeSlurm({f"n{i}": node(f"n{i}") for i in range(16)})

    class Client(FakeSlurm):
        def events(self, start: str, end: str) -> list[object]:
            return []

        def acct_jobs(self, start: str, end: str):  # type: ignore[no-untyped-def]
            return iter(export)  # every window lists everything: each run must count once

    lst = tmp_path / "lemons.json"
    cfg = Config()
    cfg = replace(cfg, lemon=replace(cfg.lemon, list_file=str(lst)),
                  health=replace(cfg.health, blast_radius=CAP))
    client = Client(slurm.table)

    def factory(_: Config) -> FakeSlurm:
        return client

    ctx = Context(client_factory=factory)  # type: ignore[arg-type]
    ctx._config = cfg
    res = CliRunner().invoke(cli, ["lemon", "scan", "--since", "7d", "--drain"], obj=ctx)
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("4000 job records, 16 nodes")
    assert "--drain: drained" in res.stdout
    assert client.table["n7"].reason.startswith("gpuwarden: lemon, ")
    assert [k for k, v in client.table.items() if v.drained] == ["n7"]
    doc = json.loads(lst.read_text())
    assert [e["node"] for e in doc["nodes"]] == ["n7"] and doc["nodes"][0]["action"] == "drained"
    out = CliRunner().invoke(cli, ["lemon", "list"], obj=ctx)
    assert out.exit_code == 0 and "n7" in out.stdout and "[drained]" in out.stdout


def test_scan_refuses_to_drain_from_exported_files(tmp_path: Path) -> None:
    export = tmp_path / "sacct.json"
    export.write_text(sacct_export(fleet_history({"n7"}, seed=3)))
    res = CliRunner().invoke(cli, ["lemon", "scan", "--from", str(export), "--drain"],
                             obj=Context())
    assert res.exit_code == 2 and "live cluster" in res.output


def test_lemon_config_is_validated() -> None:
    from gpuwarden.config import parse
    from gpuwarden.core.errors import ConfigError

    with pytest.raises(ConfigError, match="lemon.fdr"):
        parse("[lemon]\nfdr = 2\n", "t.toml")
    with pytest.raises(ConfigError, match="lemon.list_file"):
        parse('[lemon]\nlist_file = "relative/x.json"\n', "t.toml")


def test_the_list_reader_refuses_a_fifo_without_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "lemons.json"
    os.mkfifo(fifo)
    with pytest.raises(listfile.LemonListError, match="not a regular file"):
        listfile.read(str(fifo))


def test_the_list_is_not_written_into_a_directory_others_can_write(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(listfile.LemonListError, match="writable by group or others"):
        listfile.write(str(shared / "lemons.json"), [])
    assert not (shared / "lemons.json").exists()


def test_a_lemon_drain_never_takes_over_a_health_drain_made_meanwhile() -> None:
    from gpuwarden.slurm.client import CliSlurmClient
    from gpuwarden.slurm.settings import SlurmConfig
    from tests.ctld import FakeCtld

    ctld = FakeCtld.cluster(8)
    health = "gpuwarden: xid 79 on GPU 5"
    fired: list[bool] = []

    def health_lands(argv: tuple[str, ...]) -> None:
        # Health gating drains c6 after the scanner saw it in service, just before the
        # drain's own re-read (the single-node `sinfo -n c6`).
        if argv[1:3] == ("--all", "-n") and argv[3] == "c6" and not fired:
            fired.append(True)
            ctld.set("c6", state=("IDLE", "DRAIN"), reason=health)

    ctld.before = health_lands
    [o] = drain_lemons([lemon("c6")], CliSlurmClient(SlurmConfig(retries=0), ctld), CAP,
                       sleep=lambda s: None)
    assert o.action == "already out" and "xid 79" in o.detail
    assert ctld.table["c6"].reason == health
