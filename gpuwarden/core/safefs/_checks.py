"""The checks every safefs module makes, spelled once: how a path is opened (never through a
link, never waiting on a FIFO) and why a directory must not be trusted.

Imports only os and stat: the prolog's fast gate reaches it through privfile."""

from __future__ import annotations

import os
import stat

# Python adds O_CLOEXEC to every os.open on Linux anyway; named so that the flags read whole.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def not_a_directory(path: str, st: os.stat_result) -> str:
    """"" when ``st`` (an lstat or fstat) is a directory's; else why not, in one wording."""
    if stat.S_ISDIR(st.st_mode):
        return ""
    return f"{path} is not a directory (a link?)"


def owned_by_other(path: str, st: os.stat_result, owners: tuple[int, ...], who: str) -> str:
    """"" when ``path`` is owned by one of ``owners`` (named ``who`` in the message)."""
    if st.st_uid in owners:
        return ""
    return f"{path} is owned by uid {st.st_uid}, not by {who}"


def writable_by_others(path: str, st: os.stat_result, sticky_ok: bool = False) -> str:
    """"" unless group or others may write ``path`` (when ``sticky_ok``: and may also rename or
    remove what its owner put there, i.e. it is not sticky)."""
    if not st.st_mode & 0o022 or (sticky_ok and st.st_mode & stat.S_ISVTX):
        return ""
    return f"{path} is writable by group or others: chmod go-w {path}"


def dir_problem(path: str, st: os.stat_result, owners: tuple[int, ...], who: str) -> str:
    """Why ``path`` (its lstat ``st``) is not a real directory that only ``owners`` can write;
    "" when it is. A planted link or a directory others can write would let users steer root."""
    return (not_a_directory(path, st) or owned_by_other(path, st, owners, who)
            or writable_by_others(path, st))


def open_file_at(dir_fd: int | None, name: str, path: str) -> int:
    """``name`` in the directory ``dir_fd`` (None: a path) opened with `FILE_FLAGS`; an OSError
    (ELOOP: a link) names ``path``, not the bare name the directory holds."""
    try:
        return os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.filename == path:
            raise
        raise OSError(exc.errno, exc.strerror, path) from None


def trusted_who(owners: tuple[int, ...]) -> str:
    """How a message names root and ``owners``."""
    others = [str(uid) for uid in owners if uid != 0]
    return f"root or uid {', '.join(others)}" if others else "root"
