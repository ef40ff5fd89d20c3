"""`gpuwarden slurm-conf --check FILE` and `--part gpuwarden` as a user runs them."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from gpuwarden.cli import cli
from gpuwarden.config.context import Context


def gw(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(cli, list(args), obj=Context())
    return res.exit_code, res.stdout, res.stderr


def test_the_printed_block_passes_the_check(tmp_path: Path) -> None:
    code, block, _ = gw("slurm-conf", "--part", "gpuwarden")
    assert code == 0 and "JobSubmitPlugins=lua" in block
    (tmp_path / "slurm.conf").write_text(block)
    for name in ("job_submit.lua", "topology.conf"):
        (tmp_path / name).write_text("-- gpuwarden\n")
    code, out, _ = gw("slurm-conf", "--check", str(tmp_path / "slurm.conf"))
    assert code == 0, out


def test_check_only_the_features_asked_for(tmp_path: Path) -> None:
    (tmp_path / "slurm.conf").write_text("AccountingStorageType=accounting_storage/none\n")
    code, out, _ = gw("slurm-conf", "--check", str(tmp_path / "slurm.conf"),
                      "--feature", "lemon")
    assert code == 1
    assert "-> set: AccountingStorageType=accounting_storage/slurmdbd" in out
    assert "health gating" not in out


def test_an_unreadable_file_is_exit_2_without_a_traceback(tmp_path: Path) -> None:
    code, out, err = gw("slurm-conf", "--check", str(tmp_path / "absent.conf"))
    assert code == 2
    assert "cannot read" in err and "Traceback" not in out + err


def test_a_longer_placement_wait_needs_a_longer_max_switch_wait(tmp_path: Path) -> None:
    conf = tmp_path / "gpuwarden.toml"
    conf.write_text("[placement.default]\nwait_s = 7200\n")
    (tmp_path / "slurm.conf").write_text("SchedulerParameters=max_switch_wait=3600\n")
    code, out, _ = gw("--config", str(conf), "slurm-conf", "--check",
                      str(tmp_path / "slurm.conf"), "--feature", "placement")
    assert code == 1
    assert "max_switch_wait=3600 (" in out and "below [placement] wait_s=7200" in out


# ---- the release the keys are checked against ---------------------------------------------------
def test_a_key_the_named_release_lacks_fails_the_check(tmp_path: Path) -> None:
    (tmp_path / "slurm.conf").write_text("AccountingStorageType=accounting_storage/slurmdbd\n"
                                         "PrologTimeout=400\n")
    args = ("slurm-conf", "--check", str(tmp_path / "slurm.conf"), "--feature", "lemon")
    code, out, _ = gw(*args, "--slurm-version", "24.11")
    assert code == 1 and "PrologTimeout needs Slurm >= 25.05, this is 24.11" in out
    assert "against Slurm 24.11 (--slurm-version)" in out
    code, out, _ = gw(*args, "--slurm-version", "25.05.2")
    assert code == 0, out


def test_a_release_that_is_none_is_refused_with_an_example(tmp_path: Path) -> None:
    (tmp_path / "slurm.conf").write_text("")
    code, out, err = gw("slurm-conf", "--check", str(tmp_path / "slurm.conf"),
                        "--slurm-version", "latest")
    assert code == 2 and "give a release such as 24.11" in err
    assert "Traceback" not in out + err


# ---- lines rendered from [cluster] ----------------------------------------------------------------
def config(tmp_path: Path, text: str) -> str:
    (tmp_path / "gpuwarden.toml").write_text(text)
    return str(tmp_path / "gpuwarden.toml")


def test_topology_conf_is_refused_while_cluster_is_not_set(tmp_path: Path) -> None:
    cfg = config(tmp_path, "[placement.default]\nwait_s = 60\n")
    code, out, err = gw("--config", cfg, "slurm-conf", "--part", "topology.conf")
    assert code == 2 and out == ""
    assert f"[cluster] in {cfg} is not set" in err and "c[1-8]" in err
    assert "--example" in err
    code, out, _ = gw("--config", cfg, "slurm-conf", "--part", "topology.conf", "--example")
    assert code == 0 and "SwitchName=leaf1 Nodes=c[1-4]" in out


def test_the_unedited_output_of_config_show_is_still_the_example(tmp_path: Path) -> None:
    """Step 4 of the admin guide writes `config show` to the file; until [cluster] is edited
    it is the example's c[1-8], and topology.conf must not be written from it."""
    code, shown, _ = gw("--config", config(tmp_path, ""), "config", "show")
    assert code == 0 and "[cluster]" in shown
    cfg = config(tmp_path, shown)
    code, out, err = gw("--config", cfg, "slurm-conf", "--part", "topology.conf")
    assert code == 2 and out == "" and "still the defaults" in err


def test_topology_conf_is_rendered_once_cluster_describes_the_nodes(tmp_path: Path) -> None:
    cfg = config(tmp_path, "[cluster]\nnode_prefix = \"gpu\"\nnodes = 4\nnodes_per_leaf = 2\n")
    code, out, err = gw("--config", cfg, "slurm-conf", "--part", "topology.conf")
    assert code == 0 and "SwitchName=leaf2 Nodes=gpu[3-4]" in out and err == ""


def test_all_parts_from_the_example_cluster_carry_a_warning(tmp_path: Path) -> None:
    code, out, err = gw("--config", config(tmp_path, ""), "slurm-conf")
    assert code == 0 and "### topology.conf" in out
    assert "warning: [cluster] in" in err and "is not set" in err


def test_the_checks_topology_advice_needs_cluster_set(tmp_path: Path) -> None:
    (tmp_path / "slurm.conf").write_text("TopologyPlugin=topology/tree\n")
    args = ("slurm-conf", "--check", str(tmp_path / "slurm.conf"), "--feature", "placement")
    _code, out, _ = gw("--config", config(tmp_path, ""), *args)
    line = next(line for line in out.splitlines() if "TopologyPlugin" in line)
    assert "no topology.conf" in line and "topology.conf > " not in line
    assert "only once [cluster] in the gpuwarden config describes your nodes" in line
    _code, out, _ = gw("--config", config(tmp_path, "[cluster]\nnodes = 4\n"), *args)
    line = next(line for line in out.splitlines() if "TopologyPlugin" in line)
    assert f"write it: gpuwarden slurm-conf --part topology.conf > {tmp_path}" in line
