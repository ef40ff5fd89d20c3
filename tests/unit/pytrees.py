"""Real Python installations for the hooks' rule on what root imports: a base interpreter of
our own (its binary copied, its standard library linked entry by entry to this one's, its own
site-packages) and venvs made from it by `python -m venv`, in a directory only root can write,
so that each test can make one part of it someone else's."""

from __future__ import annotations

import grp
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VERSION = f"python{sys.version_info[0]}.{sys.version_info[1]}"
NOBODY = 65534


def root_only_base() -> str | None:
    """A directory root alone can write, every directory on the way too (pytest's tmp_path is
    under /tmp, sticky and world-writable, which the rule refuses); others may go through."""
    for cand in ("/var/lib", "/opt", os.path.expanduser("~root")):
        try:
            chain = [cand, *(str(p) for p in Path(cand).parents)]
            if all(os.stat(p).st_uid == 0 and not os.stat(p).st_mode & 0o022 for p in chain):
                return cand
        except OSError:
            continue
    return None


@contextmanager
def root_only_dir() -> Iterator[Path]:
    base = root_only_base()
    if os.geteuid() != 0 or base is None:
        import pytest

        pytest.skip("needs root and a directory only root can write")
    d = Path(tempfile.mkdtemp(prefix="gw-pytree-", dir=base))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def a_group() -> int:
    """A group other than root's (Debian's staff where it exists)."""
    for name in ("staff", "users", "nogroup"):
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            continue
    return NOBODY


def base_python(root: Path) -> Path:
    """A base installation at ROOT/base: bin/pythonX.Y (this interpreter's binary, copied so
    that Python finds its prefix here), lib/pythonX.Y a real directory whose entries link to
    this interpreter's standard library, and an empty site-packages of its own."""
    real = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    base = root / "base"
    (base / "bin").mkdir(parents=True)
    lib = base / "lib" / VERSION
    lib.mkdir(parents=True)
    python = base / "bin" / VERSION
    shutil.copy2(real, python)
    for entry in stdlib.iterdir():
        if entry.name not in ("site-packages", "dist-packages"):
            (lib / entry.name).symlink_to(entry)
    (lib / "site-packages").mkdir()
    for p in (base, *base.rglob("*")):
        if not p.is_symlink():
            p.chmod(0o755)
    return python


def venv(root: Path, python: Path, name: str = "venv", system_site: bool = False,
         with_gpuwarden: bool = True) -> Path:
    """``python -m venv`` at ROOT/NAME; gpuwarden (this tree) on its path through a .pth, and a
    `gpuwarden` command beside its python as an installer leaves one. Returns its python."""
    dest = root / name
    cmd = [str(python), "-I", "-m", "venv", "--without-pip", str(dest)]
    if system_site:
        cmd.insert(4, "--system-site-packages")
    subprocess.run(cmd, check=True, env={}, capture_output=True, timeout=120)
    site = dest / "lib" / VERSION / "site-packages"
    if with_gpuwarden:
        # This tree, then the test venv's packages (click, jinja2): their .pth files are not
        # read from a directory a .pth line adds, so /work/main's editable gpuwarden stays out.
        deps = sysconfig.get_paths()["purelib"]
        (site / "gpuwarden-tree.pth").write_text(f"{REPO}\n{deps}\n")
        cli = dest / "bin" / "gpuwarden"
        cli.write_text(f"#!{dest}/bin/python\nfrom gpuwarden.cli import main\nmain()\n")
        cli.chmod(0o755)
    return dest / "bin" / "python"


def site_packages(prefix: Path) -> Path:
    return prefix / "lib" / VERSION / "site-packages"


def drop(where: Path, name: str, marker: Path) -> Path:
    """What another user leaves in a directory they can write: a .pth or a module that, when
    root's Python reads it, writes the uid it runs as to ``marker``."""
    code = f"import os; open({str(marker)!r}, 'w').write(str(os.getuid()))"
    f = where / name
    f.write_text(code + "\n" if name.endswith(".pth") else code.replace("; ", "\n") + "\n")
    f.chmod(0o644)
    return f


def fake_stdlib(prefix: Path) -> None:
    """Enough of a standard library beside PREFIX/bin for the wrapper to find one, for the
    stand-in interpreters (shell scripts) of the wrapper's own tests."""
    enc = prefix / "lib" / "python3.99" / "encodings"
    enc.mkdir(parents=True, exist_ok=True)
    (enc.parent / "os.py").touch()
    for p in (prefix / "lib", enc.parent, enc):
        p.chmod(0o755)


def chown_tree(top: Path, uid: int = NOBODY) -> None:
    """Make everything at and below TOP (links themselves, not what they name) uid's."""
    for p in (top, *top.rglob("*")):
        os.lchown(p, uid, uid)


def users_python(root: Path, marker: Path) -> Path:
    """ROOT/theirs: a copy of ROOT/base that another user owns, whose `encodings` (imported as
    Python starts, before any check of Python's own) writes the uid it runs as to ``marker``.
    Returns its bin directory (what a venv's pyvenv.cfg names as `home`)."""
    theirs = root / "theirs"
    shutil.copytree(root / "base", theirs, symlinks=True)
    enc = theirs / "lib" / VERSION / "encodings"
    real = Path(os.readlink(enc))
    enc.unlink()
    shutil.copytree(real, enc, ignore=shutil.ignore_patterns("__pycache__"))
    init = enc / "__init__.py"
    init.write_text(f"import posix as _p\n_p.close(_p.open({str(marker)!r}, _p.O_WRONLY | "
                    "_p.O_CREAT, 0o644))\n" + init.read_text())
    chown_tree(theirs)
    return theirs / "bin"
