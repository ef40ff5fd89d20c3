#!/usr/bin/python3 -I
"""A deterministic training loop with tiered checkpoints: what a job author copies.

Run one rank per node under srun. Each rank restores the newest step that every rank holds
verified (they agree through a file per rank on the shared filesystem), trains to --steps,
saves every --every steps to node memory with write-back to the shared filesystem, and rank 0
writes the final state's checksum. `--reference` computes the same final state in one process
without any checkpoint, for comparison.

    srun python3 -I ckpt/train_example.py --steps 40 --every 5 --mb 16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from gpuwarden.ckpt.checkpointer import Checkpointer
from gpuwarden.ckpt.codec import checksum
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.restore import restore


def initial(rank: int, mb: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 + rank)
    return {"w": rng.standard_normal(mb << 18).astype(np.float32),
            "step": np.array([0], dtype=np.int64)}


def train_step(state: dict[str, np.ndarray], step: int) -> None:
    w = state["w"]
    w *= np.float32(0.999)
    w += np.float32((step % 7) * 1e-3)
    state["step"][0] = step


def agree(coord: Path, rank: int, world: int, mine: list[int], timeout: float = 120) -> int | None:
    """The newest step every rank holds: each rank publishes its list, all read all."""
    coord.mkdir(parents=True, exist_ok=True)
    tmp = coord / f".rank-{rank}.tmp"
    tmp.write_text(json.dumps(mine))
    os.replace(tmp, coord / f"rank-{rank}.json")
    deadline = time.monotonic() + timeout
    while True:
        files = [coord / f"rank-{r}.json" for r in range(world)]
        if all(f.exists() for f in files):
            common = set.intersection(*(set(json.loads(f.read_text())) for f in files))
            return max(common) if common else None
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {rank}: the other ranks did not report within {timeout} s")
        time.sleep(0.2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--mb", type=int, default=16)
    ap.add_argument("--step-s", type=float, default=1.0)
    ap.add_argument("--shared", default="/fsx/gpuwarden-ckpt")
    # Steps kept per tier. Ranks that outlive a failed peer keep training until Slurm stops
    # them: keep enough that the steps the failed rank reached are still held by all.
    ap.add_argument("--keep", type=int, default=100)
    ap.add_argument("--reference", type=int, default=0, help="world size: compute, no ckpt")
    args = ap.parse_args()
    if args.reference:
        states = [initial(r, args.mb) for r in range(args.reference)]
        for step in range(1, args.steps + 1):
            for s in states:
                train_step(s, step)
        print(json.dumps([checksum(memoryview(s["w"]).cast("B")) for s in states]))
        return 0
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    job = f"job-{os.environ['SLURM_JOB_ID']}"
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    memory = "/dev/shm/gpuwarden-ckpt"  # noqa: S108 - tier 0; the job's directory is private
    ck = Checkpointer(job, FsTier("memory", memory, job, rank),
                      [FsTier("shared", args.shared, job, rank)], rank=rank, world_size=world,
                      keep=args.keep)
    shared = FsTier("shared", args.shared, job, rank)
    shared.ensure_dir()  # the job's private directory, where the agreement files go too
    mine = sorted({s for t in (ck.tier0, *ck.durable) for s in t.steps()})
    start = agree(Path(args.shared) / job / f"agree-{restarts}", rank, world, mine)
    state = initial(rank, args.mb)
    if start is not None:
        got = ck.restore()
        if got is None or got.step < start:
            print(f"rank {rank}: cannot restore step {start}", file=sys.stderr)
            return 1
        if got.step != start:  # newer than the others hold: take the agreed one
            got = restore([ck.tier0, *ck.durable], at_most=start)
            assert got is not None and got.step == start
        state = {k: np.array(v) for k, v in got.state.items()}
        print(f"rank {rank}: restored step {got.step} from {got.tier} (restart {restarts})",
              flush=True)
    first = int(state["step"][0]) + 1
    for step in range(first, args.steps + 1):
        train_step(state, step)
        time.sleep(args.step_s)
        if step % args.every == 0 or step == args.steps:
            ck.save(step, state)
            print(f"rank {rank}: step {step} saved", flush=True)
    ck.wait_durable(args.steps, timeout=300)
    ck.close(timeout=60)
    (Path(args.shared) / job / f"final-rank-{rank}.txt").write_text(
        checksum(memoryview(state["w"]).cast("B")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
