"""`install-files` names this install's interpreter and `gpuwarden` in what root runs (the Slurm
hooks, the systemd units): an install another user could change is refused, and one job users
cannot reach is reported."""

from __future__ import annotations

import os
import shutil
import stat
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from gpuwarden.install import run, trust
from gpuwarden.install.cli import install_files
from tests.unit import pytrees

REPO = Path(__file__).resolve().parents[2]
SITEFILES = REPO / "gpuwarden" / "sitefiles"
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another uid")


def _venv(root: Path, python_target: str) -> dict[str, Path]:
    """A venv as `python3 -m venv` and an installer leave it: bin/python a link out of it."""
    venv = root / "venv"
    bin_ = venv / "bin"
    site = venv / "lib" / "python3" / "site-packages"
    pkg = site / "gpuwarden"
    for d in (bin_, pkg):
        d.mkdir(parents=True, mode=0o755)
    (bin_ / "python").symlink_to(python_target)
    (bin_ / "gpuwarden").write_text(f"#!{bin_}/python\nfrom gpuwarden.cli import main\n")
    (bin_ / "gpuwarden").chmod(0o755)
    (pkg / "__init__.py").write_text("")
    (site / "extra.pth").write_text("")
    for p in (root, *root.rglob("*")):
        if not p.is_symlink():
            p.chmod(0o755 if p.is_dir() or p.name == "gpuwarden" else 0o644)
    return {"venv": venv, "bin": bin_, "site-packages": site, "package": pkg,
            "package file": pkg / "__init__.py", "pth": site / "extra.pth",
            "gpuwarden": bin_ / "gpuwarden"}


def _use(monkeypatch: pytest.MonkeyPatch, parts: dict[str, Path]) -> None:
    """Make this process look like it runs from the venv in ``parts``."""
    real = sysconfig.get_path
    paths = {"scripts": parts["bin"], "purelib": parts["site-packages"],
             "platlib": parts["site-packages"]}
    monkeypatch.setattr(sys, "executable", str(parts["bin"] / "python"))
    monkeypatch.setattr(sys, "prefix", str(parts["venv"]))
    monkeypatch.setattr(run.sysconfig, "get_path",
                        lambda name: str(paths[name]) if name in paths else real(name))
    monkeypatch.setattr(run, "package_dir", lambda: str(parts["package"]))
    monkeypatch.setattr(run, "source_dir", lambda: str(SITEFILES))


def _install(tmp_path: Path, *args: str) -> Result:
    return CliRunner().invoke(install_files, [str(tmp_path / "opt" / "gpuwarden"),
                                              "--defaults-file", str(tmp_path / "etc" / "gw"),
                                              *args])


@pytest.fixture
def site() -> Iterator[Path]:
    """Root's alone, as the hooks' rule wants the interpreter's way (pytest's tmp is in /tmp)."""
    with pytrees.root_only_dir() as d:
        (d / "etc").mkdir(mode=0o755)
        yield d


@as_root
@pytest.mark.parametrize("part", ["venv", "bin", "site-packages", "package", "package file",
                                  "pth", "gpuwarden"])
def test_an_install_another_user_could_change_is_refused(site: Path, part: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The review's repro: a venv owned by uid 65534 was named as root's GPUWARDEN_PYTHON."""
    parts = _venv(site, sys.executable)
    os.lchown(parts[part], NOBODY, NOBODY)
    _use(monkeypatch, parts)
    res = _install(site)
    assert res.exit_code == 3, res.output
    assert f"install-files: {parts[part]} is owned by uid {NOBODY} (" in res.output
    assert "must be root's alone" in res.output and "python3 -m venv" in res.output
    assert not (site / "opt").exists() and not (site / "etc" / "gw").exists()


@as_root
def test_an_interpreter_link_through_another_users_directory_is_refused(
        site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    theirs = site / "theirs"
    theirs.mkdir(mode=0o755)
    (theirs / "python3").symlink_to(sys.executable)
    os.chown(theirs, NOBODY, NOBODY)
    parts = _venv(site, str(theirs / "python3"))
    _use(monkeypatch, parts)
    res = _install(site, "--dry-run")
    assert res.exit_code == 3
    assert f"{theirs} is owned by uid {NOBODY} (the interpreter" in res.output


def test_an_install_others_can_write_is_refused(site: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    parts = _venv(site, sys.executable)
    parts["site-packages"].chmod(0o775)
    _use(monkeypatch, parts)
    res = _install(site)
    assert res.exit_code == 3
    site_packages = parts["site-packages"]
    assert f"{site_packages} is writable by group or others (site-packages of" in res.output
    assert not (site / "opt").exists()


def test_a_root_owned_venv_linking_to_the_system_python_is_accepted(
        site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test cluster's install: python3 -m venv --system-site-packages as root, its python a
    link to /usr/bin/python3, PREFIX /opt/gpuwarden 0755 with the venv in it."""
    system = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    parts = _venv(site / "opt" / "gpuwarden", system)
    _use(monkeypatch, parts)
    res = _install(site)
    assert res.exit_code == 0, res.output
    assert f"GPUWARDEN_PYTHON={parts['bin'] / 'python'}" in (site / "etc" / "gw").read_text()


def test_a_sticky_world_writable_directory_on_the_way_is_fine(tmp_path: Path) -> None:
    """/tmp-like: others cannot rename what is not theirs in it."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    (sticky / "f").write_text("")
    (sticky / "f").chmod(0o644)
    seen = trust.reach(str(sticky / "f"))
    assert [s.path for s in seen if s.on_way][-1] == str(sticky)
    assert all(trust.control_problem(s, os.geteuid()) == "" for s in seen)
    whole = trust.Seen(str(sticky), os.stat(sticky), on_way=False)
    assert "writable by group or others" in trust.control_problem(whole, os.geteuid())


def test_reach_follows_links_as_exec_does(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "real").write_text("")
    (tmp_path / "l1").symlink_to("a/b")
    (tmp_path / "a" / "l2").symlink_to("../l1/real")
    seen = trust.reach(str(tmp_path / "a" / "l2"))
    assert seen[-1].path == str(tmp_path / "a" / "b" / "real") and not seen[-1].on_way
    assert {str(tmp_path / "a"), str(tmp_path), str(tmp_path / "a" / "b")} <= {
        s.path for s in seen if s.on_way}
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(OSError, match="symbolic links"):
        trust.reach(str(tmp_path / "loop"))


# ---- what job users can reach (a umask 077 host) ----------------------------------------------
@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user can get to (pytest's own are 0700)."""
    d = Path(tempfile.mkdtemp(prefix="gw-trust-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


def test_a_prefix_job_users_cannot_enter_is_reported(open_dir: Path) -> None:
    prefix = open_dir / "opt"
    (prefix / "ckpt").mkdir(parents=True, mode=0o755)
    target = run.Target(str(prefix), sys.executable, run.this_install("/x").gpuwarden)
    req = run.Request(target, str(SITEFILES), None)
    prefix.chmod(0o755)
    assert run.kit_unreachable(req) == []
    prefix.chmod(0o700)
    assert run.kit_unreachable(req) == [f"{prefix} (0700)"]
    prefix.chmod(0o711)
    (prefix / "ckpt").chmod(0o750)
    assert run.kit_unreachable(req) == [f"{prefix / 'ckpt'} (0750)"]


def test_the_install_says_which_directory_keeps_jobs_out(site: Path) -> None:
    prefix = site / "opt" / "gpuwarden"
    prefix.mkdir(parents=True)
    prefix.chmod(0o700)
    res = _install(site)
    assert res.exit_code == 0, res.output
    assert "warning: users other than root cannot get through" in res.output
    assert f"{prefix} (0700)" in res.output and "chmod o+rx" in res.output


def test_a_venv_job_users_cannot_enter_is_reported(site: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    parts = _venv(site, sys.executable)
    parts["venv"].chmod(0o700)
    _use(monkeypatch, parts)
    target = run.this_install(str(site / "opt"))
    assert f"{parts['venv']} (0700)" in run.check_runtime(run.Request(target, "", None))


def test_who_is_kept_out() -> None:
    def seen(mode: int, on_way: bool = False) -> trust.Seen:
        st = os.stat_result((mode, 0, 0, 1, 0, 0, 0, 0, 0, 0))
        return trust.Seen("/x", st, on_way)

    assert not trust.others_cannot(seen(stat.S_IFDIR | 0o711, on_way=True))
    assert trust.others_cannot(seen(stat.S_IFDIR | 0o750, on_way=True))
    assert trust.others_cannot(seen(stat.S_IFDIR | 0o711))
    assert not trust.others_cannot(seen(stat.S_IFREG | 0o644))
    assert trust.others_cannot(seen(stat.S_IFREG | 0o644), run=True)
    assert trust.others_cannot(seen(stat.S_IFREG | 0o600))
