"""The base install (click and jinja2 only): every command lists and explains itself, the
commands that need no extra run, and one that needs an extra says which in one line.

Driven in a subprocess that refuses the extras' packages (tests/clitree.py --refuse); the real
install from a built wheel is tests/install/test_base_install.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from gpuwarden import cli as climod
from gpuwarden.accounting import lemonlist as listfile
from gpuwarden.core import extras

ROOT = Path(__file__).resolve().parents[2]
CLITREE = ROOT / "tests" / "clitree.py"
REFUSED = ("numpy", "msgspec", "xxhash", "boto3", "botocore", "pynvml", "matplotlib", "docker")

# Distribution name (pyproject.toml) -> import name (extras.EXTRAS), where they differ.
IMPORT_NAME = {"nvidia-ml-py": "pynvml"}

NEEDS_AN_EXTRA = {
    ("ckpt", "ls"): "gpuwarden ckpt ls needs xxhash: pip install 'gpuwarden[ckpt]'",
    ("ckpt", "verify"): "gpuwarden ckpt verify needs xxhash: pip install 'gpuwarden[ckpt]'",
    ("ckpt", "gc"): "gpuwarden ckpt gc needs xxhash: pip install 'gpuwarden[ckpt]'",
    ("ckpt", "interval"): "gpuwarden ckpt interval needs numpy: pip install 'gpuwarden[lemon]'",
    ("lemon", "scan"): "gpuwarden lemon scan needs numpy: pip install 'gpuwarden[lemon]'",
    ("fleet", "mttf"): "gpuwarden fleet mttf needs numpy: pip install 'gpuwarden[lemon]'",
    ("simulate",): "gpuwarden simulate needs numpy: pip install 'gpuwarden[lemon]'",
    ("report",): "gpuwarden report needs numpy: pip install 'gpuwarden[lemon]'",
}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One subprocess: the tree, --help of every command, and the runs below."""
    tmp = tmp_path_factory.mktemp("base")
    lemons = tmp / "lemons" / "lemons.json"
    listfile.write(str(lemons), [listfile.LemonEntry("c7", "4 of 9 runs failed", 4, 9, 1e-4,
                                                     "drained")])
    config = tmp / "gpuwarden.toml"
    config.write_text(f'[lemon]\nlist_file = "{lemons}"\n'
                      '[slurm]\nbin_dir = "/nonexistent-slurm/bin"\n')
    runs = [["--config", str(config), *args] for args in (
        ["config", "show"], ["slurm-conf"], ["lemon", "list"],
        ["ckpt", "ls", "job-1"], ["ckpt", "verify", "job-1"], ["ckpt", "gc", "job-1"],
        ["ckpt", "interval", "--gpus", "8", "--mttf", "7h", "--cost", "30s"],
        ["lemon", "scan", "--from", str(config)], ["fleet", "mttf", "--from", str(config)],
        ["simulate", "--no-compare"], ["report", "--from", str(config), "-o", str(tmp / "r.html")])]
    proc = subprocess.run(
        [sys.executable, "-I", str(CLITREE), "--refuse", ",".join(REFUSED), "--help-all",
         *map(json.dumps, runs)],
        capture_output=True, text=True, timeout=50, check=False)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout)
    out["by_args"] = {tuple(r["args"]): r for r in out["runs"]}
    out["config"] = str(config)
    return out


def test_every_command_and_subcommand_explains_itself_without_the_extras(
        base: dict[str, Any]) -> None:
    paths = {tuple(p) for p in base["paths"]}
    # The groups that need extras are walked too (listing them imported numpy before).
    assert {("ckpt", "ls"), ("lemon", "scan"), ("fleet", "mttf"), ("simulate",),
            ("health", "prolog"), ("placement", "explain")} <= paths
    for p in paths:
        r = base["by_args"][(*p, "--help")]
        assert r["code"] == 0 and r["exception"] is None, r
        assert r["output"].startswith("Usage: gpuwarden"), r
        assert "Traceback" not in r["output"]
    assert base["loaded"] == []


def test_a_command_that_needs_an_extra_says_which_in_one_line(base: dict[str, Any]) -> None:
    for args, line in NEEDS_AN_EXTRA.items():
        if args == ("simulate",):
            r = base["by_args"][("--config", base["config"], "simulate", "--no-compare")]
        else:
            r = next(r for k, r in base["by_args"].items()
                     if k[2:2 + len(args)] == args and "--help" not in k)
        assert r["exception"] is None, r
        assert r["code"] == extras.EXIT_MISSING, r
        assert r["output"] == line + "\n", r


def test_commands_that_need_no_extra_run(base: dict[str, Any]) -> None:
    cfg = base["config"]
    show = base["by_args"][("--config", cfg, "config", "show")]
    assert show["code"] == 0 and "[lemon]" in show["output"], show
    conf = base["by_args"][("--config", cfg, "slurm-conf")]
    assert conf["code"] == 0 and "NodeName=" in conf["output"], conf
    lemons = base["by_args"][("--config", cfg, "lemon", "list")]
    # No Slurm here: the states are unknown, and the list is shown as written.
    assert lemons["code"] == 0 and "c7" in lemons["output"], lemons
    assert lemons["exception"] is None


def test_the_extras_table_is_pyprojects() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for extra, mods in extras.EXTRAS.items():
        dists = {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0] for d in declared[extra]}
        assert {IMPORT_NAME.get(d, d) for d in dists} <= set(mods), extra
    # Every runtime extra is known (test and dev are for developers).
    assert set(declared) - {"test", "test-torch", "dev"} == set(extras.EXTRAS)


def test_an_unmarked_path_to_an_extra_is_still_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise ModuleNotFoundError("No module named 'boto3'", name="boto3")

    monkeypatch.setattr(climod.cli, "main", boom)
    assert climod.main() == extras.EXIT_MISSING
    assert capsys.readouterr().err == "gpuwarden needs boto3: pip install 'gpuwarden[s3]'\n"


def test_a_missing_module_no_extra_brings_keeps_its_traceback() -> None:
    with pytest.raises(ModuleNotFoundError), extras.Needs("ckpt"):
        raise ModuleNotFoundError("No module named 'gpuwarden.nothere'", name="gpuwarden.nothere")

    needs = extras.Needs("lemon")
    with needs:
        raise ModuleNotFoundError("No module named 'numpy'", name="numpy")

    @click.command("x")
    @needs.required
    def cmd() -> None:
        raise AssertionError("runs only with the extra")

    result = CliRunner().invoke(cmd, [])
    assert (result.exit_code, result.output) == (
        2, "gpuwarden needs numpy: pip install 'gpuwarden[lemon]'\n")


def test_a_package_of_another_extra_missing_at_run_time_names_that_extra() -> None:
    # `ckpt ls` with an S3 tier configured and [ckpt] installed but not [s3].
    needs = extras.Needs("ckpt")

    @click.group()
    def top() -> None: ...

    @top.group("ckpt")
    def group() -> None: ...

    @group.command("ls")
    @needs.required
    def ls() -> None:
        raise ModuleNotFoundError("No module named 'boto3'", name="boto3")

    result = CliRunner().invoke(top, ["ckpt", "ls"], prog_name="python -m x")
    assert (result.exit_code, result.output) == (
        2, "gpuwarden ckpt ls needs boto3: pip install 'gpuwarden[s3]'\n")
