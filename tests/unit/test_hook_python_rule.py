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
    pkg = site_dir / "gpuwarden" / "hooks"
    pkg.mkdir(parents=True)
    (site_dir / "gpuwarden" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "run.py").write_text("import sys\ndef main(argv):\n    return 0\n")
    _group_writable(pkg)
    site.hook(python, "prolog")
    assert f"refusing to import gpuwarden.hooks as root: {pkg} is writable by group" in site.logged()
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
    from gpuwarden.hooks import selftest

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


# ---- a second hostile review: what Python reads that the checks read otherwise, or not ------
@pytest.mark.parametrize("line", ["home =\t{bin}", "Home = {bin}", " home = {bin}",
                                  "home =\u00a0{bin}"],
                         ids=["tab", "capitalised", "indented", "no-break-space"])
def test_a_pyvenv_cfg_home_as_python_reads_it_is_checked_before_python_starts(
        site: Site, line: str) -> None:
    """Python reads pyvenv.cfg's key as key.strip().lower() and strips any whitespace from the
    value; the wrapper matched `home*=*` and stripped spaces only, so it checked the standard
    library beside the real interpreter while Python loaded another user's, whose `encodings`
    ran as root before gpuwarden_pystart.py could object."""
    python = pytrees.venv(site.root, pytrees.base_python(site.root))
    theirs = pytrees.users_python(site.root, site.marker)
    cfg = site.root / "venv" / "pyvenv.cfg"
    lines = [line.format(bin=theirs) if raw.startswith("home") else raw
             for raw in cfg.read_text().splitlines()]
    cfg.write_text("\n".join(lines) + "\n")
    for hook in ("prolog", "healthcheck"):
        res = site.hook(python, hook)
        assert res.returncode == 0
        assert not site.ran_as_root()
        assert f"{hook}: {REFUSED} {python} as root:" in site.logged()


def test_a_relative_pyvenv_cfg_home_is_refused(site: Site) -> None:
    python = pytrees.venv(site.root, pytrees.base_python(site.root))
    cfg = site.root / "venv" / "pyvenv.cfg"
    cfg.write_text(cfg.read_text().replace(f"home = {site.root}/", "home = "))
    site.hook(python)
    assert f"{REFUSED} {python} as root: home = base/bin in {cfg} is not an absolute path" \
        in site.logged()


def _replace_with_link_to_theirs(site: Site, entry: Path) -> Path:
    """ENTRY (a link into this Python's standard library) becomes a link to another user's
    copy of the file, which writes the uid it runs as to the marker and then does its job."""
    theirs = site.root / "their-files"
    theirs.mkdir(exist_ok=True)
    copy = theirs / entry.name
    code = (f"import posix as _p\n_p.close(_p.open({str(site.marker)!r}, _p.O_WRONLY | "
            "_p.O_CREAT, 0o644))\n")
    copy.write_text(code + Path(os.readlink(entry)).read_text())
    entry.unlink()
    entry.symlink_to(copy)
    pytrees.chown_tree(theirs)
    return theirs


def test_an_encodings_module_linked_to_another_users_file_is_refused_before_python_starts(
        site: Site) -> None:
    """The wrapper checked `encodings` one level down but skipped links there (find ! -type l),
    and Python imports encodings.aliases as it starts."""
    python = pytrees.venv(site.root, pytrees.base_python(site.root))
    enc = site.root / "base" / "lib" / VERSION / "encodings"
    real = Path(os.readlink(enc))
    enc.unlink()
    enc.mkdir(mode=0o755)
    for entry in real.iterdir():
        if entry.name != "__pycache__":
            (enc / entry.name).symlink_to(entry)
    theirs = _replace_with_link_to_theirs(site, enc / "aliases.py")
    res = site.hook(python, "healthcheck")
    assert res.returncode == 0
    assert not site.ran_as_root()
    assert f"healthcheck: {REFUSED} {python} as root: {theirs}" in site.logged()


def test_gpuwardens_start_imports_nothing_unchecked_from_the_standard_library(
        site: Site) -> None:
    """gpuwarden_pystart.py's own `from __future__ import annotations` ran before its import
    guard existed; the wrapper checked the standard library's top level but skipped links."""
    python = pytrees.venv(site.root, pytrees.base_python(site.root))
    stdlib = site.root / "base" / "lib" / VERSION
    (stdlib / "__pycache__").unlink()
    (stdlib / "__pycache__").mkdir(mode=0o755)
    theirs = _replace_with_link_to_theirs(site, stdlib / "__future__.py")
    res = site.hook(python, "prolog")
    assert res.returncode == 0
    assert not site.ran_as_root()
    assert f"{theirs} is owned by uid {NOBODY}" in site.logged() and REFUSED in site.logged()


def test_a_finder_a_pth_file_puts_ahead_of_the_guard_is_checked_too(site: Site) -> None:
    """An editable install's .pth imports a finder that goes first on sys.meta_path (as
    meson-python's does) and maps gpuwarden to a user's checkout: its modules ran unchecked."""
    python = pytrees.venv(site.root, pytrees.base_python(site.root), with_gpuwarden=False)
    theirs = site.root / "their-checkout" / "gpuwarden"
    (theirs / "hooks").mkdir(parents=True)
    code = f"import os\nopen({str(site.marker)!r}, 'w').write(str(os.getuid()))\n"
    (theirs / "__init__.py").write_text(code)
    (theirs / "hooks" / "__init__.py").write_text(code)
    (theirs / "hooks" / "run.py").write_text(code + "def main(argv):\n    return 0\n")
    pytrees.chown_tree(theirs.parent)
    sp = pytrees.site_packages(site.root / "venv")
    (sp / "_gpuwarden_editable_loader.py").write_text(
        "import importlib.util\nimport sys\n\n\nclass Finder:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name != 'gpuwarden':\n            return None\n"
        f"        return importlib.util.spec_from_file_location(name, {str(theirs)!r} + "
        f"'/__init__.py', submodule_search_locations=[{str(theirs)!r}])\n\n\n"
        "def install():\n    sys.meta_path.insert(0, Finder())\n")
    (sp / "_gpuwarden_editable_loader.pth").write_text(
        "import _gpuwarden_editable_loader; _gpuwarden_editable_loader.install()\n")
    res = site.hook(python, "prolog")
    assert res.returncode == 0
    assert not site.ran_as_root()
    assert f"refusing to import gpuwarden as root: {theirs.parent} is owned by uid {NOBODY}" \
        in site.logged()


def test_a_compiled_module_another_user_can_write_is_refused(site: Site) -> None:
    """The guard checked the __pycache__ directory but not the .pyc Python runs instead of the
    source: one that another user owns, with the source's mtime and size in its header, ran."""
    import importlib.util
    import py_compile

    python = pytrees.venv(site.root, pytrees.base_python(site.root), with_gpuwarden=False)
    pkg = pytrees.site_packages(site.root / "venv") / "gpuwarden" / "hooks"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    src = pkg / "run.py"
    src.write_text("def main(argv):\n    return 0\n")
    theirs = site.root / "evil.py"
    theirs.write_text(f"import os\nopen({str(site.marker)!r}, 'w').write(str(os.getuid()))\n"
                      "def main(argv):\n    return 0\n")
    cached = Path(importlib.util.cache_from_source(str(src)))
    os.utime(theirs, ns=(src.stat().st_atime_ns, src.stat().st_mtime_ns))
    py_compile.compile(str(theirs), cfile=str(cached), doraise=True)
    data = bytearray(cached.read_bytes())
    data[12:16] = src.stat().st_size.to_bytes(4, "little")  # the header's source size
    cached.write_bytes(bytes(data))
    os.chown(cached, NOBODY, NOBODY)
    for p in (cached.parent, pkg, pkg.parent):
        p.chmod(0o755)
    res = site.hook(python, "prolog")
    assert res.returncode == 0
    assert not site.ran_as_root()
    assert f"{cached} is owned by uid {NOBODY}" in site.logged() and REFUSED in site.logged()


@pytest.mark.parametrize("where", ["venv", "base"])
def test_a_pth_file_beside_the_interpreter_is_refused_before_python_starts(
        site: Site, where: str) -> None:
    """PYTHON._pth beside the interpreter as named (or its real file) replaces sys.path on
    Linux too (3.11+): a root-owned one naming another user's standard library ran its
    `encodings` as root; the wrapper read only pyvenv.cfg."""
    base = pytrees.base_python(site.root)
    python = pytrees.venv(site.root, base)
    theirs = pytrees.users_python(site.root, site.marker)
    pth = Path(f"{python if where == 'venv' else base}._pth")
    pth.write_text(f"{theirs.parent / 'lib' / VERSION}\n")
    pth.chmod(0o644)
    res = site.hook(python, "prolog")
    assert res.returncode == 0
    assert not site.ran_as_root()
    assert f"prolog: {REFUSED} {python} as root: {pth}" in site.logged()


@pytest.mark.parametrize("shebang", ["#!/bin/sh\nexec {theirs} \"$@\"\n", "#!{theirs}\n"],
                         ids=["shell-script", "shebang"])
def test_an_interpreter_that_is_a_script_is_refused(site: Site, shebang: str) -> None:
    """A script named as the interpreter (a site's wrapper that loads a module, or one with
    `#!/usr/bin/env python3`) runs an interpreter the wrapper never checked: here another
    user's, whose `encodings` ran as root."""
    python = pytrees.venv(site.root, pytrees.base_python(site.root))
    theirs = pytrees.users_python(site.root, site.marker) / VERSION
    python.unlink()
    python.write_text(shebang.format(theirs=theirs))
    python.chmod(0o755)
    res = site.hook(python, "prolog")
    assert res.returncode == 0
    assert not site.ran_as_root()
    assert f"prolog: {REFUSED} {python} as root: {python} is a script" in site.logged()


def _own_dynload(site: Site) -> tuple[Path, Path, Path]:
    """A venv whose base has a lib-dynload of its own (links to the real entries): its python,
    the real lib-dynload, and a codec extension module's link in it to tamper with."""
    python = pytrees.venv(site.root, pytrees.base_python(site.root))
    dynload = site.root / "base" / "lib" / VERSION / "lib-dynload"
    real = Path(os.readlink(dynload))
    dynload.unlink()
    dynload.mkdir(mode=0o755)
    for entry in real.iterdir():
        (dynload / entry.name).symlink_to(entry)
    codec = next(iter([*dynload.glob("_codecs_cn*.so"), *dynload.glob("*.so")]), None)
    if codec is None:
        pytest.skip("this Python has no extension modules in lib-dynload")
    return python, real, codec


def test_an_extension_module_others_can_write_in_lib_dynload_is_refused_before_python_starts(
        site: Site) -> None:
    """encodings imports a locale's codec module from lib-dynload as Python starts (GBK's
    _codecs_cn), before gpuwarden_pystart.py exists: the wrapper checks lib-dynload's entries
    as it checks encodings'."""
    python, real, codec = _own_dynload(site)
    codec.unlink()
    codec.write_bytes(Path(real / codec.name).read_bytes())
    _group_writable(codec)
    site.hook(python, "prolog")
    assert f"prolog: {REFUSED} {python} as root: {codec}: not root's" in site.logged()


def test_both_pyvenv_cfg_files_count(site: Site) -> None:
    """Python takes `home` from the pyvenv.cfg one level above the interpreter first, the one
    beside it only when there is none (site.py reads them the other way round); the wrapper
    read only the one beside it when both were there."""
    python = pytrees.venv(site.root, pytrees.base_python(site.root))
    theirs = pytrees.users_python(site.root, site.marker)
    cfg = site.root / "venv" / "pyvenv.cfg"
    (site.root / "venv" / "bin" / "pyvenv.cfg").write_text(cfg.read_text())
    cfg.write_text(cfg.read_text().replace(f"home = {site.root / 'base' / 'bin'}",
                                           f"home = {theirs}"))
    res = site.hook(python, "prolog")
    assert res.returncode == 0
    assert not site.ran_as_root()
    assert f"prolog: {REFUSED} {python} as root: {theirs.parent}" in site.logged()


def test_a_shared_builds_libpython_others_can_write_is_refused_before_python_starts(
        site: Site) -> None:
    """A shared build (pyenv, conda, python.org) is a small binary that loads libpython from
    its prefix's lib/: that file is the interpreter as much as bin/python is."""
    prefix = site.root / "shared-build"
    (prefix / "bin").mkdir(parents=True)
    python = prefix / "bin" / "python3"
    python.write_bytes(Path("/bin/true").read_bytes())  # an ELF, not a script
    python.chmod(0o755)
    pytrees.fake_stdlib(prefix)
    lib = prefix / "lib" / "libpython3.99.so.1.0"
    lib.write_bytes(b"\x7fELF")
    (prefix / "lib" / "libpython3.99.so").symlink_to(lib.name)
    _group_writable(lib)
    code = f'. {LIB}; gw_check_python {python}; printf "%s" "$_gw_why"'
    res = subprocess.run(["/bin/sh", "-c", code], env={}, capture_output=True, text=True,
                         timeout=60, check=True)
    assert res.stdout == f"{lib}: not root's, or group or others can write it"
    lib.chmod(0o755)
    res = subprocess.run(["/bin/sh", "-c", code], env={}, capture_output=True, text=True,
                         timeout=60, check=True)
    assert res.stdout == ""


def test_an_extension_module_linked_to_another_users_file_is_refused_before_python_starts(
        site: Site) -> None:
    python, _real, codec = _own_dynload(site)
    theirs = site.root / "their-files"
    theirs.mkdir()
    (theirs / codec.name).write_bytes(Path(os.readlink(codec)).read_bytes())
    codec.unlink()
    codec.symlink_to(theirs / codec.name)
    pytrees.chown_tree(theirs)
    site.hook(python, "prolog")
    assert f"prolog: {REFUSED} {python} as root: {theirs}" in site.logged()
