"""Build the wheel the test cluster installs, from the working tree: the cluster runs what a site
installs (docs/admin-guide.md), never the source tree on a path."""

from __future__ import annotations

import hashlib
import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from gpuwarden.core.errors import GpuwardenError

# What the wheel is built from; everything else in the tree (tests, .venv, caches) stays out.
_SOURCES = ("pyproject.toml", "README.md", "gpuwarden")
_NOT_SOURCE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
_BUILD_TIMEOUT_S = 300


class WheelError(GpuwardenError):
    pass


def _setuptools_ok() -> bool:
    """Whether this interpreter can build without fetching a build backend (no network)."""
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return major >= 77


def build(root: Path, out_dir: Path) -> Path:
    """Build gpuwarden's wheel from ``root`` into ``out_dir`` (emptied first); return its path."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="gpuwarden-wheel-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in _SOURCES:
            path = root / name
            if path.is_dir():
                shutil.copytree(path, src / name, ignore=_NOT_SOURCE)
            else:
                shutil.copy2(path, src / name)
        argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out_dir),
                str(src)]
        if _setuptools_ok():
            argv.insert(4, "--no-build-isolation")
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S,
                                 check=False)
        except subprocess.TimeoutExpired:
            raise WheelError(f"building the wheel took over {_BUILD_TIMEOUT_S} s: "
                             f"{' '.join(argv)}") from None
    wheels = sorted(out_dir.glob("gpuwarden-*.whl"))
    if res.returncode != 0 or len(wheels) != 1:
        raise WheelError(f"building the wheel failed (exit {res.returncode}): "
                         f"{(res.stderr or res.stdout).strip()[-2000:]}\nrun `{' '.join(argv)}` "
                         "to see why (pip needs setuptools>=77: `pip install -e '.[dev]'`)")
    return wheels[0]


def digest(wheel: Path) -> str:
    """A digest of what the wheel installs: names and bytes, not the zip's timestamps, so an
    unchanged tree keeps the running cluster."""
    h = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf:
        for info in sorted(zf.infolist(), key=lambda i: i.filename):
            h.update(info.filename.encode() + b"\0" + zf.read(info) + b"\0")
    return h.hexdigest()
