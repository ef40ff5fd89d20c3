"""`gpuwarden config set KEY=VALUE`: keys of the file `config show` wrote are changed in place
(a second `[health]` table below it is refused by TOML), every other line is kept, and the file
is written only when the result passes `config check`."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpuwarden import config as configmod
from gpuwarden.cli import cli
from gpuwarden.config import setvalue as configset
from gpuwarden.core.configload import to_dict
from gpuwarden.core.errors import ConfigError

SHOWN = configmod.dumps(configmod.Config())


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A file as the guide's step 4 makes it (`config show > FILE`), with a Slurm to find."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir(mode=0o755)
    (bin_dir / "scontrol").write_text("#!/bin/sh\n")
    (bin_dir / "scontrol").chmod(0o755)
    path = tmp_path / "gpuwarden.toml"
    path.write_text("# effective configuration (defaults)\n" + SHOWN.replace(
        'bin_dir = ""', f'bin_dir = "{bin_dir}"  # where scontrol is'))
    return path


def set_keys(path: Path, *assignments: str) -> tuple[int, str]:
    res = CliRunner().invoke(cli, ["--config", str(path), "config", "set", *assignments])
    return res.exit_code, res.output


def changed_lines(before: str, after: str) -> list[tuple[str, str]]:
    a, b = before.splitlines(), after.splitlines()
    assert len(a) == len(b), (a, b)
    return [(x, y) for x, y in zip(a, b, strict=True) if x != y]


def test_the_test_node_keys_set_on_show_output_load_and_nothing_else_changes(
        site: Path) -> None:
    before = site.read_text()
    code, out = set_keys(site, "health.gpu_probe=fake",
                         "health.fake_gpu_file=/var/lib/gpuwarden-fake/gpus.json",
                         "health.kernel_log=/var/lib/gpuwarden-fake/kmsg")
    assert code == 0, out
    assert 'health.gpu_probe = "fake" (was "nvml")' in out and "OK" in out
    cfg = configmod.load(site, missing_ok=False)
    assert cfg.health.gpu_probe == "fake"
    assert cfg.health.kernel_log == "/var/lib/gpuwarden-fake/kmsg"
    assert changed_lines(before, site.read_text()) == [
        ('gpu_probe = "nvml"', 'gpu_probe = "fake"'),
        ('fake_gpu_file = "/etc/gpuwarden/fakegpu.json"',
         'fake_gpu_file = "/var/lib/gpuwarden-fake/gpus.json"'),
        ('kernel_log = "/dev/kmsg"', 'kernel_log = "/var/lib/gpuwarden-fake/kmsg"')]
    # The comments stay: the first line, and one after a value.
    assert site.read_text().startswith("# effective configuration")
    assert "# where scontrol is" in site.read_text()


def test_keys_inside_inline_tables_and_new_entries(site: Path) -> None:
    code, out = set_keys(site, "health.expected.gpu_count=4", "cluster.nodes=16",
                         'health.classes.l40s={nodes = "l40s[001-032]", expected = '
                         '{gpu_count = 4, gpu_model = "L40S"}}',
                         "health.expected.ib_ports=[\"mlx5_0:1\"]", "ckpt.shared_root=/fsx/ckpt",
                         "health.drain=false", "lemon.fdr=0.05")
    assert code == 0, out
    cfg = configmod.load(site, missing_ok=False)
    assert cfg.health.expected.gpu_count == 4 and cfg.cluster.nodes == 16
    assert cfg.health.expected.ib_ports == ("mlx5_0:1",)
    assert cfg.health.classes["l40s"].expected.gpu_model == "L40S"
    assert cfg.ckpt.shared_root == "/fsx/ckpt" and cfg.health.drain is False
    assert cfg.lemon.fdr == 0.05


def test_a_file_with_sub_tables_and_missing_tables(tmp_path: Path, site: Path) -> None:
    bin_dir = tmp_path / "slurm-bin"
    site.write_text(f'[slurm]\nbin_dir = "{bin_dir}"\n\n[health]\ndrain = true\n\n'
                    "[health.expected]\ngpu_count = 8\n# the H100 nodes\n")
    code, out = set_keys(site, "health.expected.gpu_count=2", "health.expected.gpu_model=H100",
                         "health.gpu_probe=none", "placement.interval_s=30")
    assert code == 0, out
    text = site.read_text()
    assert "[health.expected]\ngpu_count = 2\n# the H100 nodes\ngpu_model = \"H100\"\n" in text
    assert '[health]\ndrain = true\ngpu_probe = "none"\n' in text
    assert text.endswith("[placement]\ninterval_s = 30\n")
    assert configmod.load(site, missing_ok=False).placement.interval_s == 30


@pytest.mark.parametrize("assignment,needle", [
    ("health.gpu_probe=bogus", "health.gpu_probe"),
    ("health.nope=1", "health.nope: unknown key"),
    ("slurm.retries=three", "slurm.retries: expected an integer, got 'three'"),
    ("slurm.retries=99", "slurm.retries: an integer from 0 to 10"),
    ("health.expected.mounts=/fsx", "expected a list"),
    ("health=1", "name a key inside the table"),
    ("health.gpu_probe", "expected KEY=VALUE"),
    ("health..x=1", "each part of a key"),
    ("slurm.bin_dir=/nonexistent/bin", "slurm.bin_dir"),  # config check's own refusal
])
def test_a_bad_setting_is_refused_and_nothing_is_written(site: Path, assignment: str,
                                                         needle: str) -> None:
    before, stat = site.read_bytes(), site.stat()
    code, out = set_keys(site, "cluster.nodes=16", assignment)
    assert code == 2 and needle in out, out
    assert site.read_bytes() == before and site.stat().st_ino == stat.st_ino
    assert sorted(p.name for p in site.parent.iterdir()) == ["gpuwarden.toml", "slurm-bin"]


def test_a_kernel_log_config_check_refuses_is_refused_here_too(site: Path) -> None:
    forged = site.parent / "syslog"
    forged.write_text("Nov 29 12:00:00 c3 kernel: NVRM: Xid (PCI:0000:3b:00): 79, GPU off\n")
    before = site.read_bytes()
    code, out = set_keys(site, f"health.kernel_log={forged}")
    assert code == 2 and "any user can forge" in out and "nothing was written" in out, out
    assert site.read_bytes() == before


def test_missing_file_link_and_broken_toml_are_named(site: Path, tmp_path: Path) -> None:
    code, out = set_keys(tmp_path / "absent.toml", "cluster.nodes=4")
    assert code == 2 and "config show >" in out
    link = tmp_path / "link.toml"
    link.symlink_to(site)
    code, out = set_keys(link, "cluster.nodes=4")
    assert code == 2 and "symbolic link" in out and str(site) in out
    assert configmod.load(site).cluster.nodes == 8
    site.write_text("[health\n")
    code, out = set_keys(site, "cluster.nodes=4")
    assert code == 2 and "not valid TOML" in out and site.read_text() == "[health\n"


def test_a_value_written_in_a_form_it_cannot_edit_is_refused(tmp_path: Path,
                                                             site: Path) -> None:
    site.write_text(f'[slurm]\nbin_dir = "{tmp_path / "slurm-bin"}"\n[health.expected]\n'
                    'ib_ports = [\n  "mlx5_0:1",\n]\n')
    before = site.read_bytes()
    code, out = set_keys(site, 'health.expected.ib_ports=["mlx5_1:1"]')
    assert code == 2 and "cannot be set in place" in out and "by hand" in out, out
    assert site.read_bytes() == before


def test_the_files_mode_is_kept(site: Path) -> None:
    site.chmod(0o640)
    code, out = set_keys(site, "cluster.nodes=4")
    assert code == 0, out
    assert site.stat().st_mode & 0o7777 == 0o640
    assert configmod.load(site).cluster.nodes == 4


def leaves(doc: dict[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...],
                                                                                Any]]:
    for key, value in doc.items():
        if isinstance(value, dict) and value:
            yield from leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


@pytest.mark.parametrize("path,value", list(leaves(to_dict(configmod.Config()))),
                         ids=lambda p: ".".join(p) if isinstance(p, tuple) else "")
def test_every_key_config_show_writes_can_be_set(path: tuple[str, ...], value: Any) -> None:
    """Each key, set to its shown value as a command line gives it, round-trips in place."""
    raw = value if isinstance(value, str) else configmod.toml_value(value)
    parsed_path, parsed = configset.assignment(f"{'.'.join(path)}={raw}")
    assert parsed_path == path
    text, [change] = configset.apply(SHOWN, "f", [(parsed_path, parsed)])
    assert tomllib.loads(text) == tomllib.loads(SHOWN) and change.before == value


def test_a_string_key_takes_its_value_as_written_or_quoted() -> None:
    assert configset.assignment("cluster.name=123")[1] == "123"
    assert configset.assignment('cluster.name="x y"')[1] == "x y"
    assert configset.assignment("health.expected.gpu_model=")[1] == ""
    with pytest.raises(ConfigError, match="cluster.nodes"):
        configset.apply(SHOWN, "f", [configset.assignment('cluster.nodes="4"')])


def test_a_failed_write_leaves_the_file_and_no_temporary_behind(
        site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = site.read_bytes()

    def full(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("gpuwarden.config.write.os.replace", full)
    code, out = set_keys(site, "cluster.nodes=4")
    assert code == 2 and "No space left" in out and "nothing was written" in out, out
    assert site.read_bytes() == before
    assert sorted(p.name for p in site.parent.iterdir()) == ["gpuwarden.toml", "slurm-bin"]
