"""Reading a site's slurm.conf the way Slurm's own parser does (src/common/parse_config.c,
24.11), for `gpuwarden slurm-conf --check`.

What Slurm does, and so what this does: keys are case-insensitive; ``#`` starts a comment unless
escaped (``\\#``); a line ending in an odd number of backslashes continues on the next; one
``Key=value`` per line (a quoted value may hold spaces), except the record keys (NodeName,
PartitionName ...) whose line carries more keys; ``Include FILE`` reads FILE in place, a relative
name from slurm.conf's directory, ``%c`` standing for the ClusterName given before it, and no
glob patterns (Slurm skips them with an error). A key given twice keeps the last value, except
the keys Slurm collects (Prolog, Epilog and the record keys).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass

from gpuwarden.errors import GpuwardenError

# Keys whose every line counts, in file order (S_P_ARRAY in read_config.c; Prolog and Epilog
# since 24.05). Every other key keeps only its last value.
COLLECTED = frozenset({"nodename", "partitionname", "nodeset", "downnodes", "frontendname",
                       "slurmctldhost", "prolog", "epilog", "prologslurmctld",
                       "epilogslurmctld"})
# Keys whose line holds more keys after the first (the record's own settings).
RECORDS = frozenset({"nodename", "partitionname", "nodeset", "downnodes", "frontendname",
                     "slurmctldhost"})
MAX_BYTES = 16 << 20
MAX_DEPTH = 16
_KEYVALUE = re.compile(r'[ \t]*([A-Za-z0-9_.]+)[ \t]*[-*+/]?=[ \t]*(?:"([^"]*)"|(\S+))(?=\s|$)')


@dataclass(frozen=True)
class Setting:
    key: str  # as written
    value: str
    file: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Problem:
    """A file or line Slurm would stumble on. ``unreadable``: not readable by us (permission),
    so what it holds is unknown; otherwise Slurm itself fails on it."""

    where: str
    message: str
    unreadable: bool = False


@dataclass(frozen=True)
class SlurmConf:
    path: str
    settings: tuple[Setting, ...]
    problems: tuple[Problem, ...] = ()
    files: tuple[str, ...] = ()  # every file read, slurm.conf first

    @property
    def directory(self) -> str:
        return os.path.dirname(os.path.abspath(self.path))

    def all(self, key: str) -> list[Setting]:
        k = key.lower()
        return [s for s in self.settings if s.key.lower() == k]

    def last(self, key: str) -> Setting | None:
        found = self.all(key)
        return found[-1] if found else None


class UnreadableError(GpuwardenError):
    """The slurm.conf given could not be read at all."""


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each line after comments, continuations and escapes."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, raw in enumerate(text.split("\n"), 1):
        line = _strip_comment(raw.rstrip("\r"))
        if not pending:
            start = number
        stripped = line.rstrip()
        trailing = len(stripped) - len(stripped.rstrip("\\"))
        if trailing % 2:
            pending += stripped[:-1]
            continue
        out.append((start, _unescape(pending + line)))
        pending = ""
    if pending:
        out.append((start, _unescape(pending)))
    return out


def _strip_comment(line: str) -> str:
    backslashes = 0
    for i, ch in enumerate(line):
        if ch == "#" and backslashes % 2 == 0:
            return line[:i]
        backslashes = backslashes + 1 if ch == "\\" else 0
    return line


def _unescape(line: str) -> str:
    """Slurm's _strip_escapes: a backslash keeps the character after it, whatever it is."""
    return re.sub(r"\\(.)|\\$", lambda m: m.group(1) or "", line, flags=re.S)


def parse_line(line: str, file: str, number: int) -> tuple[Setting | None, str]:
    """The line's setting, and what Slurm could not parse in it ("" when nothing)."""
    m = _KEYVALUE.match(line)
    if m is None:
        return None, line.strip()
    value = m.group(2) if m.group(2) is not None else m.group(3)
    setting = Setting(m.group(1), value, file, number)
    rest = line[m.end():]
    if m.group(1).lower() in RECORDS:
        return setting, ""
    return setting, rest.strip()


def read(path: str) -> SlurmConf:
    """Read ``path`` and what it includes. Raises UnreadableError when ``path`` itself cannot
    be read; an Include that cannot be is a Problem."""
    got = _read_file(path)
    if got.text is None:
        raise UnreadableError(f"{path}: {got.why}")
    reader = _Reader(os.path.dirname(os.path.abspath(path)))
    reader.parse(got.text, path, 0, {got.identity})
    return SlurmConf(path, tuple(reader.settings), tuple(reader.problems), tuple(reader.files))


class _Reader:
    def __init__(self, conf_dir: str) -> None:
        self.conf_dir = conf_dir
        self.settings: list[Setting] = []
        self.problems: list[Problem] = []
        self.files: list[str] = []

    def parse(self, text: str, file: str, depth: int, seen: set[tuple[int, int]]) -> None:
        self.files.append(file)
        for number, line in logical_lines(text):
            if not line.strip():
                continue
            target = _include_target(line)
            if target is not None:
                self.include(target, f"{file}:{number}", depth, seen)
                continue
            setting, rest = parse_line(line, file, number)
            if setting is not None:
                self.settings.append(setting)
            if rest:
                self.problems.append(Problem(f"{file}:{number}", f"Slurm cannot parse "
                                             f"{rest[:60]!r} (one Key=value per line)"))

    def include(self, target: str, where: str, depth: int, seen: set[tuple[int, int]]) -> None:
        name = self.substitute(target, where)
        if name is None:
            return
        if "*" in name:
            self.problems.append(Problem(where, f"Include {target}: Slurm does not expand glob "
                                         "patterns (it skips the line with an error); name "
                                         "each file"))
            return
        path = name if name.startswith("/") else os.path.join(self.conf_dir, name)
        if depth >= MAX_DEPTH:
            self.problems.append(Problem(where, f"Include {target}: nested more than "
                                         f"{MAX_DEPTH} deep (a loop?)"))
            return
        got = _read_file(path)
        if got.text is None:
            self.problems.append(Problem(where, f"Include {path}: {got.why}", got.denied))
            return
        if got.identity in seen:
            self.problems.append(Problem(where, f"Include {path}: includes itself (a loop)"))
            return
        self.parse(got.text, path, depth + 1, seen | {got.identity})

    def substitute(self, target: str, where: str) -> str | None:
        if "%c" not in target:
            return target
        cluster = next((s.value for s in reversed(self.settings)
                        if s.key.lower() == "clustername"), None)
        if cluster is None:
            self.problems.append(Problem(where, f"Include {target}: %c needs a ClusterName= "
                                         "line before it"))
            return None
        return target.replace("%c", cluster.lower())


def _include_target(line: str) -> str | None:
    """The file an ``Include`` line names (it must start the line, as in Slurm)."""
    if len(line) > 7 and line[:7].lower() == "include" and line[7] in " \t":
        parts = line[8:].split()
        return parts[0] if parts else None
    return None


@dataclass(frozen=True)
class _Read:
    text: str | None
    why: str = ""
    denied: bool = False  # permission: what the file holds is unknown to us, not to Slurm
    identity: tuple[int, int] = (0, 0)  # (device, inode): an Include loop repeats one


def _read_file(path: str) -> _Read:
    """Only a regular file is read: never a FIFO or a device (O_NONBLOCK: opening a FIFO does
    not wait for a writer)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            return _Read(None, "permission denied (run the check as root)", denied=True)
        if exc.errno == errno.ENOENT:
            return _Read(None, "no such file (slurmctld waits 60 s for it, then fails)")
        return _Read(None, exc.strerror or str(exc))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return _Read(None, "not a regular file")
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        return _Read(None, f"larger than {MAX_BYTES >> 20} MiB")
    return _Read(data.decode("utf-8", errors="replace"), identity=(st.st_dev, st.st_ino))
