"""Node memory's floor (the step a restart after a lost node takes) is published and read off
the pruner's thread: a coordinator that hangs never lets node memory fill, the ranks do not
read each other's files on every save, and its limits are the documented ones."""

from __future__ import annotations

import collections
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.ckpt.checkpointer import Checkpointer
from gpuwarden.ckpt.coord import FileCoordinator, SoloCoordinator
from gpuwarden.ckpt.fstier import FsTier
from tests.unit.test_ckpt_keep_exact import JOB, state
from tests.unit.test_ckpt_keep_tier0 import _until, memory


class _Hung:
    """A coordinator on a shared filesystem that stalls (or a host that black-holes): its
    calls for node memory block until released."""

    rank, world_size = 0, 2

    def __init__(self) -> None:
        self.release = threading.Event()

    def exchange(self, round_name: str, value: Any, timeout: float) -> list[Any]:
        raise OSError("away")

    def propose(self, name: str, value: int) -> int:
        raise OSError("away")

    def publish_durable(self, tier: str, step: int) -> None:
        self.release.wait(60)
        raise OSError("away")

    def durable_floor(self, tier: str, fresh: bool = False) -> int | None:
        self.release.wait(60)
        raise OSError("away")


def test_a_hung_coordinator_never_lets_node_memory_fill(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    coord = _Hung()
    ck = Checkpointer(JOB, memory(tmp_path, 0), [], rank=0, world_size=2, keep=2, coord=coord,
                      floor_wait_s=0.3)
    try:
        for step in range(1, 13):
            ck.save(step, state(step, 0))
        assert _until(lambda: memory(tmp_path, 0).steps() == [11, 12]), \
            memory(tmp_path, 0).steps()
        assert "node memory keeps its newest steps only" in caplog.text
        began = time.monotonic()
        ck.close(timeout=30)  # its last pass waits for the floor a bounded time, not forever
        assert time.monotonic() - began < 5
        assert memory(tmp_path, 0).steps() == [11, 12]
    finally:
        coord.release.set()
        ck.close(timeout=30)


def test_ranks_read_the_floor_at_most_once_a_second_not_every_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `FileCoordinator` a read is a file per rank on the shared filesystem, by every
    rank: W^2 opens. Four lockstep ranks, a save every ~50 ms."""
    reads: collections.Counter[tuple[int, str]] = collections.Counter()
    real = FileCoordinator._read_floor

    def counted(self: FileCoordinator, tier: str) -> int | None:
        reads[(self.rank, tier)] += 1
        return real(self, tier)
    monkeypatch.setattr(FileCoordinator, "_read_floor", counted)
    world, saves = 4, 40
    cks = [Checkpointer(JOB, memory(tmp_path, r), [FsTier("fsx", str(tmp_path / "fsx"), JOB, r)],
                        rank=r, world_size=world, keep=2,
                        coord=FileCoordinator(str(tmp_path / "fsx" / JOB), r, world))
           for r in range(world)]
    began = time.monotonic()
    for step in range(1, saves + 1):
        for r, ck in enumerate(cks):
            ck.save(step, state(step, r))
        time.sleep(0.05)  # the training between saves
    took = time.monotonic() - began
    for ck in cks:
        ck.close(timeout=30)
    for r in range(world):
        assert reads[(r, "shm")] <= min(saves / 2, took + 3), dict(reads)
        # ...and node memory still bounded: keep steps, and the floor
        assert len(memory(tmp_path, r).steps()) <= 3, memory(tmp_path, r).steps()


def test_a_rank_lagging_keep_saves_behind_is_restored_from_a_slower_tier(
        tmp_path: Path) -> None:
    """The documented limit: rank 1's replica of step 20 lands after rank 0 saved `keep` more
    steps, so rank 0 deleted 20 from memory before it became the floor. A restart after
    rank 1's node is lost takes step 20 from the shared filesystem (kept: durable retention
    keeps every step from the ranks' durable floor on), not from memory."""
    slow = threading.Event()

    def replica(r: int) -> FsTier:
        tier = FsTier("peers", str(tmp_path / f"peer{r}"), JOB, r)
        if r == 1:
            real = tier.commit

            def commit(manifest: Any, data: Any, **kw: Any) -> Any:
                if manifest.step == 20:
                    assert slow.wait(60)
                return real(manifest, data, **kw)
            tier.commit = commit  # type: ignore[method-assign]
        return tier
    fsx0 = FsTier("fsx", str(tmp_path / "fsx"), JOB, 0)
    cks = [Checkpointer(JOB, memory(tmp_path, r), [FsTier("fsx", str(tmp_path / "fsx"), JOB, r)],
                        rank=r, world_size=2, keep=2, replicas=[replica(r)],
                        coord=FileCoordinator(str(tmp_path / "fsx" / JOB), r, 2))
           for r in range(2)]
    reader = FileCoordinator(str(tmp_path / "fsx" / JOB), 0, 2)
    try:
        for r in range(2):
            cks[r].save(10, state(10, r))
            assert cks[r].wait_durable(10, 30)
        cks[1].save(20, state(20, 1))  # its replica is slow to land
        for s in (20, 30, 40):
            cks[0].save(s, state(s, 0))
            assert cks[0].wait_durable(s, 30)
        assert _until(lambda: memory(tmp_path, 0).steps() == [10, 30, 40]), \
            memory(tmp_path, 0).steps()
        slow.set()
        assert cks[1].wait_durable(20, 30)
        assert _until(lambda: reader.durable_floor("shm", fresh=True) == 20)
        assert 20 not in memory(tmp_path, 0).steps()
        assert 20 in fsx0.steps()
    finally:
        slow.set()
        for ck in cks:
            ck.close(timeout=30)


class _Blocked(FsTier):
    """A shared filesystem whose write of one step does not finish yet."""

    def __init__(self, *a: Any, step: int, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.step, self.go = step, threading.Event()

    def commit(self, manifest: Any, data: Any, **kw: Any) -> Any:
        if manifest.step == self.step:
            assert self.go.wait(60)
        return super().commit(manifest, data, **kw)


def test_without_replicas_a_rank_publishes_its_newest_durable_step(tmp_path: Path) -> None:
    """A lost rank without replicas restores what is durable, not what its memory held."""
    fsx = _Blocked("fsx", str(tmp_path / "fsx"), JOB, 0, step=20)
    ck = Checkpointer(JOB, memory(tmp_path, 0), [fsx], rank=0, world_size=2, keep=2,
                      coord=FileCoordinator(str(tmp_path / "fsx" / JOB), 0, 2))
    reader = FileCoordinator(str(tmp_path / "fsx" / JOB), 1, 2)
    try:
        ck.save(10, state(10, 0))
        assert ck.wait_durable(10, 30)
        ck.save(20, state(20, 0))  # in memory, not yet durable
        ck.prune_tier0()  # publishes now, synchronously
        assert reader._read("durable-shm.rank-0") == 10
        fsx.go.set()
        assert ck.wait_durable(20, 30)
        assert _until(lambda: reader._read("durable-shm.rank-0") == 20)
    finally:
        fsx.go.set()
        ck.close(timeout=30)


def test_a_job_of_one_rank_never_asks_the_coordinator_about_memory(tmp_path: Path) -> None:
    calls: list[tuple[str, str]] = []

    class Spy(SoloCoordinator):
        def publish_durable(self, tier: str, step: int) -> None:
            calls.append(("publish", tier))
            super().publish_durable(tier, step)

        def durable_floor(self, tier: str, fresh: bool = False) -> int | None:
            calls.append(("floor", tier))
            return super().durable_floor(tier, fresh)
    fsx = FsTier("fsx", str(tmp_path / "fsx"), JOB, 0)
    ck = Checkpointer(JOB, memory(tmp_path, 0), [fsx], keep=2, coord=Spy())
    for step in (1, 2, 3):
        ck.save(step, state(step, 0))
    assert ck.wait_durable(3, 30)
    assert _until(lambda: memory(tmp_path, 0).steps() == [2, 3])
    ck.close(timeout=30)
    assert memory(tmp_path, 0).steps() == [2, 3]
    assert calls and all(tier == "fsx" for _, tier in calls), calls
