"""docs/admin-guide.md and docs/testing-without-gpus.md followed by an admin who has only them
(issue 39): the configuration lines they give apply to the file `config show` wrote, the
printed next steps follow the guide's order, every extra's Debian packages are named, sites
without systemd get the units' own commands, and the health check is run once by hand."""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from devcluster import guide
from gpuwarden import config as configmod
from gpuwarden.cli import cli
from gpuwarden.health import marker
from gpuwarden.install import cli as install_cli
from gpuwarden.install import plan
from gpuwarden.slurmconf.needs import HOOKS

ROOT = Path(__file__).resolve().parents[2]
GUIDE_PATH = ROOT / "docs" / "admin-guide.md"
GUIDE = GUIDE_PATH.read_text()
TEST_NODES = ROOT / "docs" / "testing-without-gpus.md"
SYSTEMD = ROOT / "gpuwarden" / "sitefiles" / "systemd"
GW = "/opt/gpuwarden/venv/bin/gpuwarden"  # the guide's install's command (step 2)


def fenced(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def commands(block: str) -> list[str]:
    return guide.Block("b", block, "doc").commands()


def sections(text: str) -> list[tuple[int, str]]:
    """(step number, body) of each `## N. title` section."""
    parts = re.split(r"^## (\d+)\. .*$", text, flags=re.MULTILINE)
    return [(int(parts[i]), parts[i + 1]) for i in range(1, len(parts) - 1, 2)]


def step_of(needle: str) -> int:
    """The first step whose commands (its fenced blocks, not its prose) run ``needle``."""
    steps = [n for n, body in sections(GUIDE) if any(needle in b for b in fenced(body))]
    assert steps, f"the guide has no step with {needle!r}"
    return steps[0]


@pytest.fixture
def shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Step 4's file: `config show > gpuwarden.toml` (no file yet: the defaults), on a host where
    scontrol is found."""
    monkeypatch.delenv(configmod.ENV_VAR, raising=False)
    monkeypatch.setattr(configmod, "DEFAULT_PATH", tmp_path / "gpuwarden.toml")
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir(mode=0o755)
    (bin_dir / "scontrol").write_text("#!/bin/sh\n")
    (bin_dir / "scontrol").chmod(0o755)
    path = tmp_path / "gpuwarden.toml"
    res = CliRunner().invoke(cli, ["config", "show"])
    assert res.exit_code == 0, res.output
    path.write_text(res.output.replace('bin_dir = ""', f'bin_dir = "{bin_dir}"'))
    return path


def apply_documented(block: str, path: Path) -> None:
    """A block of configuration the docs give, applied as they say: TOML lines were to be put
    in the file (below what `config show` wrote), commands are run."""
    lines = [ln for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if lines and lines[0].lstrip().startswith("["):
        path.write_text(path.read_text() + "\n" + block)
        return
    for command in commands(block):
        argv = shlex.split(command, comments=True)
        assert argv[:3] == ["gpuwarden", "config", "set"], command
        res = CliRunner().invoke(cli, ["--config", str(path), *argv[1:]])
        assert res.exit_code == 0, f"{command}\n{res.output}"


def documented_settings(block: str) -> dict[str, Any]:
    if block.lstrip().startswith("#") or block.lstrip().startswith("["):
        doc = tomllib.loads(block)
        return {f"{t}.{k}": v for t, body in doc.items() for k, v in body.items()}
    out: dict[str, Any] = {}
    for command in commands(block):
        for arg in shlex.split(command, comments=True)[3:]:
            key, _, value = arg.partition("=")
            out[key] = value
    return out


def effective(cfg: configmod.Config, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


# ---- item 9: the documented configuration loads --------------------------------------------
def config_blocks() -> list[tuple[str, str]]:
    """Every block the two documents give to change gpuwarden.toml."""
    test_node = guide.blocks(TEST_NODES)["test-node-config"].text
    found = [("testing-without-gpus.md test-node-config", test_node)]
    for block in fenced(GUIDE):
        if "config set" in block or re.match(r"\s*(#[^\n]*\n)*\s*\[[a-z]", block):
            found.append((f"admin-guide.md: {block.splitlines()[0]}", block))
    return found


@pytest.mark.parametrize("name,block", config_blocks(), ids=lambda v: v[:60])
def test_the_documented_settings_applied_to_config_show_output_load(
        shown: Path, name: str, block: str) -> None:
    apply_documented(block, shown)
    cfg = configmod.load(shown, missing_ok=False)  # "Cannot declare ('health',) twice" before
    for key, value in documented_settings(block).items():
        assert str(effective(cfg, key)) == str(value), (name, key)


def test_the_test_nodes_settings_are_a_config_set_command_with_the_fake_files() -> None:
    block = guide.blocks(TEST_NODES)["test-node-config"].text
    assert documented_settings(block) == {
        "health.gpu_probe": "fake", "health.fake_gpu_file": "/var/lib/gpuwarden-fake/gpus.json",
        "health.kernel_log": "/var/lib/gpuwarden-fake/kmsg"}


def test_the_commented_out_examples_run_too(shown: Path) -> None:
    """Step 6's optional lines are commands with a `# ` before them: each works once uncommented,
    after the lines of its block that are not (s3_bucket needs the shared_root set above it)."""
    found = 0
    for block in fenced(GUIDE):
        lines = [ln.lstrip("# ").split("  #")[0] for ln in block.splitlines()
                 if ln.startswith("# gpuwarden config set ")]
        if lines:
            apply_documented(block, shown)
        for line in lines:
            apply_documented(line + "\n", shown)
            found += 1
    assert found


# ---- item 11: install-files' next steps are the guide's ------------------------------------
@pytest.mark.parametrize("exists", [False, True])
def test_the_printed_next_steps_name_the_guides_steps_in_its_order(tmp_path: Path,
                                                                  exists: bool) -> None:
    config = tmp_path / "etc" / "gpuwarden.toml"
    if exists:
        config.parent.mkdir()
        config.write_text("")
    lines = install_cli.next_steps(GW, config)
    printed = [(int(m.group(1)), line) for line in lines if (m := re.search(r"step (\d+),", line))]
    numbers = [n for n, _ in printed]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers), lines
    for number, line in printed:
        for command in re.findall(r"`([^`]+)`", line):
            words = command.replace(GW, "gpuwarden").split()
            needle = " ".join(words[:3] if words[0] == "gpuwarden" else words[:2])
            assert step_of(needle) == number, (line, needle)
    config_step = step_of("gpuwarden config show > /etc/gpuwarden/gpuwarden.toml")
    selftest_step = step_of("gpuwarden health selftest")
    assert config_step < selftest_step
    said = "\n".join(lines)
    assert said.index(f"{GW} config ") < said.index(f"{GW} health selftest")


def test_install_files_prints_the_configuration_before_the_self_test(tmp_path: Path,
                                                                     monkeypatch: Any) -> None:
    (tmp_path / "etc").mkdir(mode=0o755)
    tmp_path.chmod(0o755)
    monkeypatch.setenv("GPUWARDEN_CONFIG", str(tmp_path / "etc" / "gpuwarden.toml"))
    res = CliRunner().invoke(install_cli.install_files, [str(tmp_path / "opt"), "--defaults-file",
                                             str(tmp_path / "etc" / "default")])
    assert res.exit_code == 0, res.output
    out = res.output
    assert "config show >" in out and "config set" in out and "config check" in out
    assert out.index("config show >") < out.index("health selftest")


# ---- item 10: the health check once, by hand ------------------------------------------------
def test_the_health_check_to_run_by_hand_is_slurmds_and_the_nodes_note_names_it() -> None:
    command = HOOKS["HealthCheckProgram"]
    assert command == marker.HEALTHCHECK and command in marker.NO_MARKER
    block = guide.blocks(GUIDE_PATH)["healthcheck-once"]
    assert [c.split("#")[0].strip() for c in commands(block.text)] == [command]
    # `gpuwarden nodes` sends the admin to step 8 for it: it is there, after the apply step.
    body = dict(sections(GUIDE))[8]
    assert body.index("scontrol reconfigure") < body.index("<!-- e2e: healthcheck-once -->")
    [loop] = [b for b in fenced(body) if "while read" in b]
    assert f"SLURMD_NODENAME=\"$node\" {command}" in loop and "sinfo -h -N -o '%N %n'" in loop
    subprocess.run(["bash", "-n", "-c", loop], check=True, timeout=30)


# ---- item 7: without systemd, the units' own commands -----------------------------------------
def exec_start(unit: str) -> str:
    text = (SYSTEMD / unit).read_text().replace(plan.UNIT_PLACEHOLDER, GW)
    [line] = [ln for ln in text.splitlines() if ln.startswith("ExecStart=")]
    return line.removeprefix("ExecStart=")


def unit_value(unit: str, key: str) -> str:
    [line] = [ln for ln in (SYSTEMD / unit).read_text().splitlines() if ln.startswith(key + "=")]
    return line.split("=", 1)[1]


def test_without_systemd_the_placement_daemon_runs_the_units_command_and_restarts() -> None:
    daemon = exec_start("gpuwarden-placement.service")
    assert f"```\n{daemon}\n```" in GUIDE  # the command on its own, to give a supervisor
    assert f"command={daemon}`" in GUIDE  # supervisord's line
    block = guide.blocks(GUIDE_PATH)["placement-without-systemd"]
    [line] = commands(block.text)
    assert shlex.split(line)[:3] == ["setsid", "sh", "-c"]
    loop = shlex.split(line)[3]
    pause = unit_value("gpuwarden-placement.service", "RestartSec")
    assert loop == f"while :; do {daemon}; sleep {pause}; done"
    assert unit_value("gpuwarden-placement.service", "Restart") == "always"
    subprocess.run(["bash", "-n", "-c", line], check=True, timeout=30)
    body = dict(sections(GUIDE))[7]
    assert body.index("systemctl daemon-reload") < body.index("placement-without-systemd")


def test_without_systemd_the_lemon_scan_is_the_services_command_at_the_timers_minute() -> None:
    calendar = unit_value("gpuwarden-lemon-scan.timer", "OnCalendar")
    m = re.fullmatch(r"\*-\*-\* \*:(\d\d):00", calendar)
    assert m, calendar  # hourly: one crontab line says it
    cron = f"{int(m.group(1))} * * * * root {exec_start('gpuwarden-lemon-scan.service')}"
    assert any(cron in b.splitlines() for b in fenced(dict(sections(GUIDE))[9])), cron


# ---- item 8: every extra's Debian packages ----------------------------------------------------
DEBIAN_NAME = {"nvidia-ml-py": "python3-pynvml"}
NOT_IN_DEBIAN = {"store"}  # polars: no Debian package; its row says to carry the wheels


def package_table() -> dict[str, list[str]]:
    rows = re.findall(r"^\| (\(base\)|`[a-z0-9]+`) \| ([^|]+) \|", GUIDE, flags=re.MULTILINE)
    return {name.strip("`"): re.findall(r"python3-[a-z0-9-]+", cells) for name, cells in rows
            if "python3-" in cells}


def test_every_extra_has_its_debian_packages_in_the_guide() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {name: deps for name, deps in project["optional-dependencies"].items()
              if name not in ("test", "test-torch", "dev")}
    wanted["(base)"] = project["dependencies"]
    table = package_table()
    for extra in NOT_IN_DEBIAN:
        del wanted[extra]
        assert re.search(rf"^\| `{extra}` \| none: carry the", GUIDE, flags=re.MULTILINE)
    assert set(table) == set(wanted), table
    for extra, deps in wanted.items():
        names = {re.split(r"[<>=\[ ;]", d)[0] for d in deps}
        debian = {DEBIAN_NAME.get(n, f"python3-{n}") for n in names}
        assert set(table[extra]) == debian, (extra, table[extra])


def test_the_offline_install_blocks_install_the_tables_packages() -> None:
    table = package_table()
    steps = guide.blocks(GUIDE_PATH)
    for name, extras in (("venv", ["(base)", "ckpt"]), ("venv-admin", ["lemon"])):
        text = steps[name].text
        [apt] = [c for c in commands(text) if c.startswith("apt-get install")]
        for extra in extras:
            assert set(table[extra]) <= set(apt.split()), (name, extra)
        [pip] = [c for c in commands(text) if "pip install --no-index" in c]
        listed = set(pip.split("[")[-1].split("]")[0].split(","))
        assert set(extras) - {"(base)"} <= listed, (name, pip)
