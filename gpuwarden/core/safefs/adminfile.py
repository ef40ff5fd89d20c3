"""The snapshot's file and directory: written and read only where no user can steer them.

job_submit.lua runs inside slurmctld and trusts the snapshot, so the daemon writes it only into
a real directory that root (or we) own and no one else can write, and refuses a file there that
someone else could have written. The filter makes the same checks in Lua (plugins/job_submit.lua,
with lua-filesystem); `placement explain` reports them.
"""

from __future__ import annotations

import errno
import logging
import os
import stat

from gpuwarden.core.errors import GpuwardenError
from gpuwarden.core.safefs._checks import dir_problem, open_file_at, owned_by_other
from gpuwarden.core.safefs._walk import Unsafe, walk_dir
from gpuwarden.core.safefs.atomic import write_at

log = logging.getLogger(__name__)


class UnsafePathError(GpuwardenError):
    """The snapshot's directory or file could be written by someone other than root or us."""


def _trusted() -> tuple[int, ...]:
    return (0, os.geteuid())


_WHO = "root or us"


def _open_dir(directory: str) -> int:
    """A descriptor of ``directory``, reached from / by the one walk (see _walk), when the
    filter may trust files in it; UnsafePathError (a bare reason) when not, FileNotFoundError
    when it is absent."""
    try:
        fd = walk_dir(directory, _trusted(), _WHO)
    except Unsafe as exc:
        raise UnsafePathError(str(exc)) from None
    if fd is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), directory)
    found = dir_problem(directory, os.fstat(fd), _trusted(), _WHO)
    if found:
        os.close(fd)
        raise UnsafePathError(found)
    return fd


def _file_problem(path: str, st: os.stat_result) -> str:
    """Why a file (lstat ``st``) is not one only root or we could have written; "" when it is."""
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file (a link, FIFO or directory?)"
    found = owned_by_other(path, st, _trusted(), _WHO)
    if found:
        return found
    if st.st_mode & 0o022:
        return f"{path} is writable by group or others (mode {st.st_mode & 0o7777:o})"
    return ""


def admin_file_problem(path: str) -> str:
    """What the filter would refuse about ``path`` and its directory; "" when nothing."""
    directory, name = os.path.split(path)
    try:
        fd = _open_dir(directory or ".")
    except UnsafePathError as exc:
        return str(exc)
    except OSError as exc:
        return f"{directory}: cannot open ({exc.strerror})"
    try:
        return _file_problem(path, os.stat(name, dir_fd=fd, follow_symlinks=False))
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as exc:
        return f"{path}: cannot stat ({exc.strerror})"
    finally:
        os.close(fd)


def write_admin_file(path: str, data: bytes) -> None:
    """Replace ``path`` atomically (0644), refusing an unsafe directory (UnsafePathError)."""
    directory, name = os.path.split(path)
    try:
        fd = _open_dir(directory or ".")
    except UnsafePathError as exc:
        raise UnsafePathError(f"{exc}: refusing to write the placement snapshot there "
                              "(job_submit.lua would trust whoever can write it)") from None
    try:
        try:
            old = _file_problem(path, os.stat(name, dir_fd=fd, follow_symlinks=False))
        except FileNotFoundError:
            old = ""
        if old:
            # Someone else wrote or loosened it; replacing it (a new inode, ours, 0644) undoes
            # that.
            log.error("%s: replacing it with the daemon's own snapshot; find out who wrote it",
                      old)
        write_at(fd, name, data, mode=0o644)
    finally:
        os.close(fd)


def read_head(path: str, size: int) -> bytes:
    """Up to ``size`` bytes of a regular file only root or we could have written, in a
    directory the filter may trust: never through a link, never blocking on a FIFO. OSError
    when it cannot be read (ELOOP: a link); UnsafePathError when it must not be trusted."""
    directory, name = os.path.split(path)
    dfd = _open_dir(directory or ".")
    try:
        fd = open_file_at(dfd, name, path)
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError(0, "not a regular file", path)
        found = _file_problem(path, st)
        if found:
            raise UnsafePathError(f"{found}: refusing to read it")
        return fh.read(size)
