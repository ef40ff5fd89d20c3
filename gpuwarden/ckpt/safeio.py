"""Files under a spool that other users can write to, opened safely by root or by a job.

Every component is opened relative to its parent's descriptor with ``O_NOFOLLOW|O_DIRECTORY``,
so a link anywhere on the way is refused, not only at the end; every directory and file is
checked (``fstat`` of what was opened) for its type and owner before it is used; files are opened
``O_NONBLOCK``, so a FIFO or device planted in place of a file is refused instead of hanging the
reader. Removal never follows a link and never leaves the directory it starts from.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress

from gpuwarden.errors import GpuwardenError

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_LINKISH = (errno.ELOOP, errno.ENOTDIR, errno.EMLINK)


class Refused(GpuwardenError):
    """A path that is not what it must be: a link, another user's, not a directory or regular
    file, writable by others, or not the size expected. Nothing was read from it."""


def spool_problem(path: str, st: os.stat_result) -> str:
    """Why a spool (the directory holding every job's) cannot be used; "" when it can: a real
    directory of root's (or ours) and, if others may write to it, sticky, so that no other user
    can rename or delete a job's directory in it."""
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory (a link?): refusing it"
    if st.st_uid not in (0, os.geteuid()):
        return (f"{path} belongs to uid {st.st_uid}, not root: refusing it; an admin should "
                "recreate it as root, mode 1777")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return f"{path} is writable by others without the sticky bit: refusing it; chmod 1777 it"
    return ""


def open_spool(path: str) -> int:
    """A descriptor of the spool ``path`` (its last component never a link); FileNotFoundError
    when it is not there, Refused when it is not fit."""
    try:
        fd = os.open(path, DIR_FLAGS)
    except OSError as exc:
        if exc.errno in _LINKISH:
            raise Refused(f"{path} is not a directory (a link?): refusing it") from None
        raise
    problem = spool_problem(path, os.fstat(fd))
    if problem:
        os.close(fd)
        raise Refused(problem)
    return fd


def ensure_spool(path: str) -> int:
    """Root's: create the spool's last component (never briefly open: 0700, then 1777) or
    check it; its descriptor. Refused when it is not root's directory."""
    with suppress(FileExistsError):
        os.mkdir(path, 0o700)
    fd = open_spool(path)
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != 0o1777:
            os.fchmod(fd, 0o1777)
    except OSError:
        os.close(fd)
        raise
    return fd


def check_dir(where: str, st: os.stat_result, owner: int | None) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(f"{where} is not a directory (a link?)")
    if owner is not None and st.st_uid != owner:
        raise Refused(f"{where} belongs to uid {st.st_uid}, not to the job's user (uid {owner})")
    if st.st_mode & 0o022:
        raise Refused(f"{where} is writable by group or others: chmod go-w {where}")


def open_dir(parent: int, name: str, owner: int | None, where: str) -> tuple[int, os.stat_result]:
    """``name`` under the directory ``parent``, never through a link, owned by ``owner`` (None:
    anyone's) and writable by its owner alone. FileNotFoundError when absent."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in _LINKISH:
            raise Refused(f"{where} is not a directory (a link?)") from None
        raise
    try:
        st = os.fstat(fd)
        check_dir(where, st, owner)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


@contextmanager
def closing(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def walk(root: str, names: Sequence[str], owner: int | None) -> int:
    """A descriptor of ``root/names...``: the spool checked as a spool, each name below it
    as `open_dir` does."""
    fd = open_spool(root)
    where = root
    for name in names:
        where = os.path.join(where, name)
        try:
            child, _ = open_dir(fd, name, owner, where)
        finally:
            os.close(fd)
        fd = child
    return fd


def read_file(parent: int, name: str, owner: int | None, limit: int, where: str,
              exact: bool = False) -> bytearray:
    """The whole regular file ``name`` (at most ``limit`` bytes, exactly that many when
    ``exact``), checked before a byte is read; Refused when it is anything else."""
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EMLINK):
            raise Refused(f"{where}: not a regular file (a link?)") from None
        raise
    with closing(fd):
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{where}: not a regular file")
        if owner is not None and st.st_uid != owner:
            raise Refused(f"{where} belongs to uid {st.st_uid}, not to the job's user "
                          f"(uid {owner})")
        if st.st_size > limit or (exact and st.st_size != limit):
            raise Refused(f"{where}: {st.st_size} bytes, expected "
                          f"{'' if exact else 'at most '}{limit}")
        buf = bytearray(st.st_size)
        view = memoryview(buf)
        while view:
            n = os.readv(fd, [view])
            if n == 0:
                raise Refused(f"{where}: shorter than expected (changed while read)")
            view = view[n:]
        return buf


def lstat_at(parent: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return None


def remove_at(parent: int, name: str) -> bool:
    """Remove the entry ``name`` of ``parent`` and, if it is a directory, everything in it;
    a link is removed, never followed. False when it was not there."""
    st = lstat_at(parent, name)
    if st is None:
        return False
    if stat.S_ISDIR(st.st_mode):
        if not shutil.rmtree.avoids_symlink_attacks:  # pragma: no cover - Linux has it
            raise Refused(f"{name}: this platform cannot remove a tree without following links")
        shutil.rmtree(name, dir_fd=parent)  # fd-based on Linux: never follows links
    else:
        try:
            os.unlink(name, dir_fd=parent)
        except FileNotFoundError:
            return False
    return True
