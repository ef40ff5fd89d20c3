"""The hooks' Python adds the system's site directories of a --system-site-packages venv,
whichever of sys.prefix or site.py made the venv the prefix (Python 3.14 does it at start)."""

from __future__ import annotations

import site
import sys
from pathlib import Path

import pytest

from gpuwarden.sitefiles.prolog import gpuwarden_pystart as pystart


def _venv(tmp_path: Path, system: bool) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text(
        f"home = /usr/bin\ninclude-system-site-packages = {'true' if system else 'false'}\n")
    return venv


@pytest.mark.parametrize("prefix_at_start", ["base", "venv"])
def test_a_system_site_venv_gets_the_systems_site_dirs(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       prefix_at_start: str) -> None:
    venv = _venv(tmp_path, system=True)
    base = str(tmp_path / "usr")
    monkeypatch.setattr(sys, "executable", str(venv / "bin" / "python"))
    monkeypatch.setattr(sys, "base_prefix", base)
    # 3.13: sys.prefix is the base until site.py runs; 3.14: the venv from the start.
    monkeypatch.setattr(sys, "prefix", base if prefix_at_start == "base" else str(venv))
    monkeypatch.setattr(sys, "exec_prefix", sys.prefix)
    dirs = pystart.site_dirs()
    assert set(site.getsitepackages([base])) <= set(dirs), dirs
    assert set(site.getsitepackages([str(venv)])) <= set(dirs), dirs


def test_a_venv_without_system_site_gets_only_its_own(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    venv = _venv(tmp_path, system=False)
    base = str(tmp_path / "usr")
    monkeypatch.setattr(sys, "executable", str(venv / "bin" / "python"))
    monkeypatch.setattr(sys, "base_prefix", base)
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.setattr(sys, "exec_prefix", str(venv))
    dirs = pystart.site_dirs()
    assert not any(d.startswith(base) for d in dirs), dirs
