"""torch.distributed.checkpoint through gpuwarden, two real ranks on CPU over gloo: a replicated
tensor (DCP writes it once, the other rank reads it from the shared tier), a tensor sharded
across the ranks, and plain objects save and load bit for bit; a corrupted item walks back to
the previous step on every rank."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.torchreq import torch

dist = torch.distributed
mp = torch.multiprocessing
WORLD = 2
pytestmark = pytest.mark.timeout(240)


def expected(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"replicated": torch.randn(64, 8, generator=g).to(torch.bfloat16),
            "sharded": torch.randn(16, 4, generator=g, dtype=torch.float64),
            "extra": {"epoch": step // 10, "lr": 3e-4 * step}}


def _state(step: int | None, mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    want = expected(step if step is not None else 0)
    if step is None:  # what a restarted job builds before loading: the wrong values
        want = {"replicated": torch.zeros_like(want["replicated"]),
                "sharded": torch.zeros_like(want["sharded"]), "extra": {"epoch": 0, "lr": 0.0}}
    return {"replicated": want["replicated"],
            "sharded": distribute_tensor(want["sharded"], mesh, [Shard(0)]),
            "extra": want["extra"]}


def _worker(rank: int, root: str, phase: str, restarts: int, want_step: int | None) -> None:
    from torch.distributed import checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from gpuwarden.ckpt.dcp import dcp_reader, dcp_writer
    from gpuwarden.ckpt.job import JobCheckpointer, JobEnv
    from gpuwarden.config.ckpt import CkptConfig

    # Loopback only: gloo otherwise picks the address the hostname resolves to.
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            init_method=f"file://{root}/pg-{phase}-{restarts}")
    mesh = init_device_mesh("cpu", (WORLD,))
    cfg = CkptConfig(memory_root=f"{root}/mem{rank}", shared_root=f"{root}/shared",
                     peer_replicas=0, agree_timeout_s=60.0)
    ck = JobCheckpointer(cfg, JobEnv("77", rank, WORLD, restarts, "0", f"n{rank}"))
    try:
        if phase == "save":
            for step in (10, 20):
                dcp.save(_state(step, mesh), storage_writer=dcp_writer(ck, step))
            assert ck.finish(20, timeout=60)
            return
        reader = dcp_reader(ck)
        assert reader.step == want_step, (rank, reader.step)
        state = _state(None, mesh)
        dcp.load(state, storage_reader=reader)
        assert want_step is not None
        want = expected(want_step)
        assert torch.equal(state["replicated"].view(torch.int16),
                           want["replicated"].view(torch.int16))
        assert torch.equal(state["sharded"].full_tensor(), want["sharded"])
        assert state["extra"] == want["extra"]
        ck.finish(None)
    finally:
        dist.destroy_process_group()


def run(root: Path, phase: str, restarts: int, want_step: int | None = None) -> None:
    mp.start_processes(_worker, args=(str(root), phase, restarts, want_step), nprocs=WORLD,
                       start_method="spawn")


def test_dcp_saves_and_loads_through_the_tiers_and_walks_back_past_a_corrupt_item(
        tmp_path: Path) -> None:
    run(tmp_path, "save", 0)
    shared = tmp_path / "shared" / "job-77"
    assert sorted(p.name for p in (shared / "rank-00000").iterdir()
                  if p.name.startswith("step-")) == ["step-000000000010", "step-000000000020"]
    run(tmp_path, "load", 1, want_step=20)

    # Rank 0 wrote the replicated tensor for both ranks: flip one byte of it in step 20 on the
    # shared tier, where rank 1 reads it (rank 0's node memory still holds a good copy). The
    # load must not use step 20 on either rank: both take step 10.
    for tier in (tmp_path / "shared" / "job-77",):
        step20 = tier / "rank-00000" / "step-000000000020"
        shard = max((p for p in step20.iterdir() if p.name.startswith("n")),
                    key=lambda p: p.stat().st_size)
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        os.chmod(shard, 0o600)
        shard.write_bytes(bytes(raw))
    run(tmp_path, "load", 2, want_step=10)


def test_a_job_with_no_checkpoint_loads_nothing(tmp_path: Path) -> None:
    # A fresh job: reader.step is None on every rank and the script starts from scratch.
    mp.start_processes(_fresh, args=(str(tmp_path),), nprocs=WORLD, start_method="spawn")


def _fresh(rank: int, root: str) -> None:
    from gpuwarden.ckpt.dcp import dcp_reader
    from gpuwarden.ckpt.job import JobCheckpointer, JobEnv
    from gpuwarden.config.ckpt import CkptConfig

    cfg = CkptConfig(memory_root=f"{root}/mem{rank}", shared_root=f"{root}/shared",
                     peer_replicas=0, agree_timeout_s=60.0)
    ck = JobCheckpointer(cfg, JobEnv("78", rank, WORLD, 0, "0", f"n{rank}"))
    assert dcp_reader(ck).step is None
    ck.finish(None)


def test_async_save_writes_the_staged_values_while_training_goes_on(tmp_path: Path) -> None:
    """dcp.async_save stages the state, then writes it through gpuwarden in the background:
    the step holds the values of the moment of the call, not what training did after."""
    from torch.distributed import checkpoint as dcp

    from gpuwarden.ckpt.dcp import dcp_reader, dcp_writer
    from gpuwarden.ckpt.job import JobCheckpointer, JobEnv
    from gpuwarden.config.ckpt import CkptConfig

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/pg")
    try:
        cfg = CkptConfig(memory_root=str(tmp_path / "m"), shared_root=str(tmp_path / "s"))
        ck = JobCheckpointer(cfg, JobEnv("9", 0, 1, 0, "0", "n1"))
        state = {"w": torch.arange(1000, dtype=torch.float32)}
        pending = dcp.async_save(state, storage_writer=dcp_writer(ck, 3))
        state["w"].add_(100.0)  # the next training step, while the save is written
        pending.result(timeout=60)
        assert ck.finish(3, timeout=60)
        reader = dcp_reader(JobCheckpointer(cfg, JobEnv("9", 0, 1, 1, "0", "n1")))
        assert reader.step == 3
        out = {"w": torch.zeros(1000)}
        dcp.load(out, storage_reader=reader)
        assert torch.equal(out["w"], torch.arange(1000, dtype=torch.float32))
    finally:
        dist.destroy_process_group()


def test_a_job_of_one_rank_without_a_shared_tier_loads_from_node_memory(tmp_path: Path) -> None:
    """No durable tier: the one rank's items are all in node memory, which it restores from;
    nothing there is taken for "an earlier run" and deleted."""
    from torch.distributed import checkpoint as dcp

    from gpuwarden.ckpt.dcp import dcp_reader, dcp_writer
    from gpuwarden.ckpt.job import JobCheckpointer, JobEnv
    from gpuwarden.config.ckpt import CkptConfig

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/pg")
    try:
        cfg = CkptConfig(memory_root=str(tmp_path / "m"))
        ck = JobCheckpointer(cfg, JobEnv("8", 0, 1, 0, "0", "n1"))
        dcp.save({"w": torch.arange(5.0)}, storage_writer=dcp_writer(ck, 10))
        ck.finish(None)
        reader = dcp_reader(JobCheckpointer(cfg, JobEnv("8", 0, 1, 1, "0", "n1")))
        assert reader.step == 10
        out = {"w": torch.zeros(5)}
        dcp.load(out, storage_reader=reader)
        assert torch.equal(out["w"], torch.arange(5.0))
        assert (tmp_path / "m" / "job-8" / "rank-00000" / "step-000000000010").is_dir()
    finally:
        dist.destroy_process_group()


# ---- a second review (issue 15) -------------------------------------------------------------
def _writer(rank: int) -> Any:
    from types import SimpleNamespace

    from gpuwarden.ckpt.dcp import GpuwardenWriter
    return GpuwardenWriter(SimpleNamespace(env=SimpleNamespace(rank=rank)), 10)  # type: ignore[arg-type]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_save_without_collectives_is_refused_before_anything_is_written(rank: int) -> None:
    # dcp.save(..., use_collectives=False) makes every rank its own coordinator: rank 1's
    # items were replaced by an empty step, and a load gave zeros without an error.
    from gpuwarden.ckpt.codec import StateError
    with pytest.raises(StateError, match="use_collectives=False"):
        _writer(rank).set_up_storage_writer(rank == 0, rank=rank, use_collectives=False)


def test_a_checkpoint_id_that_is_no_step_number_names_itself() -> None:
    from gpuwarden.ckpt.codec import StateError
    w = _writer(0)
    with pytest.raises(StateError, match=r"checkpoint_id '/fsx/ckpt/step-10'.*step number"):
        w.reset("/fsx/ckpt/step-10")
    w.reset(20)
    assert w.step == 20


def test_a_per_rank_metadata_read_is_refused_so_no_rank_loads_alone() -> None:
    # After one failed global read DCP retried with rank=, and a rank that got an answer
    # loaded without collectives while the others waited in them.
    from gpuwarden.ckpt.codec import StateError
    from gpuwarden.ckpt.dcp import GpuwardenReader
    reader = GpuwardenReader.__new__(GpuwardenReader)
    reader.step = 10
    with pytest.raises(StateError, match="no per-rank"):
        reader.read_metadata(rank=1)


# ---- the coordinator's stall (issue 15) ------------------------------------------------------
def test_the_coordinator_writes_its_items_before_finish_and_commits_only_the_metadata_then(
        tmp_path: Path) -> None:
    """The coordinator's items used to be written in `finish`, after every other rank's write
    was done: the save's stall was two writes long. They go out in `write_data` now, beside
    the others'; the step stays invisible until `finish` adds the metadata."""
    from torch.distributed import checkpoint as dcp

    from gpuwarden.ckpt.dcp import GpuwardenWriter, dcp_reader
    from gpuwarden.ckpt.job import JobCheckpointer, JobEnv
    from gpuwarden.config.ckpt import CkptConfig

    seen: dict[str, Any] = {}

    class Watched(GpuwardenWriter):
        def finish(self, metadata: Any, results: Any) -> None:
            rank_dir = tmp_path / "m" / "job-6" / "rank-00000"
            seen["visible"] = self.ck.ck.tier0.steps()
            seen["written"] = sum(f.stat().st_size for d in rank_dir.glob(".step-*")
                                  for f in d.iterdir())
            super().finish(metadata, results)

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/pg")
    try:
        cfg = CkptConfig(memory_root=str(tmp_path / "m"))
        ck = JobCheckpointer(cfg, JobEnv("6", 0, 1, 0, "0", "n1"))
        w = torch.arange(1 << 16, dtype=torch.float32)
        dcp.save({"w": w}, storage_writer=Watched(ck, 4))
        assert seen["visible"] == []
        assert seen["written"] >= w.numel() * 4
        ck.finish(None)
        reader = dcp_reader(JobCheckpointer(cfg, JobEnv("6", 0, 1, 1, "0", "n1")))
        assert reader.step == 4
        out = {"w": torch.zeros(1 << 16)}
        dcp.load(out, storage_reader=reader)
        assert torch.equal(out["w"], w)
        assert [p.name for p in (tmp_path / "m" / "job-6" / "rank-00000").iterdir()] == \
            ["step-000000000004"]
    finally:
        dist.destroy_process_group()


def test_a_save_that_fails_at_finish_leaves_no_step_and_no_temp_dir(tmp_path: Path,
                                                                    monkeypatch: Any) -> None:
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from gpuwarden.ckpt import dcp as gw_dcp
    from gpuwarden.ckpt.job import JobCheckpointer, JobEnv
    from gpuwarden.config.ckpt import CkptConfig

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/pg")
    try:
        ck = JobCheckpointer(CkptConfig(memory_root=str(tmp_path / "m")),
                             JobEnv("7", 0, 1, 0, "0", "n1"))
        dcp.save({"w": torch.ones(8)}, storage_writer=gw_dcp.dcp_writer(ck, 1))

        def broken(_md: Any) -> bytes:
            raise OSError("no metadata today")
        monkeypatch.setattr(gw_dcp, "_dump_metadata", broken)
        with pytest.raises(CheckpointException):  # DCP's wrapper of the OSError
            dcp.save({"w": torch.zeros(8)}, storage_writer=gw_dcp.dcp_writer(ck, 2))
        ck.finish(None)
        assert [p.name for p in (tmp_path / "m" / "job-7" / "rank-00000").iterdir()] == \
            ["step-000000000001"]
    finally:
        dist.destroy_process_group()
