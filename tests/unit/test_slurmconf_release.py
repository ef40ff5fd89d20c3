"""slurm-conf writes the lines of the Slurm release at hand (issue 17): 25.05 split the hooks'
timeout into PrologTimeout and EpilogTimeout, and a site with only topology.yaml is told that
gpuwarden's placement reads topology.conf."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwarden.cli import cli
from gpuwarden.config.context import Context
from gpuwarden.slurmconf import check
from gpuwarden.slurmconf.needs import FEATURES, HOOK_TIMEOUT_S


def settings(text: str) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in text.splitlines() if line and line[0] != "#")
    return dict(pairs)


def run_check(path: Path, version: tuple[int, int] | None) -> tuple[int, list[str]]:
    out: list[str] = []
    code = check.check(str(path), list(FEATURES), 300, out.append, out.append,
                       defaults_file="/nonexistent/gpuwarden", slurm_version=version,
                       version_from="test")
    return code, out


@pytest.mark.parametrize("version", [(25, 5), (25, 11), (26, 5)])
def test_from_25_05_the_block_sets_the_two_hook_timeouts(version: tuple[int, int]) -> None:
    got = settings(check.block(slurm_version=version))
    assert got["PrologTimeout"] == got["EpilogTimeout"] == str(HOOK_TIMEOUT_S)
    assert "PrologEpilogTimeout" not in got


@pytest.mark.parametrize("version", [(24, 5), (24, 11), None])
def test_before_25_05_or_unknown_the_block_sets_the_one_key_every_release_reads(
        version: tuple[int, int] | None) -> None:
    text = check.block(slurm_version=version)
    got = settings(text)
    assert got["PrologEpilogTimeout"] == str(HOOK_TIMEOUT_S)
    assert "PrologTimeout" not in got and "EpilogTimeout" not in got
    assert ("release unknown" in text) == (version is None)


@pytest.mark.parametrize("version", [(24, 5), (24, 11), (25, 5), (26, 5)])
def test_each_release_s_block_passes_that_release_s_check(tmp_path: Path,
                                                          version: tuple[int, int]) -> None:
    (tmp_path / "slurm.conf").write_text("ClusterName=c\n" + check.block(slurm_version=version))
    for name in ("job_submit.lua", "topology.conf"):
        (tmp_path / name).write_text("-- gpuwarden\n")
    code, out = run_check(tmp_path / "slurm.conf", version)
    assert code == 0, out


def gw(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli, list(args), obj=Context())
    return res.exit_code, res.stdout


def test_the_printed_block_follows_scontrol_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(check, "running_version", lambda runner, timeout=10.0: (26, 5))
    code, out = gw("slurm-conf", "--part", "gpuwarden")
    assert code == 0 and "# Written for Slurm 26.05." in out
    assert "PrologTimeout" in settings(out)
    code, out = gw("slurm-conf", "--part", "gpuwarden", "--slurm-version", "24.11")
    assert code == 0 and "PrologEpilogTimeout" in settings(out)


def test_a_broken_config_file_does_not_stop_the_printed_block(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    monkeypatch.setattr(check, "running_version", lambda runner, timeout=10.0: None)
    bad = tmp_path / "gpuwarden.toml"
    bad.write_text("[placement.default]\nwait_s = -1\n")
    code, out = gw("--config", str(bad), "slurm-conf", "--part", "gpuwarden")
    assert code == 0 and "JobSubmitPlugins=lua" in out


def test_topology_yaml_alone_is_not_enough_for_gpuwarden_s_placement(tmp_path: Path) -> None:
    (tmp_path / "slurm.conf").write_text("ClusterName=c\n" + check.block(slurm_version=(25, 11)))
    (tmp_path / "job_submit.lua").write_text("-- gpuwarden\n")
    (tmp_path / "topology.yaml").write_text("- topology: t\n")
    code, out = run_check(tmp_path / "slurm.conf", (25, 11))
    assert code == 1, out
    line = next(x for x in out if "topology.yaml" in x)
    assert "reads the switches from topology.conf only" in line
    (tmp_path / "topology.conf").write_text("SwitchName=s0 Nodes=c[1-4]\n")
    code, out = run_check(tmp_path / "slurm.conf", (25, 11))
    assert code == 0, out
