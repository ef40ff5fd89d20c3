"""Node memory keeps the step a restart after a node's loss restores: ranks save without a
barrier, and the survivors train on (saving) until the launcher stops them. Memory stays
bounded: the newest `keep` steps and that one."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.ckpt.checkpointer import Checkpointer
from gpuwarden.ckpt.fstier import FsTier
from tests.unit.test_ckpt_keep_exact import JOB, Coordinators, coordinators, ranks, state

__all__ = ["coordinators"]  # the fixture: files on the shared tier, or the job's coordinator


def _until(cond: Callable[[], bool], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def memory(tmp_path: Path, rank: int) -> FsTier:
    return FsTier("shm", str(tmp_path / f"shm{rank}"), JOB, rank)


def test_a_survivor_keeps_in_memory_the_step_a_lost_rank_restores(
        tmp_path: Path, coordinators: Coordinators) -> None:
    """Rank 1's node is lost after step 30; rank 0 saves keep+3 more steps before it is
    stopped. A restart restores step 30 (the newest step rank 1 can restore): rank 0 must still
    hold it in node memory (not read it from a slower tier), and no more than keep+1 steps."""
    cks = ranks(tmp_path, coordinators=coordinators)
    for step in (10, 20, 30):
        for r, ck in enumerate(cks):
            ck.save(step, state(step, r))
    reader = coordinators(0, 2)
    assert _until(lambda: reader.durable_floor("shm", fresh=True) == 30)
    mem = memory(tmp_path, 0)
    for step in (40, 50, 60, 70, 80):
        cks[0].save(step, state(step, 0))
        want = sorted({30, step - 10, step})
        assert _until(lambda: mem.steps() == want), (step, mem.steps())  # noqa: B023
    cks[0].close(timeout=30)  # the launcher stops the survivor: the last pass keeps it too
    assert mem.steps() == [30, 70, 80]
    cks[1].close(timeout=30)


def test_the_step_kept_is_one_the_lost_rank_has_a_replica_of(
        tmp_path: Path, coordinators: Coordinators) -> None:
    """Rank 1's node is lost while its replica of step 30 is still being written: its
    partner holds step 20, which is what a restart takes, so that is what rank 0 keeps."""
    lost, gone = threading.Event(), threading.Event()

    def replica(r: int) -> FsTier:
        tier = FsTier("peers", str(tmp_path / f"peer{r}"), JOB, r)
        if r == 1:
            real = tier.commit

            def commit(manifest: Any, data: Any, **kw: Any) -> Any:
                if manifest.step == 30:
                    lost.set()
                    assert gone.wait(60)  # the node is gone: this write never lands
                return real(manifest, data, **kw)
            tier.commit = commit  # type: ignore[method-assign]
        return tier
    cks = [Checkpointer(JOB, memory(tmp_path, r), [FsTier("fsx", str(tmp_path / "fsx"), JOB, r)],
                        rank=r, world_size=2, keep=2, replicas=[replica(r)],
                        coord=coordinators(r, 2)) for r in range(2)]
    try:
        for step in (10, 20, 30):
            for r, ck in enumerate(cks):
                ck.save(step, state(step, r))
                # Each step replicated before the next (a writer behind skips superseded steps).
                assert step == 30 or ck.wait_durable(step, timeout=30)
        assert lost.wait(30)
        reader = coordinators(0, 2)
        assert _until(lambda: reader.durable_floor("shm", fresh=True) == 20)
        for step in (40, 50, 60, 70, 80):
            cks[0].save(step, state(step, 0))
        assert _until(lambda: memory(tmp_path, 0).steps() == [20, 70, 80]), \
            memory(tmp_path, 0).steps()
    finally:
        gone.set()
        for ck in cks:
            ck.close(timeout=30)


class _Away:
    """The job's coordinator out of reach (what `coordnet` raises then: an OSError)."""

    rank, world_size = 0, 2

    def exchange(self, round_name: str, value: Any, timeout: float) -> list[Any]:
        raise OSError("coordinator away")

    def propose(self, name: str, value: int) -> int:
        raise OSError("coordinator away")

    def publish_durable(self, tier: str, step: int) -> None:
        raise OSError("coordinator away")

    def durable_floor(self, tier: str, fresh: bool = False) -> int | None:
        raise OSError("coordinator away")


def test_a_coordinator_out_of_reach_never_stops_a_save_and_memory_keeps_keep(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fsx = FsTier("fsx", str(tmp_path / "fsx"), JOB, 0)
    ck = Checkpointer(JOB, memory(tmp_path, 0), [fsx], rank=0, world_size=2, keep=2,
                      coord=_Away())
    with caplog.at_level(logging.WARNING):
        for step in (10, 20, 30, 40, 50):
            assert ck.save(step, state(step, 0)).step == step
        assert ck.wait_durable(50, timeout=30)
        assert _until(lambda: memory(tmp_path, 0).steps() == [40, 50]), \
            memory(tmp_path, 0).steps()
        ck.close(timeout=30)
    assert memory(tmp_path, 0).steps() == [40, 50]
    assert "cannot publish step 50 as held in shm: coordinator away" in caplog.text
