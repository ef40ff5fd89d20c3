#!/usr/bin/python3 -I
"""PyTorch DDP training with tiered checkpoints: the torch example a job author copies.

One rank per node under srun (ckpt/train.sbatch with TRAIN set to this script), over gloo (CPU)
or nccl (GPUs). The checkpoint is the model's and the optimizer's state_dict, as a torch
script already has them: two lines change from torch.save/torch.load (marked below). Each rank
restores the newest step every rank holds verified, trains to --steps, saves every --every
steps to node memory (peers and the shared filesystem behind), and on SIGUSR1 saves at once
and exits 75 for the template to requeue. `--reference N` runs the same training
uninterrupted, N ranks over loopback on CPU, without checkpoints: a CPU job's final weights
must match it bit for bit (on GPUs, compare with an uninterrupted job of the same shape).

    TRAIN="/opt/gpuwarden/venv/bin/python -I /opt/gpuwarden/ckpt/train_torch_example.py" \
        sbatch -N 4 train.sbatch --steps 60 --every 5
"""

# No `from __future__ import annotations`: DDP checks the comm hook's annotations at run time.
import argparse
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.spawn import start_processes
from torch.nn.parallel import DistributedDataParallel

from gpuwarden.ckpt import EXIT_REQUEUE, JobCheckpointer, expand_hostlist


def device(gpus: bool) -> torch.device:
    """This rank's GPU (one per task: SLURM_LOCALID), or the CPU."""
    if gpus:
        dev = torch.device("cuda", int(os.environ.get("SLURM_LOCALID", "0")))
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def build(width: int, dev: torch.device) -> tuple[Any, Any]:
    torch.manual_seed(0)  # DDP broadcasts rank 0's weights anyway; every rank starts alike
    model = nn.Sequential(nn.Linear(64, width), nn.GELU(), nn.Linear(width, 64)).to(dev)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def batch(rank: int, step: int, dev: torch.device) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(rank * 1_000_003 + step)
    x = torch.randn(32, 64, generator=g).to(dev)
    return x, torch.sin(x)


def train_step(ddp: Any, opt: Any, rank: int, step: int, dev: torch.device) -> None:
    x, y = batch(rank, step, dev)
    loss = nn.functional.mse_loss(ddp(x), y)
    opt.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]  # DDP averages gradients over ranks here
    opt.step()


def per_parameter_allreduce(_state: object, bucket: dist.GradBucket  # type: ignore[name-defined]
                            ) -> torch.futures.Future[torch.Tensor]:
    """DDP's gradient all-reduce, one parameter at a time. DDP groups gradients into buckets,
    and regroups them after the first iteration of every run in the order backward produced
    them; with more than two ranks, where a value falls in a bucket decides the order in which
    the ring all-reduce adds the ranks' values, so a resumed run (whose first iteration uses the
    initial grouping) would drift from an uninterrupted one by float rounding. Reducing each
    parameter on its own makes the sums independent of the grouping: bit-identical resumes."""
    for grad in bucket.gradients():  # views into the bucket's buffer, the same order on all ranks
        dist.all_reduce(grad)
    buf = bucket.buffer()
    buf.div_(dist.get_world_size())
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def wrap(model: Any, dev: torch.device) -> Any:
    ddp = DistributedDataParallel(model, device_ids=[dev] if dev.type == "cuda" else None)
    ddp.register_comm_hook(None, per_parameter_allreduce)
    return ddp


def digest(model: Any) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode() + t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def init(rank: int, world: int, addr: str, port: int, gpus: bool) -> None:
    os.environ.setdefault("MASTER_ADDR", addr)
    os.environ.setdefault("MASTER_PORT", str(port))
    # Debian's torch is built without libuv, the rendezvous store's default since 2.4; the
    # classic store serves a rendezvous of a few ranks as well.
    os.environ.setdefault("USE_LIBUV", "0")
    dist.init_process_group("nccl" if gpus else "gloo", rank=rank, world_size=world)


def reference(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    cpu = torch.device("cpu")  # the reference is the CPU run's: gloo's sums, not NCCL's
    init(rank, world, "127.0.0.1", port, gpus=False)
    model, opt = build(args.width, cpu)
    ddp = wrap(model, cpu)
    for step in range(1, args.steps + 1):
        train_step(ddp, opt, rank, step, cpu)
    if rank == 0:
        print(json.dumps([digest(model)] * world), flush=True)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--step-s", type=float, default=1.0)
    ap.add_argument("--config", default=None, help="gpuwarden.toml ([ckpt] says where tiers are)")
    ap.add_argument("--reference", type=int, default=0, help="world size: run locally, no ckpt")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the same arithmetic on every node, and in the reference run
    if args.reference:
        port = 29000 + os.getpid() % 1000
        start_processes(reference, args=(args.reference, args, port),  # type: ignore[no-untyped-call]
                        nprocs=args.reference, start_method="spawn")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ck = JobCheckpointer.from_slurm(args.config)  # also handles SIGUSR1: save now, requeue
    env = ck.env
    first_node = expand_hostlist(os.environ["SLURM_JOB_NODELIST"])[0]
    # A fresh port per run of the job: the last run's may still be in TIME_WAIT.
    job_id = int(os.environ["SLURM_JOB_ID"])
    gpus = torch.cuda.is_available()
    init(env.rank, env.world_size, first_node, 20000 + (job_id * 7 + env.restarts) % 20000, gpus)
    dev = device(gpus)
    model, opt = build(args.width, dev)
    got = ck.restore()  # was: torch.load(path); the same step on every rank, or None
    first = 1
    if got is not None:
        model.load_state_dict(got.state["model"])
        opt.load_state_dict(got.state["optim"])
        first = got.state["step"] + 1
        print(f"rank {env.rank}: restored step {got.step} from {got.tier} "
              f"(restart {env.restarts})", flush=True)
    ddp = wrap(model, dev)
    for step in range(first, args.steps + 1):
        train_step(ddp, opt, env.rank, step, dev)
        time.sleep(args.step_s)
        stop = ck.stop_step(step) == step  # every rank stops at the same step
        if step % args.every == 0 or step == args.steps or stop:
            # was: torch.save({...}, path)
            ck.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "step": step})
            print(f"rank {env.rank}: step {step} saved", flush=True)
        if stop and step < args.steps:
            durable = ck.finish(step, timeout=120)
            print(f"rank {env.rank}: emergency save of step {step} "
                  f"{'durable' if durable else 'NOT durable'}; exiting for requeue", flush=True)
            return EXIT_REQUEUE
    ck.finish(args.steps, timeout=300)
    (Path(ck.cfg.shared_root) / env.job / f"final-rank-{env.rank}.txt").write_text(digest(model))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
