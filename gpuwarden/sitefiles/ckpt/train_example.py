#!/usr/bin/python3 -I
"""A deterministic training loop with tiered checkpoints: what a job author copies.

Run one rank per node under srun (or through ckpt/train.sbatch). Each rank restores the
newest step every rank holds verified (JobCheckpointer: the ranks agree), trains to
--steps, saves every --every steps to node memory, with replicas on a peer node and write-back
to the shared filesystem (and S3 when [ckpt] names a bucket), and writes its final state's
checksum. On SIGUSR1 (the time limit is near) it saves at once, waits until that step is
durable and exits 75 so that the template requeues the job. `--reference` computes the same
final state in one process without any checkpoint, for comparison.

    srun python3 -I ckpt/train_example.py --steps 40 --every 5 --mb 16
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from gpuwarden.ckpt import EXIT_REQUEUE, JobCheckpointer, TierFull, checksum


def initial(rank: int, mb: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 + rank)
    return {"w": rng.standard_normal(mb << 18).astype(np.float32),
            "step": np.array([0], dtype=np.int64)}


def train_step(state: dict[str, np.ndarray], step: int) -> None:
    w = state["w"]
    w *= np.float32(0.999)
    w += np.float32((step % 7) * 1e-3)
    state["step"][0] = step


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--mb", type=int, default=16)
    ap.add_argument("--step-s", type=float, default=1.0)
    ap.add_argument("--config", default=None, help="gpuwarden.toml ([ckpt] says where tiers are)")
    ap.add_argument("--reference", type=int, default=0, help="world size: compute, no ckpt")
    args = ap.parse_args()
    if args.reference:
        states = [initial(r, args.mb) for r in range(args.reference)]
        for step in range(1, args.steps + 1):
            for s in states:
                train_step(s, step)
        print(json.dumps([checksum(s["w"].data.cast("B")) for s in states]))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ck = JobCheckpointer.from_slurm(args.config)  # also handles SIGUSR1: save now, requeue
    rank, restarts = ck.env.rank, ck.env.restarts
    state = initial(rank, args.mb)
    got = ck.restore()  # the same step on every rank, or None
    if got is not None:
        state = {k: np.array(v) for k, v in got.state.items()}
        print(f"rank {rank}: restored step {got.step} from {got.tier} (restart {restarts})",
              flush=True)
    first = int(state["step"][0]) + 1
    for step in range(first, args.steps + 1):
        train_step(state, step)
        time.sleep(args.step_s)
        stop = ck.stop_step(step) == step  # every rank stops at the same step
        if step % args.every == 0 or step == args.steps or stop:
            try:
                ck.save(step, state)
            except TierFull as exc:  # node memory is full: stop cleanly, nothing is lost
                print(f"rank {rank}: {exc}; stopping: the newest durable step is "
                      f"{ck.ck.durable_step()}", file=sys.stderr, flush=True)
                ck.finish(None)
                return 1
            print(f"rank {rank}: step {step} saved", flush=True)
        if stop and step < args.steps:
            durable = ck.finish(step, timeout=120)
            print(f"rank {rank}: emergency save of step {step} "
                  f"{'durable' if durable else 'NOT durable'}; exiting for requeue", flush=True)
            return EXIT_REQUEUE
    ck.finish(args.steps, timeout=300)
    final = checksum(state["w"].data.cast("B"))
    # In the job's log too: a site without a shared filesystem has nowhere common to write it.
    print(f"rank {rank}: final checksum {final}", flush=True)
    shared = ck.cfg.shared_root
    if shared:
        (Path(shared) / ck.env.job / f"final-rank-{rank}.txt").write_text(final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
