"""The defaults file (/etc/default/gpuwarden) as the hooks read it: what install-files reports
about it is what the hooks will run, and a site's other lines stay byte for byte."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from gpuwarden.install import plan, run
from gpuwarden.install.cli import install_files
from gpuwarden.install.plan import InstallError
from tests.unit import pytrees

REPO = Path(__file__).resolve().parents[2]
SITEFILES = REPO / "gpuwarden" / "sitefiles"
HOOK_LIB = SITEFILES / "prolog" / "gpuwarden-hook.sh"
EXE = sys.executable.encode()


@pytest.fixture
def site() -> Iterator[Path]:
    """Root's alone, as the hooks' rule wants the interpreter's way (pytest's tmp is in /tmp)."""
    with pytrees.root_only_dir() as d:
        (d / "etc").mkdir(mode=0o755)
        yield d


def _defaults(site: Path, data: bytes) -> Path:
    f = site / "etc" / "gpuwarden"
    f.write_bytes(data)
    f.chmod(0o644)
    return f


def _install(site: Path, *args: str) -> Result:
    return CliRunner().invoke(install_files, [str(site / "opt" / "gpuwarden"), "--defaults-file",
                                              str(site / "etc" / "gpuwarden"), *args])


def _hooks_python(f: Path) -> bytes:
    """What the shipped hook library starts, given defaults file ``f``."""
    code = f'. {HOOK_LIB}; gw_python {f} /bin/false; printf %s "$_gw_py"'
    return subprocess.run(["/bin/sh", "-c", code], env={}, capture_output=True, timeout=30,
                          check=True).stdout


@pytest.mark.parametrize("data", [
    b"GPUWARDEN_PYTHON=/a/python\r\n",  # saved on Windows
    b"GPUWARDEN_PYTHON='/a/python'\r\n",
    b"A=1\x0cGPUWARDEN_PYTHON=/a/python\n",  # a form feed splits no line for the shell
    b"A=1\xc2\x85GPUWARDEN_PYTHON=/a/python\n",  # nor does U+0085
    b"GPUWARDEN_PYTHON=/a/pyth\xe9n\n",
    b"GPUWARDEN_PYTHON=/a/python \n",
    b"GPUWARDEN_PYTHON=/a/python\rGPUWARDEN_PYTHON=/b\n",
])
def test_odd_bytes_are_read_as_the_hooks_read_them(tmp_path: Path, data: bytes) -> None:
    f = tmp_path / "defaults"
    f.write_bytes(data)
    f.chmod(0o644)
    named = plan.current_python(data)
    assert (named or "/usr/bin/python3").encode(errors="surrogateescape") == _hooks_python(f)


def test_a_windows_line_ending_is_not_reported_unchanged(site: Path) -> None:
    """The hooks would run '<python>\\r', which does not exist: gating off on every node."""
    f = _defaults(site, b"GPUWARDEN_HOOK_LIMIT_S=200\r\nGPUWARDEN_PYTHON=" + EXE + b"\r\n")
    res = _install(site)
    assert res.exit_code == 3, res.output
    assert "unchanged" not in res.output
    assert "carriage return" in res.output and "--replace-python" in res.output
    assert not (site / "opt").exists()
    res = _install(site, "--replace-python")
    assert res.exit_code == 0, res.output
    assert f.read_bytes() == b"GPUWARDEN_HOOK_LIMIT_S=200\r\nGPUWARDEN_PYTHON=" + EXE + b"\n"
    assert _hooks_python(f) == EXE


def test_a_trailing_blank_is_named(site: Path) -> None:
    _defaults(site, b"GPUWARDEN_PYTHON=" + EXE + b" \n")
    res = _install(site)
    assert res.exit_code == 3
    assert f"GPUWARDEN_PYTHON={sys.executable + ' '!a}" in res.output
    assert "blanks or control characters" in res.output


@pytest.mark.parametrize("how", ["add", "replace"])
def test_a_sites_other_lines_stay_byte_for_byte(site: Path, how: str) -> None:
    other = b"# caf\xe9 (latin-1)\r\nGPUWARDEN_HOOK_LIMIT_S=200\x0c\n"
    f = _defaults(site, other + (b"GPUWARDEN_PYTHON=/b\n" if how == "replace" else b""))
    res = _install(site, "--replace-python")
    assert res.exit_code == 0, res.output
    assert f.read_bytes() == other + b"GPUWARDEN_PYTHON=" + EXE + b"\n"


def test_a_form_feed_does_not_hide_a_missing_line(site: Path) -> None:
    f = _defaults(site, b"A=1\x0cGPUWARDEN_PYTHON=" + EXE + b"\n")
    res = _install(site)
    assert res.exit_code == 0, res.output
    assert "line added" in res.output
    assert _hooks_python(f) == EXE


# ---- the same interpreter, spelled differently (LOW 11) -----------------------------------
def _spelled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A venv bin/ as pip leaves it: console scripts name bin/python3; bin/python is the same."""
    bin_ = tmp_path / "venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python3").symlink_to(sys.executable)
    (bin_ / "python").symlink_to("python3")
    real_gw = run.this_install("/x").gpuwarden
    (bin_ / "gpuwarden").symlink_to(real_gw)
    for d in (tmp_path / "venv", bin_):
        d.chmod(0o755)
    real = sysconfig.get_path
    monkeypatch.setattr(sys, "executable", str(bin_ / "python3"))
    monkeypatch.setattr(run.sysconfig, "get_path",
                        lambda name: str(bin_) if name == "scripts" else real(name))
    return bin_


def test_the_guides_spelling_of_this_interpreter_is_kept(site: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    bin_ = _spelled(site, monkeypatch)
    f = _defaults(site, f"GPUWARDEN_PYTHON={bin_}/python\n".encode())
    res = _install(site)
    assert res.exit_code == 0, res.output
    assert f"  GPUWARDEN_PYTHON={bin_}/python\n" in res.output
    assert f.read_bytes() == f"GPUWARDEN_PYTHON={bin_}/python\n".encode()
    assert (site / "opt" / "gpuwarden" / "ckpt" / "train.sbatch").read_text().count(
        f"GW_PYTHON={bin_}/python3\n") == 1


def test_the_same_file_in_another_directory_is_another_interpreter(
        site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """/usr/bin/python3 is the venv's python's target, but finds none of the venv's packages."""
    bin_ = _spelled(site, monkeypatch)
    elsewhere = site / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    (elsewhere / "python3").symlink_to(bin_ / "python3")
    _defaults(site, f"GPUWARDEN_PYTHON={elsewhere}/python3\n".encode())
    res = _install(site)
    assert res.exit_code == 3
    assert "--replace-python" in res.output


def test_same_interpreter(tmp_path: Path) -> None:
    (tmp_path / "python3").symlink_to(sys.executable)
    (tmp_path / "python").symlink_to("python3")
    assert run.same_interpreter(f"{tmp_path}/python", f"{tmp_path}/python3")
    assert not run.same_interpreter(f"{tmp_path}/python\r", f"{tmp_path}/python3")
    assert not run.same_interpreter(f"{tmp_path}/gone", f"{tmp_path}/python3")
    assert not run.same_interpreter(sys.executable, f"{tmp_path}/python3")


# ---- refusals say what to do (LOW 13), other paths are flagged (LOW 14) ---------------------
def _not_root_request(site: Path) -> tuple[run.Request, int]:
    """A request as a user other than the owner of the directories the site has."""
    if os.geteuid() == 0:
        owner, defaults = 4242, str(site / "etc" / "gpuwarden")  # site/etc is root's
    else:
        owner, defaults = os.geteuid(), "/etc/gpuwarden-not-there"  # /etc is root's
    target = plan.Target(str(site / "opt" / "gpuwarden"), sys.executable,
                         run.this_install("/x").gpuwarden)
    return run.Request(target, str(SITEFILES), defaults, dry_run=True, owner=owner), owner


def test_a_non_root_refusal_says_to_run_as_root_or_skip_the_defaults_file(site: Path) -> None:
    req, owner = _not_root_request(site)
    with pytest.raises(InstallError) as err:
        run.install(req)
    msg = str(err.value)
    assert f"not by uid {owner} (who installs): run install-files as root" in msg
    assert "or pass --no-defaults-file" in msg


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory another uid's")
def test_a_prefix_of_roots_refused_to_someone_else_says_to_run_as_root(site: Path) -> None:
    req, owner = _not_root_request(site)
    (site / "opt" / "gpuwarden").mkdir(parents=True, mode=0o755)
    with pytest.raises(InstallError, match=rf"not by uid {owner} \(who installs\): run "
                                           "install-files as root"):
        run.install(req)


def test_a_defaults_file_the_hooks_never_read_is_flagged(site: Path) -> None:
    res = _install(site)
    assert res.exit_code == 0, res.output
    assert (f"warning: the shipped hooks read {plan.DEFAULTS_FILE}, not {site}/etc/gpuwarden"
            in res.output)
    res = CliRunner().invoke(install_files, [str(site / "opt" / "gpuwarden"),
                                             "--no-defaults-file"])
    assert res.exit_code == 0, res.output
    assert "shipped hooks read" not in res.output
