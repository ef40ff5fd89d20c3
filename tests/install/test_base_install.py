"""The node-side install as a site makes it: the built wheel into a fresh venv, with only its
own dependencies (click, jinja2) from the package index. Every command and subcommand's
--help works, commands that need no extra run, and one that needs an extra says which.

Needs the package index (PyPI); outside CI an unreachable index skips, with CI=true it fails."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.conftest import in_ci

ROOT = Path(__file__).resolve().parents[2]
CLITREE = ROOT / "tests" / "clitree.py"
OPTIONAL = ("numpy", "msgspec", "xxhash", "boto3", "botocore", "pynvml", "docker")
# The source as a clean clone has it: the build writes build/ and *.egg-info beside it.
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info",
                                    "__pycache__", ".mypy_cache", ".ruff_cache",
                                    ".pytest_cache", ".state")

pytestmark = pytest.mark.timeout(300)


def _index_reachable() -> bool:
    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "pypi.org", parts.port or 443), 5):
            return True
    except OSError:
        return False


def _pip(python: Path, *args: str) -> str:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([str(python), "-m", "pip", *args], capture_output=True, text=True,
                          timeout=240, env=env, check=False)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        if not in_ci() and not _index_reachable():
            pytest.skip(f"the package index is not reachable: pip {args[0]} needs it")
        pytest.fail(f"pip {' '.join(args)} failed (exit {proc.returncode}):\n{out[-4000:]}",
                    pytrace=False)
    return out


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("base-install")
    src, dist, env = tmp / "src", tmp / "dist", tmp / "venv"
    shutil.copytree(ROOT, src, symlinks=True, ignore=NOT_SOURCE)
    built = _pip(Path(sys.executable), "wheel", "-v", "--no-deps", "-w", str(dist), str(src))
    # The metadata must build cleanly (setuptools printed 45 lines of deprecations per build).
    assert "Deprecat" not in built, built
    wheels = list(dist.glob("gpuwarden-*.whl"))
    assert len(wheels) == 1, wheels
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=120)
    _pip(env / "bin" / "python", "install", str(wheels[0]))
    return env


def _run(env: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("PYTHONPATH", "VIRTUAL_ENV", "GPUWARDEN_CONFIG")}
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=60, cwd=cwd,
                          env={**clean, "PATH": f"{env / 'bin'}:{clean.get('PATH', '')}"},
                          check=False)


def _tree(env: Path, tmp: Path) -> dict[str, Any]:
    proc = _run(env, str(env / "bin" / "python"), "-I", str(CLITREE), cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def test_only_the_base_dependencies_are_installed(venv: Path, tmp_path: Path) -> None:
    probe = "import importlib.util as u, sys; print([m for m in sys.argv[1:] if u.find_spec(m)])"
    proc = _run(venv, str(venv / "bin" / "python"), "-I", "-c", probe, *OPTIONAL, cwd=tmp_path)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr
    where = _run(venv, str(venv / "bin" / "python"), "-I", "-c",
                 "import gpuwarden; print(gpuwarden.__file__)", cwd=tmp_path)
    assert where.stdout.startswith(str(venv)), where.stdout  # the wheel, not the source tree


def test_every_command_help_works_on_the_base_install(venv: Path, tmp_path: Path) -> None:
    tree = _tree(venv, tmp_path)
    paths = tree["paths"]
    assert ["ckpt", "ls"] in paths and ["lemon", "scan"] in paths and ["simulate"] in paths
    for path in paths:
        proc = _run(venv, str(venv / "bin" / "gpuwarden"), *path, "--help", cwd=tmp_path)
        shown = " ".join(["gpuwarden", *path])
        assert proc.returncode == 0, f"{shown} --help: exit {proc.returncode}\n{proc.stderr}"
        assert proc.stdout.startswith(f"Usage: {shown}"), proc.stdout
        assert "Traceback" not in proc.stderr, proc.stderr
    assert tree["loaded"] == []


def test_commands_without_an_extra_run_and_one_with_says_which(venv: Path,
                                                               tmp_path: Path) -> None:
    gw = str(venv / "bin" / "gpuwarden")
    config = tmp_path / "gpuwarden.toml"
    config.write_text("[cluster]\nnodes = 4\n")
    show = _run(venv, gw, "--config", str(config), "config", "show", cwd=tmp_path)
    assert show.returncode == 0 and "[cluster]" in show.stdout, show.stderr
    conf = _run(venv, gw, "--config", str(config), "slurm-conf", cwd=tmp_path)
    assert conf.returncode == 0 and "NodeName=" in conf.stdout, conf.stderr
    ls = _run(venv, gw, "--config", str(config), "ckpt", "ls", "job-1", cwd=tmp_path)
    assert (ls.returncode, ls.stdout, ls.stderr) == (
        2, "", "gpuwarden ckpt ls needs xxhash: pip install 'gpuwarden[ckpt]'\n")
    mttf = _run(venv, gw, "fleet", "mttf", "--from", str(config), cwd=tmp_path)
    assert (mttf.returncode, mttf.stderr) == (
        2, "gpuwarden fleet mttf needs numpy: pip install 'gpuwarden[lemon]'\n")
