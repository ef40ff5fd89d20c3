"""Reading root's own state files safely, importing only os and stat.

Shared by the verdict store and the prolog's fast gate, which must start in a few milliseconds:
a file is read only from a directory we own that nobody else can write, reached from / by the
one walk (_walk: no link on the way but root's, every directory above root's or ours), never
through a link, never blocking on a FIFO, and only when it is a regular file.
"""

from __future__ import annotations

import os
import stat

from gpuwarden.core.errors import GpuwardenError
from gpuwarden.core.safefs._checks import dir_problem, open_file_at, trusted_who
from gpuwarden.core.safefs._walk import Unsafe, walk_dir

MAX_STATE_BYTES = 1 << 20


class StateDirError(GpuwardenError):
    pass


def unsafe_dir_problem(path: str, st: os.stat_result) -> str:
    """Why ``path`` (lstat ``st``) is not a directory for root's state alone; "" when it is.

    A planted symlink or a directory others can write would let users steer root."""
    return dir_problem(path, st, (os.geteuid(),), "us")


def open_private_dir(path: str, refusing: str, create: int | None = None) -> int | None:
    """A descriptor of the directory ``path``, ours alone, reached from / by the one walk
    (``create``: made with that mode, and any missing above it 0755); None when absent.
    Raises StateDirError, its message ending in ``refusing``, when it or the way to it is not
    safe."""
    us = os.geteuid()
    try:
        fd = walk_dir(path, (us,), trusted_who((us,)), create)
    except Unsafe as exc:
        raise StateDirError(f"{path} is not a private directory of ours ({exc}): "
                            f"{refusing}") from None
    if fd is None:
        return None
    problem = unsafe_dir_problem(path, os.fstat(fd))
    if problem:
        os.close(fd)
        raise StateDirError(f"{path} is not a private directory of ours ({problem}): "
                            f"{refusing}")
    return fd


def check_private_dir(path: str) -> bool:
    """False when absent; raises when present but not ours alone, or reached through a way
    someone else could change."""
    fd = open_private_dir(path, "refusing to read it")
    if fd is None:
        return False
    os.close(fd)
    return True


def read_private(path: str) -> bytes | None:
    """A regular file's bytes, never through a link and never blocking on a FIFO; None when
    it or its directory is absent. Raises StateDirError when either is not ours alone (or the
    way to them is not safe: see _walk)."""
    directory, name = os.path.split(path)
    fd = open_private_dir(directory or ".", "refusing to read it")
    if fd is None:
        return None
    try:
        return read_own_at(fd, name, path)
    finally:
        os.close(fd)


def read_own_at(dir_fd: int | None, name: str, path: str,
                limit: int = MAX_STATE_BYTES) -> bytes | None:
    """At most ``limit`` bytes of the regular file ``name`` (in ``dir_fd``; None: a path), ours
    alone, never through a link and never blocking on a FIFO; None when absent. Raises
    StateDirError (``path`` names it) when it is anything else; OSError when it cannot be
    opened (ELOOP: a link)."""
    try:
        fd = open_file_at(dir_fd, name, path)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise StateDirError(f"{path} is not a regular file: refusing to read it")
        # Ours alone, like its directory: what we read here only we may have written (the
        # prolog's fast path unmarshals it).
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise StateDirError(f"{path} is owned by uid {st.st_uid}, mode "
                                f"{stat.S_IMODE(st.st_mode):o}: not ours alone, refusing to read it")
        return f.read(limit)
