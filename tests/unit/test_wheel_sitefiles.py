"""The built wheel is what a site installs: it must carry the hooks, plugins, checkpoint kit and
systemd units, and `install-files` must work from it (not from a source checkout)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gpuwarden.install import plan

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy: pip builds in the source tree, and build/ there would be shared with
    # anyone else building at the same time.
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "gpuwarden", src / "gpuwarden",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("dist")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out),
                          str(src)], capture_output=True, text=True, timeout=240, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Deprecat" not in res.stderr, res.stderr
    (whl,) = out.glob("gpuwarden-*.whl")
    return whl


@pytest.mark.timeout(300)
def test_the_wheel_carries_every_site_file(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [sf.rel for sf in plan.MANIFEST if f"gpuwarden/sitefiles/{sf.rel}" not in names]
    assert missing == []


@pytest.mark.timeout(300)
def test_the_wheel_ships_no_test_harness(wheel: Path) -> None:
    """The Docker test cluster (devcluster/) is developer tooling: it imports the docker SDK
    and drives containers; a site's nodes never need it."""
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if "devcluster" in n], names
    assert any(n.startswith("gpuwarden/core/safefs/") for n in names)  # the layers are packaged


def test_install_files_works_from_the_installed_wheel(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site-packages"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                    "--target", str(target), str(wheel)], check=True, timeout=120,
                   capture_output=True)
    os.chmod(tmp_path, 0o755)
    prefix = tmp_path / "opt" / "gpuwarden"
    code = ("import sys, gpuwarden; print(gpuwarden.__file__, file=sys.stderr);"
            "from gpuwarden.install.cli import install_files;"
            f"install_files(['{prefix}', '--no-defaults-file'])")
    res = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(target)},
                         cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stderr.startswith(str(target))  # the wheel's copy, not this checkout
    for sf in plan.MANIFEST:
        assert stat.S_IMODE((prefix / sf.rel).stat().st_mode) == sf.mode, sf.rel
    assert (prefix / "prolog" / "gpuwarden-hook.sh").read_bytes() == \
        (REPO / "gpuwarden" / "sitefiles" / "prolog" / "gpuwarden-hook.sh").read_bytes()
