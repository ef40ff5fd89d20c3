"""Issue 38: `gpuwarden lemon scan` writes gpuwarden_lemon.prom: a scan that flags a lemon the
cap holds, then drains it; the drain count kept across scans; a scan that fails keeps the last
clean scan's time; read back with Prometheus's parser."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import pytest
from click.testing import CliRunner

from gpuwarden.accounting.attribution import Attribution
from gpuwarden.accounting.mttf import class_mttf_h
from gpuwarden.cli import cli
from gpuwarden.config import Config
from gpuwarden.config.context import Context
from gpuwarden.core.errors import SlurmError
from gpuwarden.lemon import promfile
from tests.fakes import FakeSlurm
from tests.promtext import parse
from tests.unit.test_lemon_core import T0, fleet_history, sacct_export
from tests.unit.test_lemon_drain import CAP, node

Values = dict[tuple[str, tuple[tuple[str, str], ...]], float]


class Client(FakeSlurm):
    export: ClassVar[list[object]] = []
    broken = False

    def events(self, start: str, end: str) -> list[object]:
        return []

    def acct_jobs(self, start: str, end: str):  # type: ignore[no-untyped-def]
        return iter(self.export)

    def drain(self, name: str, reason: str, *, in_service_only: bool = False) -> None:
        if self.broken:
            raise SlurmError("scontrol update: Unable to contact slurm controller")
        super().drain(name, reason, in_service_only=in_service_only)


@pytest.fixture
def site(tmp_path: Path) -> tuple[Client, Context, Path]:
    shift = int(time.time()) - 80 * 3600 - T0  # the history's 67 hours end inside 7 days
    Client.export = [replace(j, start_time=(j.start_time or 0) + shift,
                             end_time=(j.end_time or 0) + shift)
                     for j in fleet_history({"n7"}, seed=5, nodes=16)]
    client = Client({f"n{i}": node(f"n{i}") for i in range(16)})
    cfg = Config()
    cfg = replace(cfg, lemon=replace(cfg.lemon, list_file=str(tmp_path / "lemons.json")),
                  health=replace(cfg.health, blast_radius=CAP, prom_dir=str(tmp_path / "prom"),
                                 state_dir=str(tmp_path / "state")))
    ctx = Context(client_factory=lambda _: client)  # type: ignore[arg-type,return-value]
    ctx._config = cfg
    return client, ctx, tmp_path


def scan(ctx: Context, *args: str) -> tuple[int, Values, dict[str, str]]:
    res = CliRunner().invoke(cli, ["lemon", "scan", "--since", "7d", *args], obj=ctx)
    cfg = ctx._config
    assert cfg is not None
    values, kinds = parse(Path(cfg.health.prom_dir) / promfile.FILE)
    return res.exit_code, values, kinds


def one(values: Values, name: str) -> float:
    return values[(name, ())]


def test_a_held_lemon_then_its_drain_then_a_failed_scan(site) -> None:  # type: ignore[no-untyped-def]
    client, ctx, _ = site
    for name in ("n1", "n2", "n3", "n4"):  # gpuwarden's drains fill the cap (25% of 16)
        client.drain(name, "earlier")
    before = time.time()
    code, v, kinds = scan(ctx, "--drain")
    assert code == 0
    assert kinds == {"gpuwarden_lemon_scan_last_success_timestamp_seconds": "gauge",
                     "gpuwarden_lemon_nodes_flagged": "gauge",
                     "gpuwarden_lemon_nodes_held": "gauge",
                     "gpuwarden_lemon_drains_total": "counter",
                     "gpuwarden_fleet_mttf_hours": "gauge"}
    assert one(v, "gpuwarden_lemon_nodes_flagged") == 1
    assert one(v, "gpuwarden_lemon_nodes_held") == 1
    assert one(v, "gpuwarden_lemon_drains_total") == 0
    first = one(v, "gpuwarden_lemon_scan_last_success_timestamp_seconds")
    assert before <= first <= time.time()
    mttf = {dict(k[1])["gpus"]: val for k, val in v.items()
            if k[0] == "gpuwarden_fleet_mttf_hours"}
    assert mttf and all(h > 0 for h in mttf.values())
    # The cap frees up: the next scan drains it.
    for name in ("n1", "n2", "n3", "n4"):
        client.resume(name)
    code, v, _ = scan(ctx, "--drain")
    assert code == 0 and client.table["n7"].drained
    assert (one(v, "gpuwarden_lemon_nodes_held"), one(v, "gpuwarden_lemon_drains_total")) == (0, 1)
    second = one(v, "gpuwarden_lemon_scan_last_success_timestamp_seconds")
    assert second >= first
    # Already out: no drain made, the count never goes back.
    code, v, _ = scan(ctx, "--drain")
    assert code == 0 and one(v, "gpuwarden_lemon_drains_total") == 1
    # A drain that fails: the scan exits 1 and is not a clean one.
    client.resume("n7")
    client.broken = True
    code, v, _ = scan(ctx, "--drain")
    assert code == 1
    assert one(v, "gpuwarden_lemon_scan_last_success_timestamp_seconds") >= second
    assert one(v, "gpuwarden_lemon_scan_last_success_timestamp_seconds") <= time.time()
    assert one(v, "gpuwarden_lemon_drains_total") == 1
    assert one(v, "gpuwarden_lemon_nodes_flagged") == 1


def test_a_failed_scan_keeps_the_last_clean_scan_s_time(site, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    client, ctx, _ = site
    now = [1_800_000_000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    for name in ("n1", "n2", "n3", "n4"):  # the cap is full: n7 is held, the scan is clean
        client.drain(name, "earlier")
    code, v, _ = scan(ctx, "--drain")
    assert code == 0
    assert one(v, "gpuwarden_lemon_scan_last_success_timestamp_seconds") == 1_800_000_000.0
    for name in ("n1", "n2", "n3", "n4"):
        client.resume(name)
    client.broken = True
    now[0] += 3600
    code, v, _ = scan(ctx, "--drain")
    assert code == 1
    assert one(v, "gpuwarden_lemon_scan_last_success_timestamp_seconds") == 1_800_000_000.0


def test_a_scan_by_hand_without_drain_leaves_the_timer_s_series_alone(site) -> None:  # type: ignore[no-untyped-def]
    """The runbooks' own `gpuwarden lemon scan --since 30d` (no --drain), or any look at the
    lemons by hand, must neither resolve GpuwardenLemonHeld (held back to 0: it drained
    nothing, so it held nothing) nor GpuwardenLemonScanStale (a clean scan that published no
    lemons and drained none is not the timer's scan working)."""
    client, ctx, tmp = site
    for name in ("n1", "n2", "n3", "n4"):  # the cap is full: the timer's scan holds n7
        client.drain(name, "earlier")
    code, v, _ = scan(ctx, "--drain")
    assert code == 0 and one(v, "gpuwarden_lemon_nodes_held") == 1
    before = (tmp / "prom" / promfile.FILE).read_bytes()
    res = CliRunner().invoke(cli, ["lemon", "scan", "--since", "7d"], obj=ctx)
    assert res.exit_code == 0
    v, _ = parse(tmp / "prom" / promfile.FILE)
    assert one(v, "gpuwarden_lemon_nodes_held") == 1
    assert (tmp / "prom" / promfile.FILE).read_bytes() == before


def test_a_scan_of_exported_files_writes_no_metrics(site) -> None:  # type: ignore[no-untyped-def]
    _, ctx, tmp = site
    export = tmp / "sacct.json"
    export.write_text(sacct_export(fleet_history({"n7"}, seed=3)))
    res = CliRunner().invoke(cli, ["lemon", "scan", "--from", str(export)], obj=ctx)
    assert res.exit_code == 0
    assert not (tmp / "prom" / promfile.FILE).exists()


def test_a_textfile_that_cannot_be_written_is_said_and_the_scan_stands(site) -> None:  # type: ignore[no-untyped-def]
    client, ctx, tmp = site
    (tmp / "prom").mkdir()
    (tmp / "prom").chmod(0o777)
    res = CliRunner().invoke(cli, ["lemon", "scan", "--since", "7d", "--drain"], obj=ctx)
    assert res.exit_code == 0 and client.table["n7"].drained
    assert f"{promfile.FILE} not written" in res.stderr


def test_mttf_by_size_leaves_out_classes_without_a_failure() -> None:
    att = Attribution()
    att.gpu_runs.update({0: 3, 8: 10, 16: 4})
    att.gpu_hours.update({0: 5.0, 8: 100.0, 16: 40.0})
    att.gpu_failures.update({0: 1, 8: 4})
    assert class_mttf_h(att) == {8: 25.0}
