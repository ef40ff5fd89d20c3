"""The launcher end to end with local processes as ranks (fake node names, real
JobCheckpointer, real heartbeats): a node is killed, a spare takes over, the run finishes with
the state of an uninterrupted one; with no spare left the launcher asks for a requeue."""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuwarden.launch.launcher import launch
from gpuwarden.launch.localsteps import LocalSteps
from gpuwarden.launch.report import Events, Recorded
from gpuwarden.launch.settings import EXIT_REQUEUE, LaunchSettings

pytestmark = pytest.mark.timeout(120)

# A training rank as a job author writes one: restore, train (each step waits for every rank,
# as a collective would), save every EVERY steps. At step HOLD, once that step is durable, it
# waits for the test's "go": the test kills a node while every rank is there.
RANK = """
import hashlib, json, os, sys, time
from pathlib import Path
import numpy as np
from gpuwarden.ckpt.job import JobCheckpointer

cfg_dir, out = sys.argv[1], Path(sys.argv[2])
steps, every, hold = (int(a) for a in sys.argv[3:6])
node = os.environ["SLURMD_NODENAME"]
ck = JobCheckpointer.from_slurm(f"{cfg_dir}/{node}.toml")
rank, run = ck.env.rank, ck.env.run
w = np.full(4096, float(rank + 1))
got = ck.restore()
if got is not None:
    w = np.array(got.state["w"])
(out / f"restored-{run}-rank{rank}.json").write_text(json.dumps(
    {"node": node, "step": got and got.step, "tier": got and got.tier}))
for step in range((got.step + 1) if got else 1, steps + 1):
    w = w * 0.5 + step
    ck.coord.exchange(f"train-{run}-{step}", rank, 60)
    if step % every == 0 or step == steps:
        ck.save(step, {"w": w})
    ck.progress(step)
    if step == hold:
        ck.wait_durable(step, 30)
        (out / f"held-rank{rank}").write_text(run)
        while not (out / "go").exists():
            time.sleep(0.01)
ck.finish(steps, timeout=30)
(out / f"final-rank{rank}.txt").write_text(hashlib.sha256(w.tobytes()).hexdigest())
"""

STEPS, EVERY, HOLD = 12, 3, 6
# Short, but a loaded test machine must not stall a beat past the deadline.
FAST = LaunchSettings(beat_s=0.05, deadline_s=1.0, start_s=30, hang_s=0, stop_s=10)


def reference(rank: int) -> str:
    w = np.full(4096, float(rank + 1))
    for step in range(1, STEPS + 1):
        w = w * 0.5 + step
    return hashlib.sha256(w.tobytes()).hexdigest()


def wait_for(what: Callable[[], bool], timeout: float = 60.0) -> None:
    start = time.monotonic()
    while not what():
        assert time.monotonic() - start < timeout, "state not reached in time"
        time.sleep(0.01)


class Job:
    """A fake allocation of ``nodes`` under ``tmp``: a node-memory directory per node, one
    shared filesystem, the launcher in a thread."""

    def __init__(self, tmp: Path, job_id: str, nodes: list[str], s: LaunchSettings) -> None:
        self.out, cfgs = tmp / "out", tmp / "cfg"
        self.out.mkdir()
        cfgs.mkdir()
        for n in nodes:
            (cfgs / f"{n}.toml").write_text(
                f'[ckpt]\nmemory_root = "{tmp}/shm/{n}"\nshared_root = "{tmp}/fsx"\n'
                'peer_partner = "next-node"\nagree_timeout_s = 60\n')
        script = tmp / "rank.py"
        script.write_text(RANK)
        (tmp / "logs").mkdir()
        self.steps = LocalSteps(job_id, tmp / "logs")
        self.reporter, self.events = Recorded(), Events()
        argv = [sys.executable, "-I", str(script), str(cfgs), str(self.out),
                str(STEPS), str(EVERY), str(HOLD)]
        self.rc: int | None = None

        def run() -> None:
            self.rc = launch(job_id, nodes, argv, s, self.steps, self.reporter, self.events,
                             "127.0.0.1")
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def held(self, ranks: int) -> None:
        wait_for(lambda: all((self.out / f"held-rank{r}").exists() for r in range(ranks)))

    def go(self) -> None:
        (self.out / "go").write_text("")

    def finish(self, timeout: float = 60) -> int | None:
        self.thread.join(timeout)
        self.steps.reap()
        return self.rc

    def restored(self, run: str, rank: int) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(
            (self.out / f"restored-{run}-rank{rank}.json").read_text())
        return data


def test_a_spare_takes_over_a_killed_node_and_the_run_ends_as_if_uninterrupted(
        tmp_path: Path) -> None:
    job = Job(tmp_path, "7001", ["n0", "n1", "n2", "n3"], FAST)
    job.held(3)
    killed = time.monotonic()
    job.steps.kill_node("n1")  # rank 1's node: its process dies, srun hears nothing
    job.go()
    assert job.finish() == 0, job.events.seen

    started = job.events.named("step_started")
    assert [e["nodes"] for e in started] == [["n0", "n1", "n2"], ["n0", "n3", "n2"]]
    (lost,) = job.events.named("lost")
    assert [(x["rank"], x["node"]) for x in lost["lost"]] == [(1, "n1")]
    assert [(x.rank, x.node) for x in job.reporter.so_far] == [(1, "n1")]
    # Detected by its deadline, not before; every rank trained again soon after.
    assert FAST.deadline_s - FAST.beat_s <= lost["mono"] - killed <= FAST.deadline_s + 2
    training = [e for e in job.events.named("training") if e["gen"] == 2]
    assert training and training[0]["mono"] - killed < 30
    # Survivors restore their own node memory; the spare gets rank 1's from its partner.
    run2 = "r0-s1"
    assert [job.restored(run2, r) for r in range(3)] == [
        {"node": "n0", "step": HOLD, "tier": "memory"},
        {"node": "n3", "step": HOLD, "tier": "peer"},
        {"node": "n2", "step": HOLD, "tier": "memory"}]
    for r in range(3):
        assert (job.out / f"final-rank{r}.txt").read_text() == reference(r)


def test_with_no_spare_left_the_launcher_asks_for_a_requeue(tmp_path: Path) -> None:
    job = Job(tmp_path, "7002", ["n0", "n1"], replace(FAST, spares=0))
    job.held(2)
    job.steps.kill_node("n1")
    job.go()
    assert job.finish() == EXIT_REQUEUE
    assert len(job.steps.started) == 1  # never relaunched
    assert [x.node for x in job.reporter.so_far] == ["n1"]
    assert "0 spare(s) left" in job.events.named("requeue")[0]["why"]
    # The survivor's rank did not keep running after the launcher gave up.
    assert job.steps.poll(job.steps.started[0]) is not None


def test_a_failing_training_is_passed_through_without_spending_a_spare(
        tmp_path: Path) -> None:
    steps, events = LocalSteps("7003"), Events()
    rc = launch("7003", ["n0", "n1", "n2"], [sys.executable, "-c", "raise SystemExit(3)"],
                FAST, steps, Recorded(), events, "127.0.0.1")
    steps.reap()
    assert rc == 3
    assert len(steps.started) == 1 and not events.named("lost")


# A rank that beats (its heartbeat thread runs) but never gets past step 1: a hang.
HUNG = """
import os, threading
from gpuwarden.ckpt import beat
b = beat.from_env(os.environ, os.environ["SLURM_JOB_ID"], int(os.environ["SLURM_PROCID"]),
                  os.environ["SLURMD_NODENAME"], os.environ["SLURM_STEP_ID"])
b.progress(1)
threading.Event().wait()
"""


def test_a_hang_is_relaunched_on_the_same_nodes_once_then_requeued(tmp_path: Path) -> None:
    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    steps, events = LocalSteps("7004"), Events()
    s = replace(FAST, hang_s=1.0)
    rc = launch("7004", ["n0", "n1", "n2"], [sys.executable, "-I", str(script)], s, steps,
                Recorded(), events, "127.0.0.1")
    steps.reap()
    assert rc == EXIT_REQUEUE, events.seen
    assert [st.nodes for st in steps.started] == [("n0", "n1"), ("n0", "n1")], events.seen
    assert len(events.named("hung")) == 2 and not events.named("lost")
    assert "hung again" in events.named("requeue")[0]["why"]
