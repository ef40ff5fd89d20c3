"""Is a mount there and answering? Imports only os and stat: the prolog's fast gate runs this
before every job, and the full node checks (nodechecks.check_mount) run the same code.

May block on a hung server: callers run it under a deadline in a child process.
"""

from __future__ import annotations

import os
import stat


def mount_points(mountinfo: str) -> set[str]:
    """Mount points from /proc/self/mountinfo (field 5, octal escapes decoded)."""
    points = set()
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4:
            points.add(unescape(fields[4]))
    return points


_OCTAL = frozenset("01234567")


def unescape(field: str) -> str:
    """The kernel's ``\\ooo`` escapes (of space, tab, newline, backslash) decoded; all else
    as it is. Not the "unicode_escape" codec: that mangles any non-ASCII name (read back as
    Latin-1, so such a mount was never found) and costs the fast path ~2 ms to import."""
    if "\\" not in field:
        return field
    out: list[str] = []
    i = 0
    while i < len(field):
        code = field[i + 1:i + 4]
        if field[i] == "\\" and len(code) == 3 and set(code) <= _OCTAL:
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def read_mountinfo() -> str:
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        return f.read()


def probe(path: str, canary: str, node: str, points: set[str] | None = None) -> str:
    """"" when ``path`` is mounted and answers (and its canary reads); "<path> is not mounted"
    when it is not; raises OSError when it errors (stale handle, EIO, a bad canary)."""
    path = path.rstrip("/") or "/"
    if path not in (read_mountinfo_points() if points is None else points):
        return f"{path} is not mounted"
    os.statvfs(path)  # blocks on a hung server: the caller's deadline turns that into a verdict
    if canary:
        name = os.path.join(path, canary.replace("{node}", node))
        # Root reads this: never through a link that leaves the mount, never a device. A FIFO
        # is allowed: opening one only blocks, and the deadline bounds that.
        real = os.path.realpath(os.path.dirname(name))
        if real != path and not real.startswith(path.rstrip("/") + "/"):
            raise OSError(f"canary directory resolves outside {path} (to {real})")
        mode = os.lstat(name).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            raise OSError(f"canary {name} is not a regular file")
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.read(fd, 4096)
        finally:
            os.close(fd)
    return ""


def read_mountinfo_points() -> set[str]:
    return mount_points(read_mountinfo())
