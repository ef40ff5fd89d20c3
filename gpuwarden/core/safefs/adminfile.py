"""The snapshot's file and directory: written and read only where no user can steer them.

job_submit.lua runs inside slurmctld and trusts the snapshot, so the daemon writes it only into
a real directory that root (or we) own and no one else can write, and refuses a file there that
someone else could have written. The filter makes the same checks in Lua (plugins/job_submit.lua,
with lua-filesystem); `placement explain` reports them.
"""

from __future__ import annotations

import logging
import os
import stat

from gpuwarden.core.errors import GpuwardenError
from gpuwarden.core.safefs._checks import FILE_FLAGS, dir_problem, owned_by_other
from gpuwarden.core.safefs.atomic import atomic_write

log = logging.getLogger(__name__)


class UnsafePathError(GpuwardenError):
    """The snapshot's directory or file could be written by someone other than root or us."""


def _trusted() -> tuple[int, ...]:
    return (0, os.geteuid())


_WHO = "root or us"


def _dir_problem(directory: str) -> str:
    """Why the filter must not trust files in ``directory``; "" when it may."""
    try:
        st = os.lstat(directory)
    except OSError as exc:
        return f"{directory}: cannot stat ({exc.strerror})"
    return dir_problem(directory, st, _trusted(), _WHO)


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
    found = _dir_problem(os.path.dirname(path) or ".")
    if found:
        return found
    try:
        return _file_problem(path, os.lstat(path))
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as exc:
        return f"{path}: cannot stat ({exc.strerror})"


def write_admin_file(path: str, data: bytes) -> None:
    """Replace ``path`` atomically (0644), refusing an unsafe directory (UnsafePathError)."""
    directory, name = os.path.split(path)
    found = _dir_problem(directory)
    if found:
        raise UnsafePathError(f"{found}: refusing to write the placement snapshot there "
                              "(job_submit.lua would trust whoever can write it)")
    try:
        old = _file_problem(path, os.lstat(path))
    except FileNotFoundError:
        old = ""
    if old:
        # Someone else wrote or loosened it; replacing it (a new inode, ours, 0644) undoes that.
        log.error("%s: replacing it with the daemon's own snapshot; find out who wrote it", old)
    atomic_write(directory, name, data, mode=0o644)


def read_head(path: str, size: int) -> bytes:
    """Up to ``size`` bytes of a regular file: never through a link, never blocking on a FIFO."""
    fd = os.open(path, FILE_FLAGS)
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            raise OSError(0, "not a regular file")
        return fh.read(size)
