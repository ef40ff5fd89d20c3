"""Checkpoints at memory speed, on this host's /dev/shm: each goal a ratio from one run.

A state of `--mb` MiB (float32), the median of `--repeat` runs of each, the arms interleaved:
- save stall: `Checkpointer.save` into tier 0 (write-back behind) against a raw `write()` of
  the same bytes to a file on the same tmpfs. Goal: <= 1.25.
- restore: `Checkpointer.restore(mapped=True)` from tier 0 (pages mapped copy-on-write,
  every checksum verified, arrays rebuilt) against a plain in-memory copy of the state into
  fresh memory. Goal: restore speed >= 1.0x the copy's (printed as copy time / restore time);
  the default restore, which copies into the caller's own memory, is printed beside it. A
  mapped restore maps each page where the caller first reads it, so the time of a restore
  followed by load_state_dict's copy into the model is printed too, mapped against default.
- torch: the same bytes as torch tensors in a state_dict against the numpy state, save stall.
  Goal: <= 1.1.
- DCP: `dcp.save` through gpuwarden's writer against DCP's own FileSystemWriter to the same
  /dev/shm, save stall (durable copies written behind). Goal: <= 1.0. Once in one process,
  and once with `--ranks` real ranks over gloo (default 2) saving a replicated state, which
  DCP spreads over the ranks: the stall is from a barrier before the save to one after it.
Needs torch (`make venv` installs it).

    .venv/bin/python benchmarks/ckpt_memory.py [--mb 256] [--repeat 5] [--ranks 2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed import checkpoint as dcp

from gpuwarden.ckpt.checkpointer import Checkpointer
from gpuwarden.ckpt.dcp import dcp_writer
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.job import JobCheckpointer, JobEnv
from gpuwarden.config.ckpt import CkptConfig

# The tier being measured: /dev/shm, or GPUWARDEN_BENCH_SHM (a tmpfs mounted huge=within_size,
# as docs/checkpointing.md recommends for tier 0).
SHM = os.environ.get("GPUWARDEN_BENCH_SHM", "/dev/shm")  # noqa: S108


def best(arms: dict[str, Callable[[int], Any]], repeat: int,
         settle: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Each arm's median time of ``repeat``, the arms interleaved so that a noisy moment of the
    machine hits both sides of a ratio alike (use an odd count); ``settle`` runs untimed after each call (the
    work an arm leaves to a background thread must not land in the next arm's time)."""
    times: dict[str, list[float]] = {k: [] for k in arms}
    for i in range(repeat):
        # The order flips every round: an arm run right after another pays for what that one
        # left behind (freed pages, cache), and that must not always be the same arm.
        order = list(arms.items()) if i % 2 == 0 else list(reversed(arms.items()))
        for name, fn in order:
            t0 = time.perf_counter()
            fn(i)
            times[name].append(time.perf_counter() - t0)
            settle()
    # The median: on a small shared machine the minimum is one lucky run of one arm.
    return {k: statistics.median(v) for k, v in times.items()}


def pruned(*cks: Checkpointer) -> Callable[[], None]:
    """Wait until each checkpointer's tier 0 holds its `keep` steps (retention runs beside
    the save)."""
    def settle() -> None:
        for ck in cks:
            deadline = time.monotonic() + 30
            while len(ck.tier0.steps()) > ck.keep and time.monotonic() < deadline:
                time.sleep(0.002)
    return settle


def tier0(work: Path, job: str) -> Checkpointer:
    # As gpuwarden.ckpt.build makes tier 0: restores map its pages.
    return Checkpointer(job, FsTier("memory", str(work / job), job, map_reads=True), [], keep=1)


def numpy_arms(state: dict[str, Any], work: Path, repeat: int) -> dict[str, float]:
    blob = b"".join(a.tobytes() for a in state.values())

    def raw_write(i: int) -> None:
        # Kept until the end: removing a file is not part of writing it (the save's tier-0
        # retention, too, runs beside the save; `settle` waits for it outside the timing).
        fd = os.open(work / f"raw-{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    ck = tier0(work, "job-1")

    def copy(_: int) -> None:
        for a in state.values():
            np.copyto(np.empty_like(a), a)

    dest = {k: np.empty_like(a) for k, a in state.items()}
    for a in dest.values():
        a.fill(0)  # the model's own parameters: memory already in use

    def load_into(mapped: bool) -> None:
        # What load_state_dict does with what a restore returns: copy it into the model's
        # parameters. A mapped restore's pages are mapped here, where they are first read.
        got = ck.restore(mapped=mapped)
        assert got is not None
        for k, a in dest.items():
            np.copyto(a, got.state[k])

    try:
        out = best({"raw_write": raw_write, "save": lambda i: ck.save(i + 1, state)}, repeat,
                   pruned(ck))
        out.update(best({"copy": copy, "restore": lambda _: ck.restore(mapped=True),
                         "restore_copied": lambda _: ck.restore()}, repeat))
        out.update(best({"load_mapped": lambda _: load_into(True),
                         "load_copied": lambda _: load_into(False)}, repeat))
    finally:
        ck.close()
    return out


def torch_arms(state: dict[str, Any], work: Path, disk: Path, repeat: int) -> dict[str, float]:
    tstate = {k: torch.from_numpy(v) for k, v in state.items()}
    ck_n, ck_t = tier0(work, "job-2"), tier0(work, "job-3")
    try:
        out = best({"numpy_save": lambda i: ck_n.save(i + 1, state),
                    "torch_save": lambda i: ck_t.save(i + 1, tstate)}, repeat,
                   pruned(ck_n, ck_t))
    finally:
        ck_n.close()
        ck_t.close()
    jc = JobCheckpointer(CkptConfig(memory_root=str(work / "dcp0"), shared_root=str(disk),
                                    keep=1), JobEnv("4", 0, 1, 0, "0", "bench"))

    def dcp_fs(i: int) -> None:
        dcp.save(tstate, storage_writer=dcp.FileSystemWriter(str(work / f"fs{i}")), no_dist=True)
        shutil.rmtree(work / f"fs{i}")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        out.update(best({"dcp_fs": dcp_fs, "dcp_ours": lambda i: dcp.save(
            tstate, storage_writer=dcp_writer(jc, i + 1), no_dist=True)}, repeat))
    jc.finish(repeat, timeout=300)  # the durable copies, written behind
    return out


def _rank_arms(rank: int, ranks: int, work: str, disk: str, mb: int, repeat: int,
               out: str) -> None:
    """One rank of the `--ranks` arm: each save timed from a barrier to a barrier, so the
    stall is the slowest rank's; durable copies and removals are waited for untimed."""
    import torch.distributed as dist  # noqa: PLC0415

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback: not the hostname's address
    dist.init_process_group("gloo", rank=rank, world_size=ranks, init_method=f"file://{work}/pg")
    n = mb << 18
    tstate = {f"w{i}": torch.from_numpy(
        np.random.default_rng(i).standard_normal(n // 4).astype(np.float32)) for i in range(4)}
    jc = JobCheckpointer(CkptConfig(memory_root=f"{work}/mem{rank}", shared_root=disk, keep=1,
                                    peer_replicas=0, agree_timeout_s=120.0),
                         JobEnv("5", rank, ranks, 0, "0", f"bench{rank}"))

    def timed(fn: Callable[[], Any], settle: Callable[[], Any]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        took = time.perf_counter() - t0
        settle()
        dist.barrier()
        return took

    def fs_dir(i: int) -> str:
        return f"{work}/fs{i}"

    times: dict[str, list[float]] = {"dcp_fs_ranks": [], "dcp_ours_ranks": []}
    for i in range(repeat):
        arms = [("dcp_fs_ranks", lambda i=i: dcp.save(
                    tstate, storage_writer=dcp.FileSystemWriter(fs_dir(i))),
                 lambda i=i: rank == 0 and shutil.rmtree(fs_dir(i))),
                ("dcp_ours_ranks", lambda i=i: dcp.save(
                    tstate, storage_writer=dcp_writer(jc, i + 1)),
                 lambda i=i: jc.wait_durable(i + 1, timeout=300))]
        for name, fn, settle in (arms if i % 2 == 0 else arms[::-1]):
            times[name].append(timed(fn, settle))
    jc.finish(repeat, timeout=300)
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(repr({k: statistics.median(v) for k, v in times.items()}))


def ranks_arms(work: Path, disk: Path, mb: int, repeat: int, ranks: int) -> dict[str, float]:
    import ast  # noqa: PLC0415

    out = work / "ranks.out"
    torch.multiprocessing.start_processes(
        _rank_arms, args=(ranks, str(work), str(disk / "ranks"), mb, repeat, str(out)),
        nprocs=ranks, start_method="spawn")
    got: dict[str, float] = ast.literal_eval(out.read_text())
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the DCP arm over gloo")
    args = ap.parse_args()
    n = args.mb << 18  # float32 values
    state = {f"w{i}": np.random.default_rng(i).standard_normal(n // 4).astype(np.float32)
             for i in range(4)}
    work = Path(tempfile.mkdtemp(prefix="gw-bench-", dir=SHM))
    disk = Path(tempfile.mkdtemp(prefix="gw-bench-"))
    try:
        out = numpy_arms(state, work, args.repeat)
        out.update(torch_arms(state, work, disk, args.repeat))
        out.update(ranks_arms(work, disk, args.mb, args.repeat, args.ranks))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    print(f"state {args.mb} MiB, median of {args.repeat}; seconds: "
          f"{ {k: round(v, 4) for k, v in out.items()} }")
    print(f"save stall / raw write:             {out['save'] / out['raw_write']:.2f}  (goal <= 1.25)")
    print(f"restore speed / memory copy:        {out['copy'] / out['restore']:.2f}  (goal >= 1.0; "
          f"mapped=True; the default restore, which copies: "
          f"{out['copy'] / out['restore_copied']:.2f})")
    print(f"  restored and copied into the model's arrays, mapped / default restore: "
          f"{out['load_mapped'] / out['load_copied']:.2f}  (time; below 1: mapping pays)")
    print(f"torch save / numpy save:            {out['torch_save'] / out['numpy_save']:.2f}  "
          "(goal <= 1.1)")
    print(f"DCP via gpuwarden / FileSystemWriter: {out['dcp_ours'] / out['dcp_fs']:.2f}  "
          "(goal <= 1.0)")
    print(f"  the same, {args.ranks} ranks over gloo:       "
          f"{out['dcp_ours_ranks'] / out['dcp_fs_ranks']:.2f}  (goal <= 1.0)")


if __name__ == "__main__":
    main()
