"""Reading a site's slurm.conf the way Slurm's own parser does (src/common/parse_config.c,
24.11), for `gpuwarden slurm-conf --check`.

What Slurm does, and so what this does: keys are case-insensitive; ``#`` starts a comment unless
escaped (``\\#``); a line ending in an odd number of backslashes continues on the next; one
``Key=value`` per line (a quoted value may hold spaces), except the record keys (NodeName,
PartitionName ...) whose line carries more keys; ``Include FILE`` reads FILE in place, a relative
name from slurm.conf's directory, ``%c`` standing for the ClusterName given before it, nothing
after the file name, and no glob patterns; each Include reads its file again, however often it
is named. A key given twice keeps the last value, except the keys Slurm collects (Prolog, Epilog
and the record keys). What Slurm cannot parse stops it: "Unable to process configuration file".
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass

from gpuwarden.core.errors import GpuwardenError

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
# What one check follows at most: Slurm reads an included file again at each Include naming
# it, so a few files including each other several times fan out without end.
MAX_INCLUDES = 1000
MAX_TOTAL_BYTES = 64 << 20
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
    got = read_regular(path)
    if got.text is None:
        raise UnreadableError(f"{path}: {got.why}")
    reader = _Reader(os.path.dirname(os.path.abspath(path)))
    reader.read_bytes = len(got.text)
    reader.parse(got.text, path, 0, {got.identity})
    # One Include line reached along many paths is one problem.
    return SlurmConf(path, tuple(reader.settings), tuple(dict.fromkeys(reader.problems)),
                     tuple(reader.files))


class _Reader:
    def __init__(self, conf_dir: str) -> None:
        self.conf_dir = conf_dir
        self.settings: list[Setting] = []
        self.problems: list[Problem] = []
        self.files: list[str] = []
        self.includes = 0  # Include lines followed
        self.read_bytes = 0
        self.stopped = False  # MAX_INCLUDES or MAX_TOTAL_BYTES reached: nothing more is read

    def parse(self, text: str, file: str, depth: int, seen: set[tuple[int, int]]) -> None:
        self.files.append(file)
        for number, line in logical_lines(text):
            if self.stopped:
                return
            if not line.strip():
                continue
            included = _include_target(line)
            if included is not None:
                target, rest = included
                where = f"{file}:{number}"
                if not target:
                    self.problems.append(Problem(where, "Include names no file"))
                    continue
                self.include(target, where, depth, seen)
                if rest:
                    self.problems.append(Problem(where, f"Slurm cannot parse {rest[:60]!r} after "
                                                 f"Include {target} (one file per Include line)"))
                continue
            setting, rest = parse_line(line, file, number)
            if setting is not None:
                self.settings.append(setting)
            if rest:
                self.problems.append(Problem(f"{file}:{number}", f"Slurm cannot parse "
                                             f"{rest[:60]!r} (one Key=value per line)"))

    def include(self, target: str, where: str, depth: int, seen: set[tuple[int, int]]) -> None:
        self.includes += 1
        if self.includes > MAX_INCLUDES or self.read_bytes >= MAX_TOTAL_BYTES:
            self.stopped = True
            self.problems.append(Problem(where, f"Include {target}: more than {MAX_INCLUDES} "
                                         f"Include lines or {MAX_TOTAL_BYTES >> 20} MiB followed "
                                         "(Slurm reads a file again at each Include naming it, "
                                         "so it would take as long or hang); stopped reading "
                                         "here: include each file once"))
            return
        name = self.substitute(target, where)
        if name is None:
            return
        if "*" in name:
            self.problems.append(Problem(where, f"Include {target}: Slurm does not expand glob "
                                         "patterns (an error that stops it); name each file"))
            return
        path = name if name.startswith("/") else os.path.join(self.conf_dir, name)
        if depth >= MAX_DEPTH:
            self.problems.append(Problem(where, f"Include {target}: nested more than "
                                         f"{MAX_DEPTH} deep (a loop?)"))
            return
        got = read_regular(path)
        if got.text is None:
            self.problems.append(Problem(where, f"Include {path}: {got.why}", got.denied))
            return
        self.read_bytes += len(got.text)
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


def _include_target(line: str) -> tuple[str, str] | None:
    """The file an ``Include`` line names ("" when none) and what follows it, when the line is
    one (``Include`` must start the line, as in Slurm)."""
    if len(line) > 7 and line[:7].lower() == "include" and line[7] in " \t":
        parts = line[8:].split(None, 1)
        return (parts[0], parts[1].strip() if len(parts) > 1 else "") if parts else ("", "")
    return None


@dataclass(frozen=True)
class FileRead:
    text: str | None
    why: str = ""
    denied: bool = False  # permission: what the file holds is unknown to us, not to Slurm
    absent: bool = False  # nothing by that name (a link that leads nowhere is not absent)
    identity: tuple[int, int] = (0, 0)  # (device, inode): an Include loop repeats one


def read_regular(path: str, limit: int = MAX_BYTES) -> FileRead:
    """``path`` as text when it is a regular file, links followed as Slurm follows them; else
    why not. Never a FIFO or a device: looked at before it is opened (opening some devices
    does something), and O_NONBLOCK (opening a FIFO does not wait for a writer)."""
    try:
        data, st = _regular_bytes(path, limit)
    except OSError as exc:
        return _failed(path, exc)
    if len(data) > limit:
        return FileRead(None, f"larger than {limit >> 20} MiB")
    return FileRead(data.decode("utf-8", errors="replace"), identity=(st.st_dev, st.st_ino))


def _regular_bytes(path: str, limit: int) -> tuple[bytes, os.stat_result]:
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise OSError(0, "not a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):  # replaced since the look
            raise OSError(0, "not a regular file")
        return f.read(limit + 1), st


def _failed(path: str, exc: OSError) -> FileRead:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return FileRead(None, "permission denied (run the check as root)", denied=True)
    if exc.errno == errno.ENOENT and os.path.islink(path):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return FileRead(None, f"a link to {target}, which does not exist")
    if exc.errno == errno.ENOENT:
        return FileRead(None, "no such file (slurmctld waits 60 s for it, then fails)",
                        absent=True)
    return FileRead(None, exc.strerror or str(exc))
