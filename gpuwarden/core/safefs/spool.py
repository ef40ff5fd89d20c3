"""Files under a spool that other users can write to, opened safely by root or by a job.

Every component is opened relative to its parent's descriptor with ``O_NOFOLLOW|O_DIRECTORY``,
so a link anywhere on the way is refused, not only at the end; every directory and file is
checked (``fstat`` of what was opened) for its type and owner before it is used; files are opened
``O_NONBLOCK``, so a FIFO or device planted in place of a file is refused instead of hanging the
reader. Removal never follows a link and never leaves the directory it starts from.
"""

from __future__ import annotations

import errno
import mmap
import os
import resource
import secrets
import stat
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress

from gpuwarden.core.errors import GpuwardenError
from gpuwarden.core.safefs._checks import (
    DIR_FLAGS,
    FILE_FLAGS,
    not_a_directory,
    trusted_who,
    writable_by_others,
)
from gpuwarden.core.safefs._walk import Unsafe, walk_dir

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


def _spool_fd(path: str, create: bool) -> int:
    us = os.geteuid()
    try:
        fd = walk_dir(path, (us,), trusted_who((us,)), create=0o700 if create else None,
                      parents=False)
    except Unsafe as exc:
        raise Refused(f"{exc}: refusing the spool {path}") from None
    if fd is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    problem = spool_problem(path, os.fstat(fd))
    if problem:
        os.close(fd)
        raise Refused(problem)
    return fd


def open_spool(path: str) -> int:
    """A descriptor of the spool ``path``, reached from / by the one walk (_walk: the
    directories above root's or ours, writable by nobody else unless root's and sticky, a
    link on the way followed only when root's in a directory of root's; the last component
    never a link); FileNotFoundError when it is not there, Refused when it is not fit."""
    return _spool_fd(path, create=False)


def ensure_spool(path: str) -> int:
    """Root's: create the spool's last component (never briefly open: 0700, then 1777) or
    check it; its descriptor. Refused when it is not root's directory."""
    fd = _spool_fd(path, create=True)
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != 0o1777:
            os.fchmod(fd, 0o1777)
    except OSError:
        os.close(fd)
        raise
    return fd


def check_dir(where: str, st: os.stat_result, owner: int | None) -> None:
    found = not_a_directory(where, st)
    if found:
        raise Refused(found)
    if owner is not None and st.st_uid != owner:
        raise Refused(f"{where} belongs to uid {st.st_uid}, not to the job's user (uid {owner})")
    found = writable_by_others(where, st)
    if found:
        raise Refused(found)


def open_dir(parent: int, name: str, owner: int | None, where: str) -> tuple[int, os.stat_result]:
    """``name`` under the directory ``parent``, never through a link, owned by ``owner`` (None:
    anyone's) and writable by its owner alone. FileNotFoundError when absent."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in _LINKISH:
            raise Refused(f"{where} is not a directory (a link?)") from None
        st = lstat_at(parent, name) if exc.errno == errno.EACCES else None
        if st is not None:  # say whose it is, not only "Permission denied"
            check_dir(where, st, owner)
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


def _open_checked(parent: int, name: str, owner: int | None, where: str) -> tuple[int, int]:
    """The regular file ``name`` opened (no link, no FIFO wait) and its size; Refused when it is
    anything else or not ``owner``'s. The caller closes the fd."""
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EMLINK):
            raise Refused(f"{where}: not a regular file (a link?)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(f"{where}: not a regular file")
        if owner is not None and st.st_uid != owner:
            raise Refused(f"{where} belongs to uid {st.st_uid}, not to the job's user "
                          f"(uid {owner})")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_file(parent: int, name: str, owner: int | None, limit: int, where: str,
              exact: bool = False) -> bytearray:
    """The whole regular file ``name`` (at most ``limit`` bytes, exactly that many when
    ``exact``), checked before a byte is read; Refused when it is anything else."""
    fd, size = _open_checked(parent, name, owner, where)
    with closing(fd):
        if size > limit or (exact and size != limit):
            raise Refused(f"{where}: {size} bytes, expected "
                          f"{'' if exact else 'at most '}{limit}")
        return read_file_at(fd, size, where)


def read_file_at(fd: int, size: int, where: str) -> bytearray:
    """``size`` bytes of the open file ``fd`` (a small one: see `copy_file`)."""
    buf = bytearray(size)
    view = memoryview(buf)
    while view:
        n = os.readv(fd, [view])
        if n == 0:
            raise Refused(f"{where}: shorter than expected (changed while read)")
        view = view[n:]
    return buf


def copy_file(parent: int, name: str, owner: int | None, size: int, where: str,
              sink: Callable[[memoryview], None]) -> mmap.mmap | bytearray:
    """The regular file ``name`` of exactly ``size`` bytes, checked as `read_file` checks,
    copied into fresh memory of the caller's; each chunk also goes through ``sink`` right after
    it is read, while it is still in cache (the caller's checksum)."""
    fd, found = _open_checked(parent, name, owner, where)
    with closing(fd):
        if found != size:
            raise Refused(f"{where}: {found} bytes, expected {size}")
        if size < CHUNK:  # a tag or a tree: a buffer is enough, and compares equal to bytes
            small = read_file_at(fd, size, where)
            sink(memoryview(small))
            return small
        # Private anonymous memory, not bytearray(size): that takes 4 KiB faults on every
        # page (3-4x slower here); a private mapping can ask for huge pages, as numpy does for
        # its large arrays. (mmap's default, MAP_SHARED, would be shmem: 4 KiB pages again.)
        buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with suppress(AttributeError, OSError):
            buf.madvise(mmap.MADV_HUGEPAGE)
        view, at = memoryview(buf), 0
        try:
            while at < size:
                n = os.readv(fd, [view[at:min(size, at + CHUNK)]])
                if n == 0:
                    raise Refused(f"{where}: shorter than expected (changed while read)")
                sink(view[at:at + n])
                at += n
            if os.read(fd, 1):
                raise Refused(f"{where}: longer than expected (changed while read)")
        except BaseException:
            # A sink's frame may still hold a view of the buffer: the buffer then goes with
            # the last view, and the error raised is the sink's, not close()'s BufferError.
            with suppress(BufferError):
                view.release()
                buf.close()
            raise
        view.release()
        return buf


# Before Python 3.13, every mmap of a file keeps a duplicate of its fd for as long as the
# mapping lives (see `mappable`); 3.13's trackfd=False keeps none.
_NO_FD: dict[str, bool] = {"trackfd": False} if sys.version_info >= (3, 13) else {}


def mappable(files: int) -> bool:
    """Whether ``files`` more mappings fit in the open-file limit, with room to spare for the
    job's own files and sockets; a step of more shards is copied instead."""
    if _NO_FD:
        return True
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft == resource.RLIM_INFINITY or files <= soft // 4


def map_file(parent: int, name: str, owner: int | None, size: int, where: str,
             sink: Callable[[memoryview], None]) -> mmap.mmap | bytearray:
    """The regular file ``name`` of exactly ``size`` bytes, checked as `read_file` checks,
    mapped copy-on-write instead of copied: for node memory (tmpfs), where the pages are in
    memory already. The mapping is the caller's: writes to it never reach the file, and it
    stays valid after the file is unlinked (retention pruning tier 0).

    The file's bytes also go through ``sink`` (as `stream_file` feeds it), read from the same
    open file: the caller verifies them without touching the mapping, whose pages are then
    mapped one by one only where the caller uses them (4 KiB page faults on tmpfs cost more
    than copying the bytes)."""
    fd, found = _open_checked(parent, name, owner, where)
    with closing(fd):
        if found != size:
            raise Refused(f"{where}: {found} bytes, expected {size}")
        if size == 0:
            return bytearray()
        # No MAP_POPULATE: on a writable private mapping it would copy every page up front.
        # Read faults map tmpfs's own pages; only a page the caller writes is copied.
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE, **_NO_FD)
        try:
            _stream(fd, size, where, sink)
        except BaseException:
            mapping.close()
            raise
        return mapping


CHUNK = 1 << 20  # what a streamed read holds in memory at once


def stream_file(parent: int, name: str, owner: int | None, size: int, where: str,
                sink: Callable[[memoryview], None]) -> None:
    """Feed the regular file ``name`` of exactly ``size`` bytes to ``sink`` in chunks of at
    most `CHUNK`, checked as `read_file` checks before a byte is read. Memory stays bounded
    whatever size a (user's) manifest declares: root's verify never allocates it."""
    fd, found = _open_checked(parent, name, owner, where)
    with closing(fd):
        if found != size:
            raise Refused(f"{where}: {found} bytes, expected {size}")
        _stream(fd, size, where, sink)


def _stream(fd: int, size: int, where: str, sink: Callable[[memoryview], None]) -> None:
    # One buffer, reused: it stays in cache, so the sink reads what read() just wrote there.
    buf = bytearray(min(size, CHUNK))
    view, left = memoryview(buf), size
    while left:
        n = os.readv(fd, [view[:min(left, len(buf))]])
        if n == 0:
            raise Refused(f"{where}: shorter than expected (changed while read)")
        sink(view[:n])
        left -= n
    if os.read(fd, 1):
        raise Refused(f"{where}: longer than expected (changed while read)")


def lstat_at(parent: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return None


# Bounds on one removal (root's epilog and gc): a user can make a tree as deep or as wide as
# they like, and root must neither recurse (RecursionError), run out of descriptors, nor spin
# past the epilog's time limit on it.
MAX_OPEN = 32  # directory descriptors held at once while descending
MAX_ENTRIES = 1_000_000  # entries removed by one call
REMOVE_S = 60.0  # seconds one call may take


def remove_at(parent: int, name: str, max_entries: int = MAX_ENTRIES,
              deadline_s: float = REMOVE_S) -> bool:
    """Remove the entry ``name`` of ``parent`` and, if it is a directory, everything in it;
    a link is removed, never followed. False when it was not there.

    Iterative and descriptor-based: no recursion, at most `MAX_OPEN` descriptors (a deeper
    subtree is renamed up into the top directory being removed, never out of it), and at most
    ``max_entries`` entries or ``deadline_s`` seconds; past either it raises Refused naming
    what was left."""
    st = lstat_at(parent, name)
    if st is None:
        return False
    if not stat.S_ISDIR(st.st_mode):
        try:
            os.unlink(name, dir_fd=parent)
        except FileNotFoundError:
            return False
        return True
    try:
        top = os.open(name, DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno not in _LINKISH:
            raise
        # Swapped for a link or file since the lstat: remove the entry itself, never follow it.
        with suppress(FileNotFoundError):
            os.unlink(name, dir_fd=parent)
        return True
    with closing(top):
        _empty_tree(top, name, max_entries, time.monotonic() + deadline_s)
    with suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=parent)
    return True


def _empty_tree(top: int, shown: str, max_entries: int, deadline: float) -> None:
    """Remove everything below the directory ``top``. A stack of (descriptor, name in its
    parent, names still to look at); the top's descriptor is owned by the caller."""
    stack: list[tuple[int, str, list[str]]] = [(top, "", os.listdir(top))]
    done = 0
    try:
        while stack:
            fd, _, todo = stack[-1]
            if not todo:
                todo.extend(os.listdir(fd))  # anything added meanwhile (or hoisted up)
                if todo:
                    continue
                if len(stack) == 1:
                    return
                _, here, _ = stack.pop()
                os.close(fd)
                with suppress(FileNotFoundError):
                    os.rmdir(here, dir_fd=stack[-1][0])
                continue
            done += 1
            if done > max_entries or time.monotonic() > deadline:
                raise Refused(f"{shown}: more than {min(done, max_entries)} entries or "
                              "too long to remove: the rest is left in place")
            name = todo.pop()
            child = _remove_entry(fd, name, top, len(stack) >= MAX_OPEN)
            if child is not None:
                stack.append((child, name, os.listdir(child)))
    finally:
        for fd, _, _ in stack[1:]:
            os.close(fd)


def _remove_entry(fd: int, name: str, top: int, too_deep: bool) -> int | None:
    """Remove ``name`` of ``fd`` if it is a file, a link or an empty directory; a descriptor
    of it when it is a directory with something in it (to descend into), else None."""
    st = lstat_at(fd, name)
    if st is not None and not stat.S_ISDIR(st.st_mode):
        with suppress(FileNotFoundError):
            os.unlink(name, dir_fd=fd)
    elif st is not None and not _rmdir_if_empty(fd, name):
        if too_deep:
            # Too deep to hold every level open: move the subtree up into the top directory
            # (still inside what is being removed); the top lists itself again later.
            _hoist(fd, name, top)
            return None
        try:
            return os.open(name, DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno not in _LINKISH:
                raise
            with suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)  # swapped for a link meanwhile: the link goes
    return None


def _rmdir_if_empty(fd: int, name: str) -> bool:
    """True when ``name`` is gone (removed, or not there); False when it holds something."""
    try:
        os.rmdir(name, dir_fd=fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        return False
    return True


def _hoist(fd: int, name: str, top: int) -> None:
    for _ in range(100):
        try:
            os.rename(name, f".gw-rm.{secrets.token_hex(8)}", src_dir_fd=fd, dst_dir_fd=top)
            return
        except FileExistsError:
            continue
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:  # a non-empty directory of that name: try another
                raise
    raise Refused(f"no free name to move {name} up while removing it")
