"""Writing root's files where no user can steer the writes: directories opened one component at
a time without following links, and written only when nobody else can write them.

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
from gpuwarden.core.safefs._checks import DIR_FLAGS, FILE_FLAGS, owned_by_other, writable_by_others

MAX_EXISTING_BYTES = 16 << 20


def _ancestor_problem(path: str, st: os.stat_result, owner: int) -> str:
    """A directory above the one we write in: whoever could rename its entries could swap ours."""
    found = owned_by_other(path, st, (0, owner), "root" if owner == 0 else f"root or uid {owner}")
    if found:
        return (f"{found}: chown root {path}, or pick a place whose directories only root can "
                "change")
    return writable_by_others(path, st, sticky_ok=True)


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
    is false. Missing components are made 0755 when ``create``. Raises InstallError for a
    link, a non-directory, or a directory someone other than root or ``owner`` could change."""
    fd = os.open("/", DIR_FLAGS)
    shown = ""
    try:
        parts = [p for p in path.split("/") if p]
        for i, name in enumerate(parts):
            st = os.fstat(fd)
            problem = _ancestor_problem(shown or "/", st, owner)
            if problem:
                raise InstallError(f"refusing to install below {shown or '/'}: {problem}")
            shown = f"{shown}/{name}"
            try:
                nxt = os.open(name, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    os.close(fd)
                    fd = -1
                    yield None
                    return
                os.mkdir(name, 0o755, dir_fd=fd)
                nxt = os.open(name, DIR_FLAGS, dir_fd=fd)
                # The umask may have taken r-x from others: job users must read the kit.
                os.fchmod(nxt, 0o755)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise InstallError(f"{shown} is a symbolic link or not a directory: give "
                                       "the real path of a directory (readlink -f)") from exc
                raise
            os.close(fd)
            fd = nxt
            if i == len(parts) - 1:
                problem = _dir_problem(shown, os.fstat(fd), owner)
                if problem:
                    raise InstallError(f"refusing to install into {shown}: {problem}")
        yield fd
    finally:
        if fd >= 0:
            os.close(fd)


def read_existing(dir_fd: int | None, name: str, shown: str) -> tuple[bytes, os.stat_result] | None:
    """A regular file's bytes and status, never through a link or from a FIFO; None if absent."""
    if dir_fd is None:
        return None
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise InstallError(f"{shown} is a symbolic link: remove it, then rerun") from exc
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise InstallError(f"{shown} is not a regular file: remove it, then rerun")
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


def read_source(root: str, rel: str) -> bytes:
    """A shipped file from the installed package: a regular file, never through a link."""
    path = os.path.join(root, rel)
    try:
        fd = os.open(path, FILE_FLAGS)
    except OSError as exc:
        raise InstallError(f"cannot read {path} ({exc.strerror}): this gpuwarden install is "
                           "incomplete; reinstall it (pip install --force-reinstall)") from exc
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise InstallError(f"{path} is not a regular file: reinstall gpuwarden")
        return f.read()
