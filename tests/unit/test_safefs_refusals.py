"""Every safefs entry point, read and write side, against what a user could plant where root
reads or writes (issue 35): a symlink, a FIFO (which must not block: O_NONBLOCK), a file or
directory of another uid, a group-writable directory, a link in the path above.

Each cell of the table says what the entry point does today: refuses (with a message naming the
path and why), replaces the planted thing atomically without following or opening it (writers),
reads nothing (read_plain), or does not refuse (a FINDING, listed in the issue's report: a strict
xfail, so that adding the refusal turns it into a failure to update here, never a silent pass).
Entry points that take a directory descriptor are run as their callers run them, after the walk
that vets the directory (opened_dir, walk).
"""

from __future__ import annotations

import os
import signal
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpuwarden.core import safefs
from gpuwarden.core.errors import GpuwardenError, InstallError

OTHER_UID = 65534  # nobody
OURS, NEW = b"ours\n", b"new contents\n"
ME = os.geteuid()


@dataclass(frozen=True)
class Site:
    """base/up/p/d/f: ``d`` the directory the file ``f`` is in; ``target`` what the entry point
    is given (``f``, or ``d`` for one that vets a directory); ``decoy`` what a planted link
    points at (a file of ours with other contents, or a directory holding one)."""

    base: Path
    target: Path
    decoy: Path

    @property
    def dir(self) -> Path:
        return self.base / "up" / "p" / "d"

    @property
    def file(self) -> Path:
        return self.dir / "f"


def _good_dir(path: Path, mode: int = 0o700) -> None:
    path.mkdir()
    path.chmod(mode)


def _good_file(path: Path, data: bytes = OURS) -> None:
    path.write_bytes(data)
    path.chmod(0o600)


def _decoy(base: Path, kind: str) -> Path:
    """What a link points at: for a file, a file of ours; for a directory, one holding ``f``."""
    if kind == "file":
        _good_file(base / "decoy", b"decoy\n")
        return base / "decoy"
    _good_dir(base / "decoy")
    _good_file(base / "decoy" / "f", b"decoy\n")
    return base / "decoy"


def _relink(path: Path, decoy: Path) -> None:
    """Move ``path``'s tree to ``decoy`` and leave a link in its place (the same tree, reached
    through a link): a user's link. (Root's link in a directory of root's is followed, as
    /var/run -> /run is: see test_safefs_walk.py.)"""
    path.rename(decoy)
    path.symlink_to(decoy)
    if ME == 0:
        os.lchown(path, OTHER_UID, OTHER_UID)


def build(base: Path, kind: str, case: str) -> Site:
    _good_dir(base / "up", 0o755)
    _good_dir(base / "up" / "p", 0o755)
    _good_dir(base / "up" / "p" / "d")
    site = Site(base, Path(), Path())
    _good_file(site.file)
    target = site.file if kind == "file" else site.dir
    decoy = base / "decoy"
    if case == "symlink":
        decoy = _decoy(base, kind)
        if kind == "file":
            target.unlink()
        else:
            (target / "f").unlink()
            target.rmdir()
        target.symlink_to(decoy)
    elif case == "fifo":
        if kind == "dir":
            (target / "f").unlink()
            target.rmdir()
        else:
            target.unlink()
        os.mkfifo(target, 0o600)
    elif case == "other_owner":
        os.chown(target, OTHER_UID, OTHER_UID)
    elif case == "group_writable":
        site.dir.chmod(0o770)  # the directory the file is in (that a directory entry vets)
    elif case == "parent_link":
        _relink(target.parent, decoy)
    elif case == "ancestor_link":
        _relink(target.parent.parent, decoy)
    else:
        assert case == "good"
    return Site(base, target, decoy)


CASES = ("symlink", "fifo", "other_owner", "group_writable", "parent_link", "ancestor_link")


class NothingRead(Exception):
    """What the table's wrappers raise for an entry point that refuses by returning nothing."""


# ---- the entry points, called as root's code calls them -------------------------------------
@contextmanager
def _opened(site: Site) -> Iterator[int]:
    with safefs.opened_dir(str(site.target.parent), ME, create=False) as fd:
        assert fd is not None
        yield fd


def _walked(site: Site) -> int:
    return safefs.walk(str(site.target.parent.parent), [site.target.parent.name], ME)


def read_private(s: Site) -> object:
    return safefs.read_private(str(s.target))


def check_private_dir(s: Site) -> object:
    return safefs.check_private_dir(str(s.target))


def read_own_at(s: Site) -> object:
    with _opened(s) as fd:  # as health inject reads its test files
        return safefs.read_own_at(fd, s.target.name, str(s.target))


def open_private_dir(s: Site) -> object:
    fd = safefs.open_private_dir(str(s.target), "refusing it")  # as the accounting store writes
    assert fd is not None
    os.close(fd)
    return None


def open_trusted_dir(s: Site) -> object:
    fd = safefs.open_trusted_dir(str(s.target))  # as the accounting store is read
    assert fd is not None
    os.close(fd)
    return None


def ensure_private_dir(s: Site) -> object:
    safefs.ensure_private_dir(str(s.target))
    return None


def atomic_write(s: Site) -> object:
    safefs.atomic_write(str(s.target.parent), s.target.name, NEW)
    return None


def private_write(s: Site) -> object:
    """As the verdict store, the prolog's settings and selftest write: the directory vetted."""
    safefs.ensure_private_dir(str(s.target.parent))
    safefs.atomic_write(str(s.target.parent), s.target.name, NEW)
    return None


def write_at(s: Site) -> object:
    with _opened(s) as fd:  # as install-files and health inject write
        safefs.write_at(fd, s.target.name, NEW)
    return None


def read_plain(s: Site) -> object:
    data = safefs.read_plain(str(s.target))
    if not data:
        raise NothingRead(f"{s.target}: read_plain read nothing")
    return data


def write_admin_file(s: Site) -> object:
    safefs.write_admin_file(str(s.target), NEW)
    return None


def admin_file_problem(s: Site) -> object:
    problem = safefs.admin_file_problem(str(s.target))
    if problem:
        raise UnsafeReported(problem)
    return None


class UnsafeReported(Exception):
    """admin_file_problem's answer: what it reports instead of raising."""


def read_head(s: Site) -> object:
    return safefs.read_head(str(s.target), 64)


def opened_dir(s: Site) -> object:
    with safefs.opened_dir(str(s.target), ME, create=False) as fd:
        assert fd is not None
    return None


def read_existing(s: Site) -> object:
    with _opened(s) as fd:  # as install-files reads what it would replace
        return safefs.read_existing(fd, s.target.name, str(s.target))


def read_source(s: Site) -> object:
    return safefs.read_source(str(s.base), str(s.target.relative_to(s.base)))


def open_spool(s: Site) -> object:
    os.close(safefs.open_spool(str(s.target)))
    return None


def ensure_spool(s: Site) -> object:
    os.close(safefs.ensure_spool(str(s.target)))
    return None


def walk(s: Site) -> object:
    os.close(safefs.walk(str(s.target.parent), [s.target.name], ME))
    return None


def open_dir(s: Site) -> object:
    with safefs.closing(safefs.open_spool(str(s.target.parent))) as spool:
        fd, _ = safefs.open_dir(spool, s.target.name, ME, str(s.target))
        os.close(fd)
    return None


def _sink(_: memoryview) -> None:
    pass


def read_file(s: Site) -> object:
    with safefs.closing(_walked(s)) as fd:
        return bytes(safefs.read_file(fd, s.target.name, ME, 1 << 20, str(s.target)))


def copy_file(s: Site) -> object:
    with safefs.closing(_walked(s)) as fd:
        return bytes(safefs.copy_file(fd, s.target.name, ME, len(OURS), str(s.target), _sink))


def map_file(s: Site) -> object:
    with safefs.closing(_walked(s)) as fd:
        mapped = safefs.map_file(fd, s.target.name, ME, len(OURS), str(s.target), _sink)
        data = bytes(mapped)
        if not isinstance(mapped, bytearray):
            mapped.close()
        return data


def stream_file(s: Site) -> object:
    with safefs.closing(_walked(s)) as fd:
        safefs.stream_file(fd, s.target.name, ME, len(OURS), str(s.target), _sink)
    return None


# ---- what each does with each case -----------------------------------------------------------
@dataclass(frozen=True)
class Refuses:
    error: type[BaseException]
    match: str  # a regex on the message
    names_path: bool = True  # False: a FINDING (the message does not say which path)


@dataclass(frozen=True)
class Replaces:
    """A writer: the planted thing is replaced by our new file (ours, regular), never written
    through or opened; a link's decoy keeps its contents."""


@dataclass(frozen=True)
class Finding:
    why: str  # not refused today: listed in issue 35's report


LINK = r"[Tt]oo many levels of symbolic links|symbolic link|not a directory \(a link\?\)"
NOT_REG = r"not a regular file"
OTHER = rf"(owned by|belongs to) uid {OTHER_UID}"
GW = r"writable by group or others|without the sticky bit"
StateDir, Inst, Spool = safefs.StateDirError, InstallError, safefs.Refused


@dataclass(frozen=True)
class Entry:
    call: Callable[[Site], object]
    kind: str  # "file" or "dir": what the entry point is given
    side: str  # "read" or "write"
    cells: dict[str, Refuses | Replaces | Finding]



ENTRIES: dict[str, Entry] = {
    # privfile
    "read_private": Entry(read_private, "file", "read", {
        "symlink": Refuses(OSError, LINK), "fifo": Refuses(StateDir, NOT_REG),
        "other_owner": Refuses(StateDir, OTHER), "group_writable": Refuses(StateDir, GW),
        "parent_link": Refuses(StateDir, LINK), "ancestor_link": Refuses(StateDir, LINK)}),
    "check_private_dir": Entry(check_private_dir, "dir", "read", {
        "symlink": Refuses(StateDir, LINK), "fifo": Refuses(StateDir, LINK),
        "other_owner": Refuses(StateDir, OTHER), "group_writable": Refuses(StateDir, GW),
        "parent_link": Refuses(StateDir, LINK), "ancestor_link": Refuses(StateDir, LINK)}),
    "open_private_dir": Entry(open_private_dir, "dir", "write", {
        "symlink": Refuses(StateDir, LINK), "fifo": Refuses(StateDir, LINK),
        "other_owner": Refuses(StateDir, OTHER), "group_writable": Refuses(StateDir, GW),
        "parent_link": Refuses(StateDir, LINK), "ancestor_link": Refuses(StateDir, LINK)}),
    "opened_dir + read_own_at": Entry(read_own_at, "file", "read", {
        "symlink": Refuses(OSError, LINK), "fifo": Refuses(StateDir, NOT_REG),
        "other_owner": Refuses(StateDir, OTHER), "group_writable": Refuses(Inst, GW),
        "parent_link": Refuses(Inst, LINK), "ancestor_link": Refuses(Inst, LINK)}),
    # atomic
    "ensure_private_dir": Entry(ensure_private_dir, "dir", "write", {
        "symlink": Refuses(StateDir, LINK), "fifo": Refuses(StateDir, LINK),
        "other_owner": Refuses(StateDir, OTHER), "group_writable": Refuses(StateDir, GW),
        "parent_link": Refuses(StateDir, LINK), "ancestor_link": Refuses(StateDir, LINK)}),
    "atomic_write": Entry(atomic_write, "file", "write", {
        "symlink": Replaces(), "fifo": Replaces(), "other_owner": Replaces(),
        "group_writable": Refuses(StateDir, GW), "parent_link": Refuses(StateDir, LINK),
        "ancestor_link": Refuses(StateDir, LINK)}),
    "ensure_private_dir + atomic_write": Entry(private_write, "file", "write", {
        "symlink": Replaces(), "fifo": Replaces(), "other_owner": Replaces(),
        "group_writable": Refuses(StateDir, GW), "parent_link": Refuses(StateDir, LINK),
        "ancestor_link": Refuses(StateDir, LINK)}),
    "opened_dir + write_at": Entry(write_at, "file", "write", {
        "symlink": Replaces(), "fifo": Replaces(), "other_owner": Replaces(),
        "group_writable": Refuses(Inst, GW), "parent_link": Refuses(Inst, LINK),
        "ancestor_link": Refuses(Inst, LINK)}),
    "open_trusted_dir": Entry(open_trusted_dir, "dir", "read", {
        "symlink": Refuses(StateDir, LINK), "fifo": Refuses(StateDir, LINK),
        "other_owner": Refuses(StateDir, OTHER), "group_writable": Refuses(StateDir, GW),
        "parent_link": Refuses(StateDir, LINK), "ancestor_link": Refuses(StateDir, LINK)}),
    "read_plain": Entry(read_plain, "file", "read", {
        "symlink": Refuses(NothingRead, "read nothing"), "fifo": Refuses(NothingRead, "read nothing"),
        "other_owner": Refuses(StateDir, OTHER), "group_writable": Refuses(StateDir, GW),
        "parent_link": Refuses(StateDir, LINK), "ancestor_link": Refuses(StateDir, LINK)}),
    # adminfile
    "write_admin_file": Entry(write_admin_file, "file", "write", {
        "symlink": Replaces(), "fifo": Replaces(), "other_owner": Replaces(),
        "group_writable": Refuses(safefs.UnsafePathError, GW),
        "parent_link": Refuses(safefs.UnsafePathError, LINK),
        "ancestor_link": Refuses(safefs.UnsafePathError, LINK)}),
    "admin_file_problem": Entry(admin_file_problem, "file", "read", {
        "symlink": Refuses(UnsafeReported, NOT_REG), "fifo": Refuses(UnsafeReported, NOT_REG),
        "other_owner": Refuses(UnsafeReported, OTHER), "group_writable": Refuses(UnsafeReported, GW),
        "parent_link": Refuses(UnsafeReported, LINK), "ancestor_link": Refuses(UnsafeReported, LINK)}),
    "read_head": Entry(read_head, "file", "read", {
        "symlink": Refuses(OSError, LINK), "fifo": Refuses(OSError, NOT_REG),
        "other_owner": Refuses(safefs.UnsafePathError, OTHER),
        "group_writable": Refuses(safefs.UnsafePathError, GW),
        "parent_link": Refuses(safefs.UnsafePathError, LINK),
        "ancestor_link": Refuses(safefs.UnsafePathError, LINK)}),
    # installwrite
    "opened_dir": Entry(opened_dir, "dir", "write", {
        "symlink": Refuses(Inst, LINK), "fifo": Refuses(Inst, LINK),
        "other_owner": Refuses(Inst, OTHER), "group_writable": Refuses(Inst, GW),
        "parent_link": Refuses(Inst, LINK), "ancestor_link": Refuses(Inst, LINK)}),
    "opened_dir + read_existing": Entry(read_existing, "file", "read", {
        "symlink": Refuses(Inst, LINK), "fifo": Refuses(Inst, NOT_REG),
        "other_owner": Refuses(Inst, OTHER),
        "group_writable": Refuses(Inst, GW), "parent_link": Refuses(Inst, LINK),
        "ancestor_link": Refuses(Inst, LINK)}),
    "read_source": Entry(read_source, "file", "read", {
        "symlink": Refuses(Inst, LINK), "fifo": Refuses(Inst, NOT_REG),
        "other_owner": Refuses(Inst, OTHER), "group_writable": Refuses(Inst, GW),
        "parent_link": Refuses(Inst, LINK), "ancestor_link": Refuses(Inst, LINK)}),
    # spool
    "open_spool": Entry(open_spool, "dir", "read", {
        "symlink": Refuses(Spool, LINK), "fifo": Refuses(Spool, LINK),
        "other_owner": Refuses(Spool, OTHER), "group_writable": Refuses(Spool, GW),
        "parent_link": Refuses(Spool, LINK), "ancestor_link": Refuses(Spool, LINK)}),
    "ensure_spool": Entry(ensure_spool, "dir", "write", {
        "symlink": Refuses(Spool, LINK), "fifo": Refuses(Spool, LINK),
        "other_owner": Refuses(Spool, OTHER), "group_writable": Refuses(Spool, GW),
        "parent_link": Refuses(Spool, LINK), "ancestor_link": Refuses(Spool, LINK)}),
    "walk": Entry(walk, "dir", "read", {
        "symlink": Refuses(Spool, LINK), "fifo": Refuses(Spool, LINK),
        "other_owner": Refuses(Spool, OTHER), "group_writable": Refuses(Spool, GW),
        "parent_link": Refuses(Spool, LINK),
        "ancestor_link": Refuses(Spool, LINK)}),
    "open_dir": Entry(open_dir, "dir", "read", {
        "symlink": Refuses(Spool, LINK), "fifo": Refuses(Spool, LINK),
        "other_owner": Refuses(Spool, OTHER), "group_writable": Refuses(Spool, GW),
        "parent_link": Refuses(Spool, LINK),
        "ancestor_link": Refuses(Spool, LINK)}),
}
# The four readers below the spool's walk answer alike.
for _name, _call in (("walk + read_file", read_file), ("walk + copy_file", copy_file),
                     ("walk + map_file", map_file), ("walk + stream_file", stream_file)):
    ENTRIES[_name] = Entry(_call, "file", "read", {
        "symlink": Refuses(Spool, NOT_REG), "fifo": Refuses(Spool, NOT_REG),
        "other_owner": Refuses(Spool, OTHER), "group_writable": Refuses(Spool, GW),
        "parent_link": Refuses(Spool, LINK), "ancestor_link": Refuses(Spool, LINK)})


def _params() -> Iterator[object]:
    for name, entry in ENTRIES.items():
        for case in CASES:
            cell = entry.cells[case]
            marks: list[pytest.MarkDecorator] = []
            if case == "other_owner" and ME != 0:
                marks.append(pytest.mark.skip(reason="needs root (chown)"))
            if isinstance(cell, Finding):
                marks.append(pytest.mark.xfail(strict=True, raises=pytest.fail.Exception,
                                               reason=f"FINDING: {cell.why}"))
            yield pytest.param(name, case, id=f"{name}-{case}", marks=marks)


@pytest.fixture
def no_blocking() -> Iterator[None]:
    """A FIFO opened for reading without O_NONBLOCK waits for a writer forever: fail instead."""
    def late(*_: object) -> None:
        raise TimeoutError("blocked (a FIFO opened without O_NONBLOCK?)")
    old = signal.signal(signal.SIGALRM, late)
    signal.setitimer(signal.ITIMER_REAL, 5.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_every_entry_point_has_every_case() -> None:
    for name, entry in ENTRIES.items():
        assert set(entry.cells) == set(CASES), name
    public_calls = {n for n in safefs.__all__ if n[0].islower()}
    named = {part.strip() for name in ENTRIES for part in name.split("+")}
    # Not in the table: pure checks on a stat result, a comparison, flags, a context manager,
    # and removal (tested below: it removes a link, never what it points at).
    assert public_calls - named == {"unsafe_dir_problem", "already_installed", "closing",
                                    "discard", "lstat_at", "mappable", "remove_at"}


@pytest.mark.parametrize("name", list(ENTRIES))
def test_each_entry_point_works_on_a_good_site(tmp_path: Path, name: str,
                                               no_blocking: None) -> None:
    """The table's refusals are about the cases, not a broken set-up."""
    entry = ENTRIES[name]
    site = build(tmp_path, entry.kind, "good")
    entry.call(site)


@pytest.mark.parametrize(("name", "case"), list(_params()))
def test_what_each_entry_point_does_with_a_planted_path(
        tmp_path: Path, name: str, case: str, no_blocking: None) -> None:
    entry = ENTRIES[name]
    cell = entry.cells[case]
    site = build(tmp_path, entry.kind, case)
    decoy_before = _snapshot(site.decoy)
    if isinstance(cell, Replaces):
        entry.call(site)
        st = os.lstat(site.target)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == ME
        assert site.target.read_bytes() == NEW
        assert _snapshot(site.decoy) == decoy_before  # the link was not written through
        return
    error = cell.error if isinstance(cell, Refuses) else (OSError, GpuwardenError, NothingRead,
                                                           UnsafeReported)
    with pytest.raises(error) as raised:  # a Finding: does not raise (pytest.fail.Exception)
        entry.call(site)
    assert isinstance(cell, Refuses)
    message = str(raised.value)
    assert raised.match(cell.match), message
    named = {str(p) for p in (site.target, site.target.parent, site.target.parent.parent)}
    if cell.names_path:
        assert any(path in message for path in named), f"the message names no path: {message}"
    assert _snapshot(site.decoy) == decoy_before


def _snapshot(path: Path) -> dict[str, bytes]:
    """A decoy's contents (a file, or a directory's files)."""
    if not path.exists():
        return {}
    if path.is_file():
        return {"": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


# ---- removal ----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["symlink", "fifo", "other_owner"])
def test_removal_takes_the_planted_entry_itself_never_what_a_link_points_at(
        tmp_path: Path, case: str, no_blocking: None) -> None:
    if case == "other_owner" and ME != 0:
        pytest.skip("needs root (chown)")
    site = build(tmp_path, "dir", case)
    before = _snapshot(site.decoy)
    with safefs.closing(os.open(site.target.parent, os.O_RDONLY | os.O_DIRECTORY)) as fd:
        assert safefs.remove_at(fd, site.target.name)
    assert not os.path.lexists(site.target)
    assert _snapshot(site.decoy) == before
