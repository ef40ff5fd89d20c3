"""Root's own state and metrics files: a private directory made or vetted, files replaced
atomically (complete or absent, never written through a link), small files read back.

Moved out of gpuwarden.health.store, whose verdict store is built on them; the lemon list, the
prolog's settings, install-files and `health inject` write with them too."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat

from gpuwarden.core.safefs._checks import dir_problem, open_file_at, owned_by_other, trusted_who
from gpuwarden.core.safefs._walk import Unsafe, walk_dir
from gpuwarden.core.safefs.privfile import MAX_STATE_BYTES, StateDirError, open_private_dir


def ensure_private_dir(path: str, mode: int = 0o700) -> None:
    """Create ``path`` (``mode``; what is missing above it 0755), or accept it only if it is a
    real directory we alone can write, reached from / by the one walk (see _walk). 0755 suits
    a directory others read from (node_exporter's textfiles) that only we may write."""
    fd = open_private_dir(path, "refusing to use it", create=mode)
    if fd is not None:
        os.close(fd)


def _trusted() -> tuple[int, ...]:
    return (0, os.geteuid())


def open_trusted_dir(directory: str) -> int | None:
    """A descriptor of ``directory``, reached from / by the one walk, when it is a real
    directory of root's (or ours) that nobody else can write; None when absent. Raises
    StateDirError naming what is wrong."""
    who = trusted_who(_trusted())
    try:
        fd = walk_dir(directory, _trusted(), who)
    except Unsafe as exc:
        raise StateDirError(f"{exc}: refusing to use {directory}") from None
    if fd is None:
        return None
    problem = dir_problem(directory, os.fstat(fd), _trusted(), who)
    if problem:
        os.close(fd)
        raise StateDirError(f"{problem}: refusing to use it")
    return fd


def _write_all(fd: int, data: bytes) -> None:
    """os.write may write less than asked (a disk filling up): loop until all of it is down."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_at(dir_fd: int, name: str, data: bytes, mode: int = 0o600) -> None:
    """Replace ``name`` in the directory ``dir_fd``: an exclusive temp file beside it (never
    through a link), fsync, rename, fsync the directory.

    The file is complete or absent: any failure before the rename removes the temp file and
    raises, leaving the previous file (if any) as it was. The directory is the caller's to vet
    (`opened_dir`, `ensure_private_dir`)."""
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=dir_fd)
    try:
        try:
            os.fchmod(fd, mode)
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)


def atomic_write(directory: str, name: str, data: bytes, mode: int = 0o600) -> None:
    """`write_at` in the directory at ``directory``, once `open_trusted_dir` has vetted it
    (StateDirError; FileNotFoundError when it is absent)."""
    dfd = open_trusted_dir(directory)
    if dfd is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), directory)
    try:
        write_at(dfd, name, data, mode)
    finally:
        os.close(dfd)


def discard(directory: str, name: str) -> None:
    """Remove ``name`` (a link itself, never its target) if it is there, in a directory
    `open_trusted_dir` accepts (StateDirError otherwise)."""
    dfd = open_trusted_dir(directory)
    if dfd is None:
        return
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dfd)
    finally:
        os.close(dfd)


def read_plain(path: str) -> bytes:
    """A small regular file's bytes (b"" when it or its directory is absent, or it is not a
    regular file); never a link. Raises StateDirError when its directory is not one
    `open_trusted_dir` accepts, or it is not root's (or ours) alone: what root's metrics
    writer reads back, only root (or we) may have written."""
    directory, name = os.path.split(path)
    dfd = open_trusted_dir(directory or ".")
    if dfd is None:
        return b""
    try:
        fd = open_file_at(dfd, name, path)
    except OSError:
        return b""
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return b""
        found = owned_by_other(path, st, _trusted(), trusted_who(_trusted()))
        if found or st.st_mode & 0o022:
            raise StateDirError(f"{found or f'{path} is writable by group or others'}: "
                                "refusing to read it")
        return f.read(MAX_STATE_BYTES)
