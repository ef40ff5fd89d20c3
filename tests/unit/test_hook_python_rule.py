"""The hooks run Python as root: nothing it imports may be another user's to change. One rule
(prolog/gpuwarden_pystart.py), applied by `install-files`, by `health selftest` and by the
hooks on every start, on real interpreters and venvs (tests/unit/pytrees.py).

Reproduced by a hostile review: a --system-site-packages venv over a base Python whose
site-packages is group-writable (Debian's root:staff 2775 /usr/local/lib/python3.X/
dist-packages, a group-managed conda) was accepted and a .pth file dropped there ran as uid 0
in the next health check; the same with the base's standard library group-writable and a
sitecustomize.py; and /etc/default/gpuwarden naming a user's venv was run without a word."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit import pytrees
from tests.unit.pytrees import NOBODY, VERSION

LIB = pytrees.REPO / "prolog" / "gpuwarden-hook.sh"
START = pytrees.REPO / "prolog" / "gpuwarden_pystart.py"
REFUSED = "refusing to run"


class Site:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.marker = root / "ran-as"
        self.defaults = root / "default-gpuwarden"
        self.syslog = root / "syslog"
        self.logger = root / "logger"
        self.logger.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {self.syslog}\n')
        self.logger.chmod(0o755)

    def hook(self, python: Path, hook: str = "nonsense") -> subprocess.CompletedProcess[str]:
        """The real wrapper, its defaults file naming ``python`` (as if edited by hand)."""
        self.defaults.write_text(f"GPUWARDEN_PYTHON={python}\n")
        self.defaults.chmod(0o644)
        code = f'. {LIB}; gw_hook {hook} {self.defaults} {self.logger} {START}'
        return subprocess.run(["/bin/sh", "-c", code], env={}, capture_output=True, text=True,
                              timeout=120, check=False)

    def install_files(self, python: Path) -> subprocess.CompletedProcess[str]:
        """`gpuwarden install-files` run by the venv's own interpreter, as the guide runs it."""
        (self.root / "etc").mkdir(exist_ok=True)
        return subprocess.run([str(python), "-c", "from gpuwarden.cli import main; main()",
                               "install-files", str(self.root / "opt" / "gpuwarden"),
                               "--defaults-file", str(self.root / "etc" / "gpuwarden")],
                              env={}, capture_output=True, text=True, timeout=300, check=False,
                              cwd="/")

    def logged(self) -> str:
        return self.syslog.read_text() if self.syslog.exists() else ""

    def ran_as_root(self) -> bool:
        return self.marker.exists()


@pytest.fixture
def site() -> Iterator[Site]:
    with pytrees.root_only_dir() as d:
        yield Site(d)


def _group_writable(path: Path) -> None:
    """root:GROUP 2775, as Debian's /usr/local/lib/python3.X/dist-packages was (root:staff)."""
    os.chown(path, 0, pytrees.a_group())
    path.chmod(0o2775)


# ---- the review's three reproductions ----------------------------------------------------------
def _system_site_venv_over_a_group_writable_site(site: Site) -> tuple[Path, Path]:
    python = pytrees.venv(site.root, pytrees.base_python(site.root), system_site=True)
    base_site = pytrees.site_packages(site.root / "base")
    _group_writable(base_site)
    return python, base_site


def test_install_files_refuses_a_system_site_venv_over_a_group_writable_site(site: Site) -> None:
    python, base_site = _system_site_venv_over_a_group_writable_site(site)
    res = site.install_files(python)
    assert res.returncode == 3, res.stdout + res.stderr
    assert f"{base_site} is writable by group or others (mode 2775) (a site directory)" \
        in res.stderr
    assert not (site.root / "opt").exists() and not (site.root / "etc" / "gpuwarden").exists()


def test_the_hooks_refuse_a_system_site_venv_over_a_group_writable_site(site: Site) -> None:
    python, base_site = _system_site_venv_over_a_group_writable_site(site)
    # A member of the group drops a .pth: the next hook must not run it.
    pytrees.drop(base_site, "zz-evil.pth", site.marker)
    res = site.hook(python, "healthcheck")
    assert res.returncode == 0
    assert not site.ran_as_root()
    assert f"healthcheck: {REFUSED} gpuwarden as root with {python}" in site.logged()
    assert str(base_site) in site.logged() and "health gating is OFF" in site.logged()


def _group_writable_stdlib(site: Site) -> tuple[Path, Path]:
    python = pytrees.venv(site.root, pytrees.base_python(site.root), system_site=True)
    stdlib = site.root / "base" / "lib" / VERSION
    _group_writable(stdlib)
    return python, stdlib


def test_install_files_refuses_a_group_writable_standard_library(site: Site) -> None:
    python, stdlib = _group_writable_stdlib(site)
    res = site.install_files(python)
    assert res.returncode == 3, res.stdout + res.stderr
    assert f"{stdlib}: not root's, or group or others can write it" in res.stderr


def test_the_hooks_refuse_a_group_writable_standard_library_before_python_starts(
        site: Site) -> None:
    python, stdlib = _group_writable_stdlib(site)
    pytrees.drop(stdlib, "sitecustomize.py", site.marker)
    res = site.hook(python, "healthcheck")
    assert res.returncode == 0
    assert not site.ran_as_root()
    assert f"healthcheck: {REFUSED} {python} as root: {stdlib}: not root's" in site.logged()


def test_a_defaults_file_naming_a_users_venv_is_refused(site: Site) -> None:
    """install-files refuses that interpreter; a hand-edited /etc/default/gpuwarden named it
    anyway and the hooks ran it as root."""
    base = pytrees.base_python(site.root)
    python = pytrees.venv(site.root, base)
    venv = site.root / "venv"
    for p in (venv, *venv.rglob("*")):
        os.lchown(p, NOBODY, NOBODY)
    pytrees.drop(pytrees.site_packages(venv), "zz-mine.pth", site.marker)
    for hook in ("prolog", "epilog", "healthcheck"):
        res = site.hook(python, hook)
        assert res.returncode == 0, res.stderr
        assert not site.ran_as_root()
        assert f"{hook}: {REFUSED} {python} as root: {venv}" in site.logged()
        assert "is not root's" not in res.stdout


# ---- variants: every directory Python imports from, and the way to each ----------------------
def test_a_root_only_system_site_venv_is_accepted_and_run(site: Site) -> None:
    """The test cluster's layout: python3 -m venv --system-site-packages as root."""
    python = pytrees.venv(site.root, pytrees.base_python(site.root), system_site=True)
    res = site.install_files(python)
    assert res.returncode == 0, res.stderr
    res = site.hook(python)
    assert res.returncode == 0
    assert "failed with exit status 64" in site.logged() and REFUSED not in site.logged()


def test_a_pth_line_adding_a_group_writable_directory_is_refused(site: Site) -> None:
    python = pytrees.venv(site.root, pytrees.base_python(site.root))
    shared = site.root / "shared-src"
    shared.mkdir()
    _group_writable(shared)
    (pytrees.site_packages(site.root / "venv") / "shared.pth").write_text(f"{shared}\n")
    site.hook(python)
    assert f"{shared} is writable by group or others (mode 2775) (added by" in site.logged()
    assert REFUSED in site.logged()


def test_a_package_directory_deeper_down_is_checked_before_it_is_imported(site: Site) -> None:
    python = pytrees.venv(site.root, pytrees.base_python(site.root), with_gpuwarden=False)
    site_dir = pytrees.site_packages(site.root / "venv")
    pkg = site_dir / "gpuwarden" / "health"
    pkg.mkdir(parents=True)
    (site_dir / "gpuwarden" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "hooks.py").write_text("import sys\ndef main(argv):\n    return 0\n")
    _group_writable(pkg)
    site.hook(python, "prolog")
    assert f"refusing to import gpuwarden.health as root: {pkg} is writable by group" in site.logged()
    assert REFUSED in site.logged()


def test_a_sticky_world_writable_directory_on_the_way_is_refused(site: Site) -> None:
    """/tmp-like: anyone may create names there, such as a venv's missing lib64 link."""
    base = pytrees.base_python(site.root)
    sticky = site.root / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    python = pytrees.venv(sticky, base)
    site.hook(python)
    assert f"{REFUSED} {python} as root: {sticky}: not root's" in site.logged()


def test_an_interpreter_link_through_a_users_directory_is_refused(site: Site) -> None:
    base = pytrees.base_python(site.root)
    theirs = site.root / "theirs"
    theirs.mkdir()
    (theirs / "python3").symlink_to(base)
    os.chown(theirs, NOBODY, NOBODY)
    site.hook(theirs / "python3")
    assert f"{REFUSED} {theirs / 'python3'} as root: {theirs}: not root's" in site.logged()


def test_the_selftest_applies_the_same_rule(site: Site, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuwarden.health import selftest

    base = pytrees.base_python(site.root)
    python = pytrees.venv(site.root, base, system_site=True)
    site.defaults.write_text(f"GPUWARDEN_PYTHON={python}\n")
    site.defaults.chmod(0o644)
    monkeypatch.setattr(selftest, "DEFAULTS_FILE", str(site.defaults))
    assert selftest.hook_python_finding().ok
    _group_writable(pytrees.site_packages(site.root / "base"))
    found = selftest.hook_python_finding()
    assert not found.ok and "writable by group or others" in found.detail
    assert str(python) in found.detail and "python3 -m venv" in found.fix


def test_the_wrappers_check_costs_little(site: Site) -> None:
    """The fast path's budget: the wrapper's check adds well under the start of Python."""
    python = pytrees.venv(site.root, pytrees.base_python(site.root), system_site=True)
    code = f'. {LIB}; for i in 1 2 3 4 5; do gw_check_python {python}; done; echo "[$_gw_why]"'
    t0 = time.monotonic()
    res = subprocess.run(["/bin/sh", "-c", code], env={}, capture_output=True, text=True,
                         timeout=120, check=True)
    assert res.stdout.strip() == "[]"
    assert (time.monotonic() - t0) / 5 < 1.0
