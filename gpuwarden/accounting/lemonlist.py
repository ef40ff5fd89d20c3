"""The current lemon list: one JSON file, replaced atomically, read by the placement filter."""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import asdict, dataclass
from typing import Any

from gpuwarden.core.errors import GpuwardenError, SlurmError
from gpuwarden.core.safefs import StateDirError, atomic_write, ensure_private_dir
from gpuwarden.slurm.client import check_node_name

VERSION = 1


class LemonListError(GpuwardenError):
    """The lemon list cannot be read or is not what `lemon scan` writes."""


@dataclass(frozen=True)
class LemonEntry:
    node: str
    summary: str
    failures: int
    jobs: int
    q_value: float
    action: str  # what --drain did: drained, held (cap), already out, not asked


@dataclass(frozen=True)
class LemonList:
    generated_at: float
    entries: tuple[LemonEntry, ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(e.node for e in self.entries)


MAX_BYTES = 4 << 20


def write(path: str, entries: list[LemonEntry], now: float | None = None) -> None:
    """Replace the list atomically. Its directory is ours alone to write (checked: not a link,
    owned by us, not group- or world-writable), and readable by all, like the file."""
    doc = {"version": VERSION, "generated_at": now if now is not None else time.time(),
           "nodes": [asdict(e) for e in entries]}
    directory, name = os.path.split(path)
    try:
        ensure_private_dir(directory, mode=0o755)  # made if missing; reached by safefs's walk
    except StateDirError as exc:
        raise LemonListError(f"{exc}: refusing to write the lemon list there") from None
    atomic_write(directory, name, (json.dumps(doc, indent=1) + "\n").encode(), mode=0o644)


def _entry(item: Any, path: str, i: int) -> LemonEntry:
    if not isinstance(item, dict):
        raise LemonListError(f"{path}: nodes[{i}] is not an object")
    try:
        entry = LemonEntry(node=check_node_name(str(item["node"])), summary=str(item["summary"]),
                           failures=int(item["failures"]), jobs=int(item["jobs"]),
                           q_value=float(item["q_value"]), action=str(item["action"]))
    except KeyError as exc:
        raise LemonListError(f"{path}: nodes[{i}] has no {exc.args[0]!r}") from None
    except (TypeError, ValueError, SlurmError) as exc:
        raise LemonListError(f"{path}: nodes[{i}]: {exc}") from None
    return entry


def read(path: str) -> LemonList:
    try:
        # No links, no FIFOs (O_NONBLOCK: opening one must not hang), nothing huge.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise LemonListError(f"{path}: not a regular file")
            if st.st_size > MAX_BYTES:
                raise LemonListError(f"{path}: {st.st_size} bytes, more than a lemon list")
            doc = json.loads(fh.read(MAX_BYTES + 1).decode("utf-8"))
    except FileNotFoundError:
        raise LemonListError(f"{path}: no lemon list yet (run `gpuwarden lemon scan "
                             "--write-list` or `--drain`)") from None
    except PermissionError:
        raise LemonListError(f"{path}: permission denied (run as root, or make the list "
                             "readable: it holds no secrets)") from None
    except OSError as exc:
        raise LemonListError(f"{path}: cannot read ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LemonListError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise LemonListError(f"{path}: expected a version {VERSION} lemon list")
    nodes = doc.get("nodes")
    if not isinstance(nodes, list):
        raise LemonListError(f"{path}: 'nodes' is not a list")
    generated = doc.get("generated_at")
    if not isinstance(generated, (int, float)):
        raise LemonListError(f"{path}: 'generated_at' is not a time")
    return LemonList(float(generated), tuple(_entry(x, path, i) for i, x in enumerate(nodes)))



IN_SERVICE = "in service"


def status(entry: LemonEntry, state: str | None) -> str:
    """What the list means for the node now, from what --drain did and its state now
    (``state``: "in service", Slurm's state text, or None when unknown). Mirrors the placement
    filter (`gpuwarden.placement.snapshot.suspects`): a drained lemon that is back in service
    was resumed after repair and is no longer avoided."""
    if state is None:
        return f"{entry.action}; state now unknown"
    if entry.action == "drained":
        return "drained, since resumed: no longer avoided" if state == IN_SERVICE else "drained"
    if state == IN_SERVICE:
        return f"{entry.action}; in service, placement avoids it"
    return f"{entry.action}; now {state}"
