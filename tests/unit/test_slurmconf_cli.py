"""`gpuwarden slurm-conf --check FILE` and `--part gpuwarden` as a user runs them."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from gpuwarden.cli import Context, cli


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
