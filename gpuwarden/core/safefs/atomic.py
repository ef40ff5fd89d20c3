"""Root's own state and metrics files: a private directory made or vetted, files replaced
atomically (complete or absent, never written through a link), small files read back.

Moved out of gpuwarden.health.store, whose verdict store is built on them; the lemon list, the
prolog's settings, install-files and `health inject` write with them too."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat

from gpuwarden.core.safefs._checks import FILE_FLAGS
from gpuwarden.core.safefs.privfile import MAX_STATE_BYTES, StateDirError, unsafe_dir_problem


def ensure_private_dir(path: str) -> None:
    """Create ``path`` 0700, or accept it only if it is a real directory we alone can write."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    problem = unsafe_dir_problem(path, os.lstat(path))
    if problem:
        raise StateDirError(f"{problem}: refusing to use it")


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
    """`write_at` in the directory at ``directory``."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        write_at(dfd, name, data, mode)
    finally:
        os.close(dfd)


def discard(directory: str, name: str) -> None:
    """Remove ``name`` (a link itself, never its target) if it is there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(directory, name))


def read_plain(path: str) -> bytes:
    """A small regular file's bytes (b"" when absent or not a regular file); never a link."""
    try:
        fd = os.open(path, FILE_FLAGS)
    except OSError:
        return b""
    with os.fdopen(fd, "rb") as f:
        return f.read(MAX_STATE_BYTES) if stat.S_ISREG(os.fstat(f.fileno()).st_mode) else b""
