"""How a job's ranks learn about each other without a network service: small files in the job's
private directory on the shared filesystem.

Three uses: the ranks' peer addresses at start, agreement on the step to restore (the newest
step every rank holds: one rank restoring a newer step than the others would silently diverge),
and each rank's newest durable step, so that retention never deletes a step some other rank
still needs (a rank that died at step 10 needs step 10 from every rank on restart, however far
the survivors got before Slurm stopped them). Node memory's steps are published the same way,
under tier 0's name: the survivors keep that one step in memory.

Every file is written to a temp name and renamed, so a reader sees a whole value or none; every
value read is checked, and a rank that does not report in time is an error naming it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from gpuwarden.ckpt.names import check_name
from gpuwarden.core import safejson
from gpuwarden.core.errors import GpuwardenError

log = logging.getLogger(__name__)

_MAX_FILE = 1 << 20


class CoordError(GpuwardenError):
    """The ranks could not agree (one did not report in time, or reported garbage)."""


class Coordinator(Protocol):
    rank: int
    world_size: int

    def exchange(self, round_name: str, value: Any, timeout: float) -> list[Any]: ...
    def propose(self, name: str, value: int) -> int: ...
    def publish_durable(self, tier: str, step: int) -> None: ...
    def durable_floor(self, tier: str, fresh: bool = False) -> int | None: ...


def newest_common(held: Sequence[Sequence[int]]) -> int | None:
    """The newest step every rank holds. Pure."""
    if not held:
        return None
    common = set(held[0]).intersection(*held[1:])
    return max(common) if common else None


def agree(coord: Coordinator, round_name: str, mine: Sequence[int], timeout: float) -> int | None:
    held = coord.exchange(round_name, sorted(set(mine)), timeout)
    for r, steps in enumerate(held):
        if not (isinstance(steps, list)
                and all(isinstance(s, int) and not isinstance(s, bool) for s in steps)):
            raise CoordError(f"rank {r} reported {str(steps)[:80]!r} as its steps: not a list "
                             "of integers")
    return newest_common(held)


class SoloCoordinator:
    """A job of one rank: nothing to agree on."""

    rank, world_size = 0, 1

    def __init__(self) -> None:
        self._durable: dict[str, int] = {}

    def exchange(self, round_name: str, value: Any, timeout: float) -> list[Any]:
        return [value]

    def propose(self, name: str, value: int) -> int:
        return value

    def publish_durable(self, tier: str, step: int) -> None:
        self._durable[tier] = step

    def durable_floor(self, tier: str, fresh: bool = False) -> int | None:
        return self._durable.get(tier)


class FileCoordinator:
    """Files under ``<job dir>/coord`` (the job's 0700 directory on the shared filesystem)."""

    def __init__(self, job_dir: str, rank: int, world_size: int,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not 0 <= rank < world_size:
            raise CoordError(f"rank {rank} is outside a world of {world_size}")
        self.dir = os.path.join(job_dir, "coord")
        self.rank, self.world_size = rank, world_size
        self._sleep = sleep
        self.floor_ttl_s = 10.0
        self._floors: dict[str, tuple[float, int]] = {}
        os.makedirs(self.dir, mode=0o700, exist_ok=True)

    def _write(self, name: str, value: Any) -> None:
        path = os.path.join(self.dir, name)
        # A name of this thread's own: the floor thread and close's last pass may publish at
        # once (`floor0`), and one temp file shared between them could mix their values.
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(value, fh)
        os.replace(tmp, path)

    def _read(self, name: str) -> Any:
        path = os.path.join(self.dir, name)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read(_MAX_FILE + 1)
        if len(raw) > _MAX_FILE:
            raise CoordError(f"{path}: larger than {_MAX_FILE} bytes")
        try:
            return safejson.loads(raw, max_bytes=_MAX_FILE)
        except safejson.JsonError as exc:
            raise CoordError(f"{path}: {exc}") from None

    def record(self, name: str, value: Any) -> None:
        """A file of this rank's that no round waits for, read later by others (the restore
        records of `restorelog`), written as every other: whole or not at all."""
        self._write(check_name(name, "record"), value)

    def exchange(self, round_name: str, value: Any, timeout: float) -> list[Any]:
        """Publish this rank's value for the round and return every rank's, in rank order."""
        check_name(round_name, "round")
        self._write(f"{round_name}.rank-{self.rank}", value)
        deadline = time.monotonic() + timeout
        out: dict[int, Any] = {}
        while True:
            for r in range(self.world_size):
                if r not in out:
                    with contextlib.suppress(FileNotFoundError):
                        out[r] = self._read(f"{round_name}.rank-{r}")
            if len(out) == self.world_size:
                return [out[r] for r in range(self.world_size)]
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world_size) if r not in out]
                raise CoordError(f"{round_name}: ranks {_ranges(missing)} did not report within "
                                 f"{timeout:.0f} s (in {self.dir}); are they running?")
            self._sleep(0.1)

    def propose(self, name: str, value: int) -> int:
        """The first proposal for ``name`` wins; returns it (ours or an earlier rank's)."""
        path = os.path.join(self.dir, check_name(name, "proposal"))
        tmp = f"{path}.{self.rank}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(value, fh)
        try:
            os.link(tmp, path)  # atomic and exclusive, on NFS and Lustre too
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        won = self._read(name)
        if not isinstance(won, int) or isinstance(won, bool):
            raise CoordError(f"{path}: {won!r} is not a step")
        return won

    def publish_durable(self, tier: str, step: int) -> None:
        self._write(f"durable-{check_name(tier, 'tier')}.rank-{self.rank}", step)

    def durable_floor(self, tier: str, fresh: bool = False) -> int | None:
        """The oldest of the ranks' newest steps on ``tier``; None while some rank has none.
        Per tier: a step on the shared filesystem does not make S3's older copies spare.

        Read at most every ``floor_ttl_s`` (unless ``fresh``: the last pass, at close): it is
        one file per rank on the parallel filesystem, and within a run floors only rise, so a
        cached one deletes less, never more."""
        now = time.monotonic()
        cached = self._floors.get(tier)
        if not fresh and cached is not None and now - cached[0] < self.floor_ttl_s:
            return cached[1]
        floor = self._read_floor(tier)
        if floor is not None:
            self._floors[tier] = (now, floor)
        return floor

    def _read_floor(self, tier: str) -> int | None:
        floor: int | None = None
        for r in range(self.world_size):
            try:
                v = self._read(f"durable-{check_name(tier, 'tier')}.rank-{r}")
            except (FileNotFoundError, CoordError):
                return None
            if not isinstance(v, int) or isinstance(v, bool):
                return None
            floor = v if floor is None else min(floor, v)
        return floor


def _ranges(ranks: list[int]) -> str:
    shown = ",".join(str(r) for r in ranks[:16])
    return shown + (f",... ({len(ranks)} in all)" if len(ranks) > 16 else "")
