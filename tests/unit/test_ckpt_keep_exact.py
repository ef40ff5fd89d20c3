"""`keep = 2` keeps two: once a job of several ranks is finished, each rank holds exactly
`keep` steps on the shared tier, unless another rank still needs an older one (and `ckpt ls`
then says which step is held for that reason)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from gpuwarden.ckpt import codec, listing
from gpuwarden.ckpt.checkpointer import Checkpointer
from gpuwarden.ckpt.coord import Coordinator, FileCoordinator
from gpuwarden.ckpt.coordnet import NetCoordinator
from gpuwarden.ckpt.coordsrv import CoordServer
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.job import JobCheckpointer, JobEnv
from gpuwarden.ckpt.listing import Row
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.config.ckpt import CkptConfig
from tests.unit.test_ckpt_ownership import _cli
from tests.unit.test_ckpt_peer import KEY

JOB = "job-7"


def state(step: int, rank: int) -> dict[str, object]:
    return {"w": np.full((64,), step * 10 + rank, dtype=np.float32)}


Coordinators = Callable[[int, int], Coordinator]


@pytest.fixture(params=["file", "net"])
def coordinators(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Coordinators]:
    """Rank r's coordinator in a world of n: files on the shared tier, or the job's
    coordinator (`coordsrv`) as on a site without one; retention must keep the same steps."""
    if request.param == "file":
        yield lambda r, n: FileCoordinator(str(tmp_path / "fsx" / JOB), r, n)
        return
    server = CoordServer(KEY, JOB, host="127.0.0.1")
    try:
        yield lambda r, n: NetCoordinator(f"127.0.0.1:{server.port}", KEY, JOB, r, n)
    finally:
        server.stop()


def ranks(tmp_path: Path, world: int = 2, keep: int = 2,
          coordinators: Coordinators | None = None) -> list[Checkpointer]:
    """Checkpointers of a job's ranks, with the coordinator's default floor caching (a real
    job's: the ranks' saves come much closer together than its time to live)."""
    def files(r: int, n: int) -> Coordinator:
        return FileCoordinator(str(tmp_path / "fsx" / JOB), r, n)
    make = coordinators or files
    return [Checkpointer(JOB, FsTier("shm", str(tmp_path / f"shm{r}"), JOB, r),
                         [FsTier("fsx", str(tmp_path / "fsx"), JOB, r)], rank=r,
                         world_size=world, keep=keep, coord=make(r, world))
            for r in range(world)]


def shared(tmp_path: Path, rank: int) -> list[int]:
    return FsTier("fsx", str(tmp_path / "fsx"), JOB, rank).steps()


def test_a_finished_job_holds_exactly_keep_steps_per_rank(tmp_path: Path,
                                                          coordinators: Coordinators) -> None:
    """Rank 0 runs a save ahead of rank 1 (its commits land first), as ranks do: every floor
    rank 0 read then was rank 1's step before. After the last save and close, keep=2 must
    leave two steps per rank, not three."""
    cks = ranks(tmp_path, coordinators=coordinators)
    for step in (10, 15, 20):
        for r, ck in enumerate(cks):
            ck.save(step, state(step, r))
            assert ck.wait_durable(step, timeout=30)
    for ck in cks:
        ck.close(timeout=30)
    assert [shared(tmp_path, r) for r in range(2)] == [[15, 20], [15, 20]]


def test_a_rank_that_closes_first_still_ends_with_keep_steps(tmp_path: Path,
                                                             coordinators: Coordinators) -> None:
    """Rank 0 is done (its last step durable, closed) while rank 1 is still one save behind:
    what rank 0 may still need to keep for rank 1 is then gone once rank 1 catches up and every
    rank has finished (JobCheckpointer.finish's barrier runs the last pass)."""
    cks = ranks(tmp_path, coordinators=coordinators)
    for step in (10, 15):
        for r, ck in enumerate(cks):
            ck.save(step, state(step, r))
            assert ck.wait_durable(step, timeout=30)
    cks[0].save(20, state(20, 0))
    assert cks[0].wait_durable(20, timeout=30)
    cks[0].close(timeout=30)
    # Rank 1 still at 15: step 15 is what a restart would take, so rank 0 keeps 15 and 20.
    assert shared(tmp_path, 0) == [15, 20]
    cks[1].save(20, state(20, 1))
    assert cks[1].wait_durable(20, timeout=30)
    cks[1].close(timeout=30)
    assert shared(tmp_path, 1) == [15, 20]


def test_the_last_pass_after_every_rank_finished_leaves_keep(tmp_path: Path,
                                                             coordinators: Coordinators) -> None:
    """Rank 1 lags two saves behind when rank 0 closes: rank 0 must keep step 10 (the newest
    step rank 1 holds). Once both have closed, `prune_durable` (what `finish` runs after its
    barrier) brings each rank to exactly keep."""
    cks = ranks(tmp_path, coordinators=coordinators)
    cks[1].save(10, state(10, 1))
    assert cks[1].wait_durable(10, timeout=30)
    for step in (10, 15, 20):
        cks[0].save(step, state(step, 0))
        assert cks[0].wait_durable(step, timeout=30)
    cks[0].close(timeout=30)
    assert shared(tmp_path, 0) == [10, 15, 20]  # rank 1 still needs 10 from everyone
    for step in (15, 20):
        cks[1].save(step, state(step, 1))
        assert cks[1].wait_durable(step, timeout=30)
    cks[1].close(timeout=30)
    done = threading.Barrier(2)

    def last(ck: Checkpointer) -> None:
        done.wait(timeout=30)
        ck.prune_durable()
    threads = [threading.Thread(target=last, args=(ck,)) for ck in cks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [shared(tmp_path, r) for r in range(2)] == [[15, 20], [15, 20]]


def test_ls_marks_a_step_kept_beyond_keep_because_a_rank_still_needs_it() -> None:
    rows = [Row("shared", "/fsx", 0, (10, 15, 20)), Row("shared", "/fsx", 1, (10,)),
            Row("memory", "c1 (this host)", 0, (15, 20))]
    marked = listing.needed(rows, keep=2)
    assert marked[0].needed == (10,) and marked[1].needed == () and marked[2].needed == ()
    lines = "\n".join(listing.table(marked, JOB))
    assert "10 (kept beyond keep=2: the newest step rank 1 holds" in lines, lines
    # Every rank at the same steps: nothing is marked.
    even = listing.needed([Row("shared", "/fsx", r, (15, 20)) for r in range(2)], keep=2)
    assert all(r.needed == () for r in even)
    assert "kept beyond" not in "\n".join(listing.table(even, JOB))


def test_a_jobs_ranks_finishing_apart_end_with_keep_steps_each(tmp_path: Path) -> None:
    """The job level, no peer tier: rank 0 finishes (waits in `finish`) while rank 1 is still
    two saves behind; once rank 1 finishes too, each rank holds exactly keep=2 steps."""
    coord = tmp_path / "fsx" / JOB / "coord"

    def run(r: int) -> None:
        cfg = CkptConfig(memory_root=str(tmp_path / f"node{r}"),
                         shared_root=str(tmp_path / "fsx"), agree_timeout_s=20, keep=2,
                         peer_replicas=0)
        ck = JobCheckpointer(cfg, JobEnv("7", r, 2, 0, "0", f"node{r}"))
        steps = (10, 15, 20)
        if r == 1:
            ck.save(10, state(10, 1))
            assert ck.wait_durable(10, timeout=30)
            deadline = time.monotonic() + 30
            while not list(coord.glob("finish-*.rank-0")):  # rank 0 is done and waiting
                assert time.monotonic() < deadline, "rank 0 never finished"
                time.sleep(0.05)
            steps = (15, 20)
        for step in steps:
            ck.save(step, state(step, r))
            # Each step durable before the next: a writer that falls behind skips superseded
            # steps by design (test_ckpt_checkpointer), which is not what is tested here.
            assert ck.wait_durable(step, timeout=30)
        assert ck.finish(20, timeout=30)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [shared(tmp_path, r) for r in range(2)] == [[15, 20], [15, 20]]


def _saved(tmp_path: Path, rank: int, *steps: int, world: int = 2, tier: str = "fsx") -> None:
    t = FsTier(tier, str(tmp_path / tier), JOB, rank)
    for step in steps:
        shards, data = codec.encode(state(step, rank))
        t.commit(Manifest(JOB, step, world, rank, tuple(shards), time.time(), {}), data)


def test_ckpt_gc_keeps_the_step_a_restart_restores_as_ls_says(tmp_path: Path) -> None:
    """Rank 1 died at step 10 while rank 0 went on to 15 and 20: `ckpt ls` says rank 0's step
    10 is kept beyond keep=2 (the step a restart restores); `ckpt gc` (an admin's, or the
    user's) then keeps it too, on the durable tiers. Node memory has no floor (the writer's
    rule): its old steps go."""
    _saved(tmp_path, 0, 5, 10, 15, 20)
    _saved(tmp_path, 1, 5, 10)
    _saved(tmp_path, 0, 10, 15, 20, tier="shm")
    run = _cli(tmp_path)
    code, out = run("ckpt", "ls", JOB)
    assert code == 0 and "10 (kept beyond keep=2: the newest step rank 1 holds" in out, out
    code, out = run("ckpt", "gc", JOB, "--rank", "0", "--keep", "2")
    assert code == 0, out
    assert shared(tmp_path, 0) == [10, 15, 20], out
    assert FsTier("shm", str(tmp_path / "shm"), JOB, 0).steps() == [15, 20], out
    assert "shared   deleted 1, kept step(s) 10 beyond keep=2 (the newest step rank 1 holds, " \
        "which a restart restores)" in out, out


def test_ckpt_gc_deletes_nothing_on_a_durable_tier_while_a_rank_holds_no_step(
        tmp_path: Path) -> None:
    """Rank 1 of 2 has not written the shared tier yet: its first step there may be any
    step rank 0 holds, so gc deletes none of them (the writer's rule: floor unknown)."""
    _saved(tmp_path, 0, 10, 15, 20)
    code, out = _cli(tmp_path)("ckpt", "gc", JOB, "--keep", "2")
    assert code == 0, out
    assert shared(tmp_path, 0) == [10, 15, 20], out
    assert "shared   deleted 0, kept step(s) 10 beyond keep=2 (the step a restart restores is " \
        "not known: rank 1 holds no step there yet)" in out, out
