"""Writing root's files where no user can steer the writes: directories reached from / by the
one walk (_walk: one component at a time, a link followed only when root's in a directory of
root's), and written only when nobody else can write them.

The hooks these files become run as root on every node, so a directory another user could
write (or a link they planted) would let that user choose what root runs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

from gpuwarden.core.errors import InstallError
from gpuwarden.core.safefs._checks import (
    dir_problem,
    open_file_at,
    owned_by_other,
    trusted_who,
    writable_by_others,
)
from gpuwarden.core.safefs._walk import Unsafe, walk_dir

MAX_EXISTING_BYTES = 16 << 20


def _dir_problem(path: str, st: os.stat_result, owner: int) -> str:
    """A directory we write in: ours alone."""
    found = owned_by_other(path, st, (owner,), f"uid {owner} (who installs)")
    if found:
        # Run as someone else, the hooks' own files would be that user's: root's hooks must
        # be written by root.
        fix = "run install-files as root" if owner != 0 else f"chown root {path}"
        return f"{found}: {fix}"
    return writable_by_others(path, st)


@contextlib.contextmanager
def opened_dir(path: str, owner: int, create: bool) -> Iterator[int | None]:
    """An fd of directory ``path`` (absolute, plain), or None when it is missing and ``create``
    is false. Missing components are made 0755 when ``create``. Reached from / by the one walk
    (_walk: a link on the way followed only when root's, in a directory of root's). Raises
    InstallError for a link, a non-directory, or a directory someone other than root or
    ``owner`` could change."""
    try:
        fd = walk_dir(path, (owner,), trusted_who((owner,)), create=0o755 if create else None)
    except Unsafe as exc:
        raise InstallError(f"refusing to install into {path}: {exc} (pick a place whose "
                           "directories only root can change; give its real path, "
                           "readlink -f)") from None
    if fd is None:
        yield None
        return
    try:
        problem = _dir_problem(path, os.fstat(fd), owner)
        if problem:
            raise InstallError(f"refusing to install into {path}: {problem}")
        yield fd
    finally:
        os.close(fd)


def _open_existing(dir_fd: int, name: str, shown: str) -> int | None:
    try:
        return open_file_at(dir_fd, name, shown)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InstallError(f"{shown} is a symbolic link: remove it, then rerun") from exc
        raise


def read_existing(dir_fd: int | None, name: str, shown: str,
                  owner: int | None = None) -> tuple[bytes, os.stat_result] | None:
    """A regular file's bytes and status, never through a link or from a FIFO; None if absent.
    Refused (InstallError) unless it is root's or ``owner``'s (None: ours): what install-files
    compares, only who installs may have written."""
    if dir_fd is None:
        return None
    fd = _open_existing(dir_fd, name, shown)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise InstallError(f"{shown} is not a regular file: remove it, then rerun")
        owners = (0, os.geteuid() if owner is None else owner)
        found = owned_by_other(shown, st, owners, trusted_who(owners))
        if found:
            raise InstallError(f"{found}: remove it (or chown it), then rerun")
        if st.st_size > MAX_EXISTING_BYTES:
            raise InstallError(f"{shown} is larger than any file gpuwarden ships: remove it, "
                               "then rerun")
        return f.read(MAX_EXISTING_BYTES), st


def already_installed(existing: tuple[bytes, os.stat_result] | None, data: bytes, mode: int,
                      owner: int) -> bool:
    """Whether the file `read_existing` found is ``data`` already, with that mode and owner."""
    if existing is None:
        return False
    old, st = existing
    return old == data and stat.S_IMODE(st.st_mode) == mode and st.st_uid == owner


def read_source(root: str, rel: str, owner: int | None = None) -> bytes:
    """A shipped file from the installed package: a regular file, never through a link, root's
    or ``owner``'s (None: ours) in a directory nobody else can write, reached from / by the one
    walk (install.trust vets the whole tree first; this holds for what is actually read)."""
    path = os.path.join(root, rel)
    owners = (0, os.geteuid() if owner is None else owner)
    who = trusted_who(owners)
    fix = "this gpuwarden install is incomplete or unsafe; reinstall it (pip install " \
          "--force-reinstall) where only root (or who installs) can change it"
    directory, name = os.path.split(path)
    try:
        dfd = walk_dir(directory, owners, who)
    except Unsafe as exc:
        raise InstallError(f"cannot read {path} ({exc}): {fix}") from None
    except OSError as exc:
        raise InstallError(f"cannot read {path} ({exc.strerror}): {fix}") from exc
    if dfd is None:
        raise InstallError(f"cannot read {path} (a directory is missing): {fix}")
    try:
        found = dir_problem(directory, os.fstat(dfd), owners, who)
        if found:
            raise InstallError(f"cannot read {path} ({found}): {fix}")
        try:
            fd = open_file_at(dfd, name, path)
        except OSError as exc:
            raise InstallError(f"cannot read {path} ({exc.strerror}): {fix}") from exc
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise InstallError(f"{path} is not a regular file: reinstall gpuwarden")
        found = owned_by_other(path, st, owners, who)
        if found or st.st_mode & 0o022:
            raise InstallError(f"cannot read {path} "
                               f"({found or 'writable by group or others'}): {fix}")
        return f.read()
