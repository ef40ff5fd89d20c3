"""The placement daemon takes config changes without a restart: a changed file runs from the
next snapshot, a broken one is refused (logged with its key, noted in the snapshot) while the
old settings go on, and SIGHUP re-reads a file whose change its stat does not show."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
from click.testing import CliRunner

from gpuwarden import config as configmod
from gpuwarden.cli import cli
from gpuwarden.config.context import Context
from gpuwarden.placement import daemon, reload
from gpuwarden.slurm.client import SlurmClient
from gpuwarden.slurm.models import Node
from tests.fakes import FakeSlurm

TREE = "SwitchName=leaf1 Nodes=c[1-4]\nSwitchName=leaf2 Nodes=c[5-8]\n"


class Slurm(FakeSlurm):
    def partitions(self) -> dict[str, tuple[str, ...]]:
        return {"gpu": tuple(self.table)}


def slurm() -> SlurmClient:
    nodes = {f"c{i}": Node(f"c{i}", ("IDLE",), "", "", None, ("gpu",), "gpu:h100:8", (), None, "")
             for i in range(1, 9)}
    return cast(SlurmClient, Slurm(nodes))


class Stop(Exception):
    pass


class Site:
    """A config file, topology.conf and snapshot path under tmp_path."""

    def __init__(self, tmp: Path) -> None:
        self.topo = tmp / "topology.conf"
        self.topo.write_text(TREE)
        self.snap = tmp / "gpuwarden-placement.lua"
        self.conf = tmp / "gpuwarden.toml"

    def write(self, default: str) -> None:
        self.conf.write_text(
            f'[placement]\ntopology_file = "{self.topo}"\nsnapshot_file = "{self.snap}"\n'
            f"interval_s = 1\nstale_after_s = 10\n\n[placement.default]\n{default}\n")

    def partition_line(self) -> str:
        return next(x for x in self.snap.read_text().splitlines() if x.startswith("partition"))

    def run(self, edits: list[Callable[[], None]]) -> list[str]:
        """The daemon with the real Reloader, a fake clock and a sleep that makes the next
        edit; the snapshot's partition line and second line after each round."""
        cfg = configmod.load(self.conf)
        seen: list[str] = []
        now = [1000.0]

        def sleep(seconds: float) -> None:
            seen.append(self.partition_line() + " | " + self.snap.read_text().splitlines()[1])
            if not edits:
                raise Stop
            now[0] += seconds
            edits.pop(0)()

        with pytest.raises(Stop):
            daemon.run(cfg.placement, slurm, cfg.lemon.list_file, clock=lambda: now[0],
                       sleep=sleep, reload=reload.Reloader(self.conf, cfg))
        return seen


def test_a_changed_wait_takes_effect_at_the_next_snapshot(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    site = Site(tmp_path)
    site.write("wait_s = 300")
    caplog.set_level(logging.INFO)
    rounds = site.run([lambda: site.write("wait_s = 60\nmin_nodes = 3"), lambda: None])
    assert [" wait=300 min_nodes=2 " in rounds[0], " wait=60 min_nodes=3 " in rounds[1]] == [
        True, True]
    assert " wait=60 " in rounds[2]  # and it stays
    assert ("config reloaded (the file changed), from the next snapshot: "
            "placement.default.min_nodes: 2 -> 3; placement.default.wait_s: 300 -> 60"
            ) in caplog.text
    assert "REFUSED" not in "".join(rounds)


def test_a_broken_file_is_refused_with_its_key_and_the_old_settings_go_on(  # type: ignore[no-untyped-def]
        tmp_path: Path, caplog) -> None:
    site = Site(tmp_path)
    site.write("wait_s = 300")
    rounds = site.run([lambda: site.write("wait_s = -5"), lambda: None,
                       lambda: site.write("wait_s = 120")])
    assert all(" wait=300 " in r for r in rounds[:3]) and " wait=120 " in rounds[3]
    refused = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(refused) == 1  # once per change, not every round
    assert (f"config change refused (the file changed): {site.conf}: placement.default.wait_s: "
            "seconds, 0 to a week; the placement daemon keeps its previous settings"
            ) in refused[0].getMessage()
    # Where operators look besides the log: the snapshot's second line (a comment to the filter).
    assert rounds[1].endswith("CONFIG CHANGE REFUSED, the previous settings run: "
                              f"{site.conf}: placement.default.wait_s: seconds, 0 to a week")
    assert "REFUSED" in rounds[2] and "REFUSED" not in rounds[3]


def test_a_removed_file_is_refused_not_taken_for_defaults(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    site = Site(tmp_path)
    site.write("wait_s = 77")
    rounds = site.run([site.conf.unlink])
    assert " wait=77 " in rounds[1] and "file not found (removed?)" in rounds[1]
    assert "file not found" in caplog.text


def same_stat_edit(path: Path, old: str, new: str) -> None:
    """Change the content but not inode, size or mtime: only SIGHUP can tell."""
    assert len(old) == len(new)
    st = path.stat()
    path.write_text(path.read_text().replace(old, new))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_sighup_rereads_a_change_the_stat_does_not_show(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    site = Site(tmp_path)
    site.write("wait_s = 300")
    caplog.set_level(logging.INFO)
    before = signal.getsignal(signal.SIGHUP)
    cfg = configmod.load(site.conf)
    reloader = reload.Reloader(site.conf, cfg)
    try:
        reload.install_sighup(reloader)
        assert reloader() is None  # the first look: as loaded
        same_stat_edit(site.conf, "300", "301")
        assert reloader() is None
        os.kill(os.getpid(), signal.SIGHUP)
        got = reloader()
    finally:
        signal.signal(signal.SIGHUP, before)
    assert got is not None and got.placement is not None
    assert got.placement.default.wait_s == 301 and got.cause == "SIGHUP"
    assert reloader() is None  # one SIGHUP, one re-read


def test_sighup_on_an_unchanged_file_says_so(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    site = Site(tmp_path)
    site.write("wait_s = 300")
    caplog.set_level(logging.INFO)
    cfg = configmod.load(site.conf)
    reloader = reload.Reloader(site.conf, cfg)

    def hup() -> None:
        reloader.request()  # what the SIGHUP handler does

    def sleep(_: float) -> None:
        if not edits:
            raise Stop
        edits.pop(0)()

    edits = [hup]
    with pytest.raises(Stop):
        daemon.run(cfg.placement, slurm, "", clock=lambda: 1000.0, sleep=sleep, reload=reloader)
    assert "config reloaded (SIGHUP): nothing the placement daemon uses changed" in caplog.text


def test_keys_other_commands_read_are_named_apart(tmp_path: Path) -> None:
    site = Site(tmp_path)
    site.write("wait_s = 300")
    reloader = reload.Reloader(site.conf, configmod.load(site.conf))
    site.conf.write_text(site.conf.read_text() + '\n[logging]\nlevel = "DEBUG"\n')
    got = reloader()
    assert got is not None and got.changed == () and got.elsewhere == ("logging.level",)


def test_the_daemon_command_rereads_its_config_file(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    site = Site(tmp_path)
    site.write("wait_s = 300")
    calls: list[dict[str, object]] = []
    def run(*args: object, **kw: object) -> int:
        calls.append(kw)
        return 0

    monkeypatch.setattr(daemon, "run", run)
    before = signal.getsignal(signal.SIGHUP)
    try:
        result = CliRunner().invoke(cli, ["--config", str(site.conf), "placement", "daemon"],
                                    obj=Context(client_factory=lambda cfg: slurm()))
        installed = signal.getsignal(signal.SIGHUP)
    finally:
        signal.signal(signal.SIGHUP, before)
    assert result.exit_code == 0, result.output
    assert installed not in (before, signal.SIG_DFL)
    rel = calls[0]["reload"]
    assert isinstance(rel, reload.Reloader) and rel.path == site.conf
    site.write("wait_s = 600\nshadow = true")
    got = rel()
    assert got is not None and got.placement is not None and got.placement.default.shadow


def test_explain_shows_a_refused_change(tmp_path: Path) -> None:
    site = Site(tmp_path)
    site.write("wait_s = 300")
    cfg = configmod.load(site.conf)
    state = daemon.State(refused=f"{site.conf}: placement.default.wait_s: seconds, 0 to a week")
    assert daemon.step(cfg.placement, slurm(), "", state, 1000.0) is not None
    result = CliRunner().invoke(cli, ["--config", str(site.conf), "placement", "explain", "-N",
                                      "4"], obj=Context(client_factory=lambda cfg: slurm()))
    assert result.exit_code == 0, result.output
    assert (f"the daemon refused a change of its config file: {site.conf}: "
            "placement.default.wait_s: seconds, 0 to a week\n") in result.output
