"""A hand-written fake of `Steps`: each "node" is a name, each rank a real local process.

What it copies from srun: SLURM_PROCID/NTASKS/STEP_ID/SLURMD_NODENAME per rank, a new step id
per start, and the step's status as src/srun/launch.c `_task_finish` makes it: a task killed by
a signal wins over any exit code (128 + signal), else the highest exit code. With
``kill_on_bad_exit`` (srun --kill-on-bad-exit=1) a task's non-zero exit, 75 included, gets the
others SIGKILLed, so the step then ends 137; without it (what the launcher asks for) srun waits
for every task. `exits` is what srun prints per task ("task N: Exited with exit code C"): ranks
that ended non-zero by themselves. What it copies from a lost node:
`kill_node` SIGKILLs the rank there and srun hears nothing of it (a dead node reports
nothing), so the step keeps "running" until it is cancelled; a step started on a lost node is
refused. `end`: srun ends the step by itself (a launch that timed out on a node); as srun exits
only once every task's end is in, the status is there only after the tasks it killed are
gone, so what `poll` and `exits` say together never depends on how fast a kill lands. For unit
tests and a demo without Slurm.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpuwarden.launch.steps import Step, StepError


@dataclass
class LocalStep:
    nodes: tuple[str, ...]
    step_id: str
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    cancelled: bool = False
    code: int | None = None
    killed_bad: bool = False  # --kill-on-bad-exit has ended the others
    ended: set[str] = field(default_factory=set)  # nodes whose task `end` killed


class LocalSteps:
    def __init__(self, job_id: str, log_dir: Path | None = None,
                 env: Mapping[str, str] | None = None, kill_on_bad_exit: bool = False) -> None:
        self.job_id, self.log_dir = job_id, log_dir
        self.kill_on_bad_exit = kill_on_bad_exit
        self.base = dict(os.environ if env is None else env)
        self.dead: set[str] = set()
        self.started: list[LocalStep] = []
        self._lock = threading.Lock()

    def start(self, nodes: Sequence[str], env: Mapping[str, str],
              argv: Sequence[str]) -> LocalStep:
        with self._lock:
            if set(nodes) & self.dead:
                down = sorted(set(nodes) & self.dead)
                raise StepError(f"nodes {down} are down", down)
            step = LocalStep(tuple(nodes), str(len(self.started)))
            self.started.append(step)
        for rank, node in enumerate(nodes):
            full = {**self.base, **env, "SLURM_JOB_ID": self.job_id, "SLURM_PROCID": str(rank),
                    "SLURM_NTASKS": str(len(nodes)), "SLURM_STEP_ID": step.step_id,
                    "SLURM_NODEID": str(rank), "SLURMD_NODENAME": node}
            out = subprocess.DEVNULL if self.log_dir is None else open(  # noqa: SIM115 - the child holds it
                self.log_dir / f"step{step.step_id}-rank{rank}-{node}.log", "wb")
            try:
                step.procs[node] = subprocess.Popen(list(argv), env=full, stdout=out,
                                                    stderr=subprocess.STDOUT,
                                                    stdin=subprocess.DEVNULL)
            finally:
                if out is not subprocess.DEVNULL:
                    out.close()  # type: ignore[union-attr]
        return step

    def poll(self, step: Step) -> int | None:
        assert isinstance(step, LocalStep)
        if step.code is not None:
            return step.code
        live = {n: p for n, p in step.procs.items() if n not in self.dead}
        codes = {n: p.poll() for n, p in live.items()}
        bad = [c for c in codes.values() if c is not None and c != 0]
        if bad and self.kill_on_bad_exit and not step.killed_bad and not step.cancelled:
            step.killed_bad = True
            for p in live.values():
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        if any(c is None for c in codes.values()):
            return None
        if not step.cancelled and any(n in self.dead for n in step.procs):
            return None  # srun waits for a node that will never answer
        step.code = srun_status([c for c in codes.values() if c is not None])
        return step.code

    def failed_nodes(self, step: Step) -> list[str]:
        return []

    def broken(self, step: Step) -> str | None:
        return None

    def exits(self, step: Step) -> dict[int, int]:
        assert isinstance(step, LocalStep)
        out = {}
        for rank, node in enumerate(step.nodes):
            p = step.procs.get(node)
            code = None if p is None or node in self.dead else p.poll()
            if node in step.ended:  # srun's own doing, not the task's end
                continue
            if code is not None and code != 0:  # a signal as srun names it: 128 + its number
                out[rank] = code if code > 0 else 128 - code
        return out

    def end(self, step: LocalStep, code: int) -> None:
        """srun ends the step by itself with status ``code``: it kills the tasks still running
        and exits only once their ends are in, so they are gone before the status is set (set
        first, `poll` then `exits` saw each task dead or alive as its kill happened to land).
        Those tasks did not end by themselves: `exits` leaves them out (a signal death srun
        reported would also have been its status, not ``code``)."""
        running = [n for n, p in step.procs.items() if p.poll() is None]
        for n in running:
            with contextlib.suppress(ProcessLookupError):
                step.procs[n].kill()
        for p in step.procs.values():
            p.wait()
        # One that ended by itself before the kill keeps its own status.
        step.ended = {n for n in running if step.procs[n].returncode == -signal.SIGKILL}
        step.code = code

    def cancel(self, step: Step, step_id: str | None) -> None:
        assert isinstance(step, LocalStep)
        step.cancelled = True
        for n, p in step.procs.items():
            if n not in self.dead:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)

    def kill(self, step: Step) -> None:
        assert isinstance(step, LocalStep)
        step.cancelled = True
        for p in step.procs.values():
            with contextlib.suppress(ProcessLookupError):
                p.kill()

    def kill_node(self, node: str) -> None:
        """The node is gone: its rank dies at once, and nothing is ever heard from it."""
        with self._lock:
            self.dead.add(node)
            procs = [s.procs[node] for s in self.started if node in s.procs]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()

    def reap(self) -> None:
        """Wait for every process this fake started (a test's cleanup)."""
        for s in self.started:
            for p in s.procs.values():
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait(10)


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


def srun_status(returncodes: list[int]) -> int:
    """srun's exit status from its tasks' (Popen returncodes: < 0 a signal)."""
    signals = [-c for c in returncodes if c < 0]
    return 128 + max(signals) if signals else max(returncodes, default=0)
