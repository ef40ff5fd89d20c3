"""The one walk from / to a directory root uses: every component opened by its parent's
descriptor (``O_DIRECTORY|O_NOFOLLOW``), every directory a name is looked up in checked, and a
link on the way followed only when nobody but root can have made or changed it.

The checks on the way (`ancestor_problem`): a directory above the one used must be root's, the
expected owner's (the caller's ``owners``) or a system account's (`system_account`), and
writable by nobody else, except a sticky
directory of root's (/tmp, /dev/shm: others can add entries there but never rename or remove
ours). A link on the way is followed (the hooks' rule in gpuwarden_pystart.py: hop by hop, at
most `MAX_HOPS`) only when it is root's and sits in a directory of root's that nobody else can
write: /var/run -> /run, /lib -> usr/lib, /etc/alternatives/*. Anything else is refused with
a message naming the path and what is wrong. The last component is never followed: each entry
point vets the directory it is given (its own owner and mode rule) from the returned fstat.

Imports only os, stat and errno: the prolog's fast gate reaches it through privfile.
"""

from __future__ import annotations

import errno
import os
import stat

from gpuwarden.core.safefs._checks import DIR_FLAGS, owned_by_other

MAX_HOPS = 40  # as the kernel's ELOOP limit
DIR_MODE = 0o755  # a directory made on the way: others may look up names in it, never write


class Unsafe(Exception):
    """Why the walk stopped (the message names the path); each entry point re-raises it as its
    own error, in its own words."""


def ancestor_problem(path: str, st: os.stat_result, owners: tuple[int, ...], who: str) -> str:
    """Why a directory a name is looked up in could let someone else swap what is below it;
    "" when it cannot. Root and ``owners`` (named ``who``) may own it; others may write it only
    when it is root's and sticky."""
    found = owned_by_other(path, st, (0, *owners), who)
    if found and not system_account(st.st_uid):
        return (f"{found} or a system account (uid below {uid_min()}), as a directory above one "
                f"root uses must be: chown root {path}, or choose a path whose parents are root's")
    if st.st_mode & 0o022 and not (st.st_mode & stat.S_ISVTX and st.st_uid == 0):
        sticky = " (sticky, but not root's)" if st.st_mode & stat.S_ISVTX else ""
        return f"{path} is writable by group or others{sticky}: chmod go-w {path}"
    return ""


_UID_MIN: list[int] = []


def uid_min() -> int:
    """The first uid of a person's account (login.defs UID_MIN, 1000 where it does not say);
    read once, and only when a directory on the way is not root's (never on the fast path)."""
    if not _UID_MIN:
        value = 1000
        try:
            fd = os.open("/etc/login.defs", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                text = os.read(fd, 1 << 16).decode("utf-8", "replace")
            finally:
                os.close(fd)
            for line in text.splitlines():
                words = line.split()
                if len(words) >= 2 and words[0] == "UID_MIN" and words[1].isdigit():
                    value = int(words[1])
        except OSError:
            pass
        _UID_MIN.append(value)
    return _UID_MIN[0]


def system_account(uid: int) -> bool:
    """A service's account (Debian's prometheus, whose home /var/lib/prometheus holds
    node_exporter's textfile directory): no person logs in as it. One may own a directory
    above: it can move the directories below, never make one of root's, and the directory
    used is vetted from its own descriptor. nobody (65534) is not one: NFS maps squashed
    root and others to it."""
    return 0 < uid < min(uid_min(), 65534)


def _join(shown: list[str]) -> str:
    return "/" + "/".join(shown)


def _hop(fd: int, name: str, here: str) -> str:
    """The target of the link ``name`` in the (vetted) directory ``fd`` at ``here``, when root
    alone can have made it there; else Unsafe (also for a name that is not a directory)."""
    path = os.path.join(here, name)
    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        raise Unsafe(f"{path} is not a directory")
    parent = os.fstat(fd)
    if st.st_uid != 0:
        raise Unsafe(f"{path} is a symbolic link of uid {st.st_uid}: refusing to follow it "
                     "(only root's links in root's directories are followed; give the real "
                     "path, readlink -f)")
    if parent.st_uid != 0 or parent.st_mode & 0o022:
        raise Unsafe(f"{path} is a symbolic link in {here}, which someone other than root can "
                     "change: refusing to follow it (give the real path, readlink -f)")
    return os.readlink(name, dir_fd=fd)


def _made(fd: int, name: str, mode: int) -> int:
    """Create ``name`` in ``fd`` (exactly ``mode``, whatever the umask) and open it."""
    try:  # noqa: SIM105 - contextlib costs the prolog's fast gate its import
        os.mkdir(name, 0o700, dir_fd=fd)  # 0700 until the chmod: never briefly wider
    except FileExistsError:
        pass  # made meanwhile: opened and vetted as if it had been there
    nxt = os.open(name, DIR_FLAGS, dir_fd=fd)
    try:
        if os.fstat(nxt).st_uid == os.geteuid():
            os.fchmod(nxt, mode)
    except BaseException:
        os.close(nxt)
        raise
    return nxt


def _next(fd: int, name: str, here: str, last: str, make: int | None) -> int | str | None:
    """One step: the directory ``name`` in ``fd`` opened (made with mode ``make`` when missing
    and ``make`` is set), the target of a link to follow, or None when it is missing. ``last``:
    the path when ``name`` is its last component (never followed), else ""."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        return None if make is None else _made(fd, name, make)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        if last:  # the directory the caller named: never a link
            raise Unsafe(_not_a_directory(fd, name, last)) from None
        return _hop(fd, name, here)


def _not_a_directory(fd: int, name: str, path: str) -> str:
    """Why ``name`` in ``fd`` could not be opened as a directory (O_NOFOLLOW|O_DIRECTORY on a
    link fails with ENOTDIR, as on a file: lstat tells them apart)."""
    try:
        link = stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        link = False
    if link:
        return (f"{path} is a symbolic link, not a directory (a link there is never followed: "
                "give the real path, readlink -f)")
    return f"{path} is not a directory (a link?)"


def walk_dir(path: str, owners: tuple[int, ...], who: str,
             create: int | None = None, parents: bool = True) -> int | None:
    """A descriptor of the directory ``path`` (made absolute), reached from / as the module
    says; None when a component is missing and ``create`` is None, else the missing ones are
    made (``create`` the last one's mode, `DIR_MODE` those above; with ``parents`` false only
    the last one: None when one above is missing). The last component itself is opened, never
    followed (a link there: Unsafe "is a symbolic link, not a directory"), and left to the caller to
    vet. Raises Unsafe, or OSError for anything but a refusal (EACCES, EIO)."""
    full = os.path.abspath(path)  # the last component is always the path's own
    todo = [p for p in reversed(full.split("/")) if p]
    above = DIR_MODE if create is not None and parents else None
    fd = os.open("/", DIR_FLAGS)
    shown: list[str] = []
    hops = 0
    try:
        while todo:
            name = todo.pop()
            here = _join(shown)
            found = ancestor_problem(here, os.fstat(fd), owners, who)
            if found:
                raise Unsafe(found)
            if name == ".":  # only from a link's target (abspath took the path's own)
                continue
            nxt = (os.open("..", DIR_FLAGS, dir_fd=fd) if name == ".."
                   else _next(fd, name, here, "" if todo else full, above if todo else create))
            if nxt is None:
                return None
            if isinstance(nxt, str):  # a link of root's: its target, then what was left
                hops += 1
                if hops > MAX_HOPS:
                    raise Unsafe(f"{full}: too many levels of symbolic links")
                todo.extend(p for p in reversed(nxt.split("/")) if p)
                if not nxt.startswith("/"):
                    continue
                nxt, shown = os.open("/", DIR_FLAGS), []
            elif name == "..":
                del shown[-1:]
            else:
                shown.append(name)
            os.close(fd)
            fd = nxt
        result, fd = fd, -1
        return result
    finally:
        if fd >= 0:
            os.close(fd)
