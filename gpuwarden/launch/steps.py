"""Starting and ending the training step: the Protocol, and the real one with srun/scancel.

Rank order. By default Slurm lays a step's tasks out in the allocation's node order (block
distribution over the nodes sorted as slurmctld knows them), whatever order ``-w`` lists: a
spare that sorts before a survivor would shift every rank after it, and the survivors would
lose their tier 0 (their ranks' steps would come over the network instead). So the step is
started with ``--distribution=arbitrary`` and ``-w`` in rank order, which lays task r on the
r-th node listed (srun's documented arbitrary layout; the same as SLURM_HOSTFILE). The launcher
does not take this on trust: each rank's beats name its host, and `decide.adopt` follows
what Slurm really did (and says so).

``--overlap``: the lost node's part of the old step stays "running" in slurmctld until the node
is marked DOWN (SlurmdTimeout, 300 s by default), and with it the step's claim on the
survivors' CPUs, memory and GPUs; a new step without --overlap waits for that. The launcher
has already ended the old step's processes on the survivors (their beats stopped) before it
starts the new one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Protocol

from gpuwarden.errors import SlurmError
from gpuwarden.slurm.runner import CommandRunner

log = logging.getLogger(__name__)


class StepError(Exception):
    """A step could not be started; ``nodes``: those it named as the cause (down), if any."""

    def __init__(self, message: str, nodes: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.nodes = tuple(nodes)


class Step(Protocol):
    nodes: tuple[str, ...]


class Steps(Protocol):
    def start(self, nodes: Sequence[str], env: Mapping[str, str], argv: Sequence[str]) -> Step:
        """Rank r on nodes[r], one task per node; ``env`` added to the ranks' environment."""
        ...

    def poll(self, step: Step) -> int | None:
        """The step's exit status (srun's), None while it runs."""
        ...

    def failed_nodes(self, step: Step) -> list[str]:
        """Nodes Slurm itself reported failed for this step so far."""
        ...

    def exits(self, step: Step) -> dict[int, int]:
        """Ranks that ended by themselves with a non-zero status, as their node's slurmd
        reported it (so the node is alive): rank -> exit code."""
        ...

    def cancel(self, step: Step, step_id: str | None) -> None:
        """Ask the step to end (every node), without waiting."""
        ...

    def kill(self, step: Step) -> None:
        """End what is left of it on this host (srun), now."""
        ...


# srun's line when slurmctld tells it a node of the step failed.
_NODE_FAIL = re.compile(r"srun: error: Node failure on (\S+)")
# srun's line when a task ends non-zero (src/srun/launch.c _task_finish): "task 1" or "tasks 0-2,5".
_TASK_EXIT = re.compile(r"srun: error: \S+: tasks? ([0-9,-]+): Exited with exit code (\d+)")
# ... and when a task dies of a signal: strsignal's text ("Killed", "Segmentation fault",
# "Aborted", "Terminated"), " (core dumped)" after it where it dumped one. Its node's slurmstepd
# reported it, so the node is alive: the program's own end (an OOM kill, a crash).
_TASK_SIGNAL = re.compile(r"srun: error: \S+: tasks? ([0-9,-]+): ([A-Z][A-Za-z -]*?)"
                          r"(?: \(core dumped\))?\s*$")


@functools.cache
def _signal_numbers() -> dict[str, int]:
    out = {}
    for sig in signal.Signals:
        text = signal.strsignal(sig)
        if text:
            out[text] = int(sig)
    return out


def task_exits(line: str) -> dict[int, int]:
    """Ranks srun reports ended by themselves on this stderr line: rank -> status (a signal
    as 128 + its number, as a shell gives it)."""
    t = _TASK_EXIT.search(line)
    if t:
        return dict.fromkeys(_task_ids(t.group(1)), int(t.group(2)))
    s = _TASK_SIGNAL.search(line)
    number = _signal_numbers().get(s.group(2)) if s else None
    return {} if s is None or number is None else dict.fromkeys(_task_ids(s.group(1)),
                                                                128 + number)


def _task_ids(ranges: str) -> list[int]:
    out: list[int] = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            out.extend(range(int(lo), int(hi or lo) + 1))
    return out


@dataclass
class SrunStep:
    nodes: tuple[str, ...]
    proc: subprocess.Popen[bytes]
    failed: list[str] = field(default_factory=list)
    exits: dict[int, int] = field(default_factory=dict)
    reader: threading.Thread | None = None


def srun_argv(srun: str, job_id: str, nodes: Sequence[str], argv: Sequence[str],
              overlap: bool = True) -> list[str]:
    n = str(len(nodes))
    # No --nodes (srun refuses it with --distribution=arbitrary): the list, one node per
    # task in rank order, says where each task goes (checked on Slurm 24.11).
    # --kill-on-bad-exit=0: exit 75 (saved at the time limit) is a "bad exit" to srun, and with
    # 1 the first rank's 75 would get the others killed before they save, and srun would exit
    # with their signal; the launcher ends the step itself on a real failure.
    # --export=ALL: under `sbatch --export=NONE` srun inherits SLURM_EXPORT_ENV=NONE and the
    # launcher's variables would never reach the ranks (never VAR=value here: ps shows it).
    return [srun, f"--jobid={job_id}", "--ntasks", n,
            "--distribution=arbitrary", f"--nodelist={','.join(nodes)}",
            "--kill-on-bad-exit=0", "--export=ALL", *(["--overlap"] if overlap else []),
            *argv]


class SrunSteps:
    """The real thing: one ``srun`` per step from the batch script's host; its stdout goes
    where the launcher's goes, its stderr too, read on the way for node failures."""

    def __init__(self, job_id: str, runner: CommandRunner, srun: str = "srun",
                 scancel: str = "scancel", overlap: bool = True,
                 stderr: IO[str] | None = None) -> None:
        self.job_id, self.runner, self.overlap = job_id, runner, overlap
        self.srun, self.scancel = srun, scancel
        self.stderr = stderr if stderr is not None else sys.stderr

    def start(self, nodes: Sequence[str], env: Mapping[str, str],
              argv: Sequence[str]) -> SrunStep:
        full = {k: v for k, v in os.environ.items() if k != "SLURM_HOSTFILE"}
        full.update(env)
        cmd = srun_argv(self.srun, self.job_id, nodes, argv, self.overlap)
        log.info("starting: %s", " ".join(cmd))
        try:
            proc = subprocess.Popen(cmd, env=full, stdin=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE)
        except OSError as exc:
            raise StepError(f"cannot run {self.srun}: {exc}") from None
        step = SrunStep(tuple(nodes), proc)
        step.reader = threading.Thread(target=self._read, args=(step,), daemon=True,
                                       name="gpuwarden-srun-stderr")
        step.reader.start()
        return step

    def _read(self, step: SrunStep) -> None:
        assert step.proc.stderr is not None
        for raw in step.proc.stderr:
            line = raw.decode(errors="replace")
            # Matched before it is written on: a slow stderr must not hide a node failure.
            m = _NODE_FAIL.search(line)
            if m:
                step.failed.append(m.group(1))
            for rank, code in task_exits(line).items():
                step.exits.setdefault(rank, code)
            try:
                self.stderr.write(line)
            except (OSError, ValueError) as exc:  # a full disk must not stop the watching
                log.debug("srun stderr: %s", exc)

    def poll(self, step: Step) -> int | None:
        assert isinstance(step, SrunStep)
        code = step.proc.poll()
        if code is None:
            return None
        if step.reader is not None:
            # srun's last lines (a node failure, a task's exit) count before its status.
            step.reader.join(10.0)
        return 128 - code if code < 0 else code  # killed by a signal: as a shell reports it

    def failed_nodes(self, step: Step) -> list[str]:
        assert isinstance(step, SrunStep)
        return list(step.failed)

    def exits(self, step: Step) -> dict[int, int]:
        assert isinstance(step, SrunStep)
        return dict(step.exits)

    def cancel(self, step: Step, step_id: str | None) -> None:
        assert isinstance(step, SrunStep)
        if step_id is not None:
            # slurmctld ends the step on every node it can reach, whatever srun does.
            argv = [self.scancel, "--quiet", f"{self.job_id}.{step_id}"]
            try:
                res = self.runner.run(argv, 10.0)
                if res.returncode != 0:
                    log.warning("%s: %s", " ".join(argv), res.stderr.strip()[:300])
            except (SlurmError, OSError) as exc:  # srun gets its signal below either way
                log.warning("%s: %s", " ".join(argv), exc)
        with contextlib.suppress(ProcessLookupError):
            step.proc.send_signal(signal.SIGTERM)  # srun passes it on to every task

    def kill(self, step: Step) -> None:
        assert isinstance(step, SrunStep)
        with contextlib.suppress(ProcessLookupError):
            step.proc.kill()
