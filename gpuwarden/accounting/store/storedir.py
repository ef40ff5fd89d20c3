"""The store's directory as root reads and writes it: reached from / by safefs's walk, then
worked in by descriptor, never through a link a user planted.

`lemon scan --store --drain` runs as root and drains nodes from what the store holds; the
sync timer writes it as root. So: the directory is made 0750 (root writes, the group given it
may read, others nothing) and refused when someone other than root (or the user running the
command) owns it or when group or others can write it; the lock, the `day=` directories and
every file are opened by the directory's descriptor with ``O_NOFOLLOW``; the sweep removes
only regular files it finds by lstat, and skips a link (logged); a manifest's entries are
store file names (`file_problem`), never a path. Pure apart from the functions that take a
descriptor.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from gpuwarden.core import safefs
from gpuwarden.core.errors import GpuwardenError

log = logging.getLogger(__name__)

MODE = 0o750  # the store and its day directories: the group may read (DuckDB, an analyst)
FILE_MODE = 0o640
LOCK = ".lock"
DAY = r"day=(?:\d{4}-\d{2}-\d{2}|__HIVE_DEFAULT_PARTITION__)"
FILE_RE = re.compile(rf"({DAY})/([A-Za-z0-9][A-Za-z0-9_-]*\.parquet)")
DAY_RE = re.compile(DAY)
EVENTS_RE = re.compile(r"events-[A-Za-z0-9]+\.parquet")
ROLLUP = "rollup"  # `rollup/day=YYYY-MM-DD/NAME.parquet`: each runs file's rollup (`rollup`)
FIX = "chown root:root and chmod 0750 it (root alone writes the store), or ingest into a new store"


class StoreError(GpuwardenError):
    """A store that cannot be read or written as asked (another schema version, a bad
    manifest, exports that overlap, a directory or file someone else could have changed)."""


@dataclass(frozen=True)
class Dir:
    """The store's directory, open: its descriptor, and its path for messages and for
    polars' reads of files vetted in it (`vetted`)."""

    fd: int
    path: Path


def file_problem(rel: str) -> str:
    """"" when ``rel`` is a runs file's name as the store writes it (`day=YYYY-MM-DD/NAME.parquet`):
    a manifest naming anything else (a path, ``..``) was not written by gpuwarden."""
    return "" if FILE_RE.fullmatch(rel) else "not a file of the store (day=YYYY-MM-DD/NAME.parquet)"


def events_problem(name: str) -> str:
    return "" if EVENTS_RE.fullmatch(name) else "not a file of the store (events-NAME.parquet)"


@contextlib.contextmanager
def writing(path: str | os.PathLike[str]) -> Iterator[Dir]:
    """The store ``path`` to write: made (`MODE`, and what is missing above it 0755) or
    accepted only when ours alone (safefs.open_private_dir)."""
    try:
        fd = safefs.open_private_dir(str(path), f"refusing to write the store; {FIX}",
                                     create=MODE)
    except safefs.StateDirError as exc:
        raise StoreError(str(exc)) from None
    assert fd is not None  # made when missing
    try:
        yield Dir(fd, Path(path))
    finally:
        os.close(fd)


@contextlib.contextmanager
def reading(path: str | os.PathLike[str]) -> Iterator[Dir | None]:
    """The store ``path`` to read (None when absent): root's or ours, writable by nobody else
    (safefs.open_trusted_dir)."""
    try:
        fd = safefs.open_trusted_dir(str(path))
    except safefs.StateDirError as exc:
        raise StoreError(f"{exc}: not reading the store {path}; {FIX}") from None
    if fd is None:
        yield None
        return
    try:
        yield Dir(fd, Path(path))
    finally:
        os.close(fd)


def _owners() -> tuple[int, ...]:
    return (0, os.geteuid())


def _refusal(where: str, st: os.stat_result, regular: bool) -> str:
    """Why ``where`` (its lstat or fstat) is not a store file or directory to trust; ""."""
    kind_ok = stat.S_ISREG(st.st_mode) if regular else stat.S_ISDIR(st.st_mode)
    if not kind_ok:
        link = " (a symbolic link: never followed)" if stat.S_ISLNK(st.st_mode) else ""
        return f"{where} is not a {'regular file' if regular else 'directory'}{link}"
    if st.st_uid not in _owners():
        return f"{where} is owned by uid {st.st_uid}, not by root or uid {os.geteuid()}"
    if st.st_mode & 0o022:
        return f"{where} is writable by group or others: chmod go-w {where}"
    return ""


def _check(where: str, st: os.stat_result, regular: bool) -> None:
    problem = _refusal(where, st, regular)
    if problem:
        raise StoreError(f"{problem}: refusing it; {FIX}")


@contextlib.contextmanager
def locked(d: Dir) -> Iterator[None]:
    """One writer at a time (a timer's sync and a hand ingest): `.lock` in the store, made
    or opened without following a link (a planted one is refused, its target never made)."""
    where = f"{d.path}/{LOCK}"
    try:
        fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC, 0o600, dir_fd=d.fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreError(f"{where} is a symbolic link: remove it (the store never "
                             "follows a link)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise StoreError(f"{where} is not a regular file of ours: remove it")
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def open_day(d: Dir, name: str, create: bool) -> int | None:
    """The `day=` directory ``name`` of the store (or its `rollup` directory, or a `day=` one
    in that: ``d`` then the rollup directory), opened by descriptor (made `MODE` when
    ``create``); None when absent. A link there is refused, never followed."""
    assert DAY_RE.fullmatch(name) or name == ROLLUP, name
    where = f"{d.path}/{name}"
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=d.fd)  # 0700 until the chmod: never briefly wider
    try:
        fd = os.open(name, safefs.DIR_FLAGS, dir_fd=d.fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise StoreError(f"{where} is a symbolic link or not a directory: remove it (the "
                         "store never follows a link)") from None
    try:
        st = os.fstat(fd)
        if create and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != MODE:
            os.fchmod(fd, MODE)
            st = os.fstat(fd)
        _check(where, st, regular=False)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_at(dir_fd: int, name: str, write: Callable[[IO[bytes]], None]) -> None:
    """``name`` in ``dir_fd`` written by ``write``: an exclusive temp file beside it (never
    through a link), fsync, rename (complete or absent)."""
    tmp = f".{name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 FILE_MODE, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), FILE_MODE)
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def read_manifest(d: Dir, name: str) -> bytes | None:
    """The manifest's bytes (None when absent): a regular file of root's or ours that nobody
    else can write, opened by the store's descriptor without following a link."""
    where = f"{d.path}/{name}"
    try:
        fd = os.open(name, safefs.FILE_FLAGS, dir_fd=d.fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StoreError(f"{where} is a symbolic link: refusing it (never followed); "
                             f"{FIX}") from None
        raise StoreError(f"{where}: cannot read ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as fh:
        _check(where, os.fstat(fh.fileno()), regular=True)
        return fh.read()


def vetted(d: Dir, rels: Iterable[str]) -> list[str]:
    """The paths of the store files ``rels`` (names the manifest check accepted), each a
    regular file of root's or ours in a real `day=` directory (or the store's root) that
    nobody else can write. polars then reads them by path: that is safe because the walk
    vetted every directory above the store and these checks the ones below it, so nobody
    but root or us can swap a component in between."""
    out: list[str] = []
    seen: set[str] = set()
    for rel in rels:
        parts = rel.split("/")[:-1]
        for i in range(1, len(parts) + 1):  # each directory on the way, outermost first
            up = "/".join(parts[:i])
            if up in seen:
                continue
            st = _lstat(d, up)
            if st is not None:
                _check(f"{d.path}/{up}", st, regular=False)
            seen.add(up)
        st = _lstat(d, rel)
        if st is None:
            raise StoreError(f"{d.path}/{rel}: missing, though the manifest names it: the "
                             "store was changed by hand; ingest the exports again into a "
                             "new store")
        _check(f"{d.path}/{rel}", st, regular=True)
        out.append(str(d.path / rel))
    return out


def _lstat(d: Dir, rel: str) -> os.stat_result | None:
    try:
        return os.stat(rel, dir_fd=d.fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
