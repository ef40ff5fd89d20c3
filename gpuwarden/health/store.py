"""The node's own health state: verdicts and pass counters in a root-owned directory,
written atomically, plus a node_exporter textfile."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from dataclasses import dataclass
from typing import Any

from gpuwarden.errors import GpuwardenError
from gpuwarden.health.model import Verdict

_MAX_STATE_BYTES = 1 << 20


class StateDirError(GpuwardenError):
    pass


def unsafe_dir_problem(path: str, st: os.stat_result) -> str:
    """Why ``path`` (lstat ``st``) is not a directory for root's state alone; "" when it is.

    A planted symlink or a directory others can write would let users steer root."""
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory (a link?)"
    if st.st_uid != os.geteuid():
        return f"{path} is owned by uid {st.st_uid}, not by us"
    if st.st_mode & 0o022:
        return f"{path} is writable by group or others: chmod go-w {path}"
    return ""


def ensure_private_dir(path: str) -> None:
    """Create ``path`` 0700, or accept it only if it is a real directory we alone can write."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    problem = unsafe_dir_problem(path, os.lstat(path))
    if problem:
        raise StateDirError(f"{problem}: refusing to use it")


def atomic_write(directory: str, name: str, data: bytes, mode: int = 0o600) -> None:
    """Exclusive temp file in the same directory, fsync, rename, fsync the directory."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=directory)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, os.path.join(directory, name))
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def check_private_dir(path: str) -> bool:
    """False when absent; raises when present but not ours alone (see ensure_private_dir)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    problem = unsafe_dir_problem(path, st)
    if problem:
        raise StateDirError(f"{path} is not a private directory of ours ({problem}): "
                            "refusing to read it")
    return True


def read_private(path: str) -> bytes | None:
    """A regular file's bytes, never through a link and never blocking on a FIFO."""
    if not check_private_dir(os.path.dirname(path)):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise StateDirError(f"{path} is not a regular file: refusing to read it")
        return f.read(_MAX_STATE_BYTES)


@dataclass(frozen=True)
class Counters:
    passes: int = 0
    last_status: str = ""
    # The exact Slurm reason of the drain health gating made here: only that one it resumes.
    drained_reason: str = ""


class Store:
    VERDICT = "verdict.json"
    COUNTERS = "counters.json"

    def __init__(self, state_dir: str, prom_dir: str = "") -> None:
        self.dir = state_dir
        self.prom_dir = prom_dir

    def _ready(self) -> None:
        ensure_private_dir(self.dir)

    def save_verdict(self, verdict: Verdict) -> None:
        self._ready()
        atomic_write(self.dir, self.VERDICT, json.dumps(verdict.to_json(), indent=1).encode())
        if self.prom_dir:
            os.makedirs(self.prom_dir, mode=0o755, exist_ok=True)
            atomic_write(self.prom_dir, "gpuwarden.prom", prometheus(verdict).encode(), 0o644)

    def load_verdict(self) -> Verdict | None:
        """The stored verdict, or None when absent or unreadable (then checks run afresh)."""
        data = read_private(os.path.join(self.dir, self.VERDICT))
        if data is None:
            return None
        try:
            return Verdict.from_json(json.loads(data))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def load_counters(self) -> Counters:
        data = read_private(os.path.join(self.dir, self.COUNTERS))
        try:
            doc: dict[str, Any] = json.loads(data) if data else {}
            return Counters(int(doc.get("passes", 0)), str(doc.get("last_status", "")),
                            str(doc.get("drained_reason", "")))
        except (ValueError, TypeError, AttributeError):
            return Counters()

    def save_counters(self, counters: Counters) -> None:
        self._ready()
        atomic_write(self.dir, self.COUNTERS, json.dumps(
            {"passes": counters.passes, "last_status": counters.last_status,
             "drained_reason": counters.drained_reason}).encode())


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def prometheus(v: Verdict) -> str:
    """node_exporter textfile: overall status, one gauge per check, and when it ran."""
    lines = [
        "# HELP gpuwarden_health_status Node verdict: 0 ok, 1 warning, 2 critical, 3 unknown.",
        "# TYPE gpuwarden_health_status gauge",
        f'gpuwarden_health_status{{node="{_label(v.node)}"}} {v.status.exit_code}',
        "# HELP gpuwarden_check_status Per-check status (same scale).",
        "# TYPE gpuwarden_check_status gauge",
    ]
    for r in v.results:
        gpu = "" if r.gpu is None else str(r.gpu)
        lines.append(f'gpuwarden_check_status{{check="{_label(r.check)}",gpu="{gpu}"}} '
                     f"{r.status.exit_code}")
    lines += [
        "# HELP gpuwarden_health_timestamp_seconds When the verdict was made.",
        "# TYPE gpuwarden_health_timestamp_seconds gauge",
        f"gpuwarden_health_timestamp_seconds {v.at:.0f}",
        "",
    ]
    return "\n".join(lines)
