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

Whose words. The launcher acts on srun's own reports: a node of the step failed, a task ended
non-zero. By default srun writes the tasks' stderr to its own stderr too, so a rank that logs a
line it read (a dataset's record, which anyone may have written) could say "srun: error: Node
failure on n1" there, unanchored or after a newline of its own: a healthy node reported lost
and a spare spent on it, a live job ended with a forged status, or (a 4-billion task range) a
reader dead of MemoryError and the ranks blocked writing. So the step runs with
``--error=/proc/self/fd/N``, N a pipe the launcher holds: srun opens a file name without
%-patterns itself, on its own host, and writes every task's stderr there; the launcher passes
those bytes on to the job's stderr as they come and never reads srun's reports in them. srun's
own stderr then holds only what srun writes. Even there a report counts only as a whole line
(``fullmatch``; a piece of an over-long or unfinished line never does), naming a node of the
step, task ids below the step's task count and an exit code up to 255; nothing in a line can
make the launcher hold more than the step's task count. A reader that fails for any reason
drains its pipe to the end (srun and the ranks never block writing) and marks the step
broken: the launcher ends it and exits 1, saying why. The tasks' stdout goes to srun's
stdout, the launcher's (the job's output), untouched. Not ``--label``: it would change what
users see, and in Slurm's source (write_labelled_message.c: read, not run) the label and the
line are separate write()s, so a line of srun's own written between them would leave a task's
line unlabelled.

Seen with Slurm 24.11.5 in the test cluster (2 nodes, a batch job's srun):
``--error=/proc/self/fd/N`` brought both nodes' tasks' stderr into the pipe, byte for byte
(an unfinished line stays unfinished), and srun's stderr held only its own lines:
``srun: error: c2: task 1: Exited with exit code 3``; by a signal ``srun: error: c1: task 0:
Killed`` (``Segmentation fault``, ``Aborted``, ``Terminated``; strsignal's text), then
``srun: Force Terminated StepId=1.2``; a node set down under a running step gave
``srun: error: Node failure on c2`` followed by ``c2: task 1: Killed`` and the other tasks'
``Killed``. With ``--label`` each line of a task's output starts ``0: `` (zero-padded to the
highest task id's width: reported), an unfinished line is joined to the rest of it by
slurmstepd before srun labels it, and srun's own lines carry no label.
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
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Protocol

from gpuwarden.core.errors import SlurmError
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

    def broken(self, step: Step) -> str | None:
        """Why the launcher can no longer watch this step (then it ends it), else None."""
        ...

    def cancel(self, step: Step, step_id: str | None) -> None:
        """Ask the step to end (every node), without waiting."""
        ...

    def kill(self, step: Step) -> None:
        """End what is left of it on this host (srun), now."""
        ...


# srun's own reports, each a whole line on its own stderr (see "Whose words" above). A node
# name as Slurm allows it; task ids "1" or "0-2,5" (src/srun/launch.c _task_finish).
_NODE = r"([A-Za-z0-9][A-Za-z0-9._-]{0,63})"
_TASKS = r"tasks? ([0-9][0-9,-]{0,255})"
# slurmctld told srun a node of the step failed.
_NODE_FAIL = re.compile(r"srun: error: Node failure on " + _NODE)
# A task ended non-zero ...
_TASK_EXIT = re.compile(rf"srun: error: {_NODE}: {_TASKS}: Exited with exit code ([0-9]{{1,3}})")
# ... or died of a signal: strsignal's text ("Killed", "Segmentation fault", "Aborted",
# "Terminated"), " (core dumped)" after it where it dumped one. Its node's slurmstepd
# reported it, so the node is alive: the program's own end (an OOM kill, a crash).
_TASK_SIGNAL = re.compile(rf"srun: error: {_NODE}: {_TASKS}: ([A-Z][A-Za-z -]{{0,63}}?)"
                          r"(?: \(core dumped\))?")
# srun's own lines are short: a longer one is passed on but never matched, and no read holds
# more than this.
_MAX_LINE = 4096
_CHUNK = 65536


@functools.cache
def _signal_numbers() -> dict[str, int]:
    out = {}
    for sig in signal.Signals:
        text = signal.strsignal(sig)
        if text:
            out[text] = int(sig)
    return out


def _whole(line: str) -> str:
    return line[:-1] if line.endswith("\n") else line


def node_failure(line: str, nodes: Collection[str]) -> str | None:
    """The node of the step that this line of srun's own stderr reports failed, if any."""
    m = _NODE_FAIL.fullmatch(_whole(line))
    return m.group(1) if m is not None and m.group(1) in nodes else None


def task_exits(line: str, ntasks: int) -> dict[int, int]:
    """Ranks this line of srun's own stderr reports ended by themselves: rank -> status (a
    signal as 128 + its number, as a shell gives it). Only the whole line as srun writes it,
    every task id below ``ntasks`` and an exit code up to 255; anything else reports nothing."""
    text = _whole(line)
    t = _TASK_EXIT.fullmatch(text)
    if t is not None:
        code = int(t.group(3))
        return dict.fromkeys(_task_ids(t.group(2), ntasks), code) if code <= 255 else {}
    s = _TASK_SIGNAL.fullmatch(text)
    number = _signal_numbers().get(s.group(3)) if s is not None else None
    if s is None or number is None:
        return {}
    return dict.fromkeys(_task_ids(s.group(2), ntasks), 128 + number)


def _task_ids(ranges: str, ntasks: int) -> list[int]:
    """srun's "0-2,5" as ids; none at all when any part is malformed or outside the step (so
    nothing here ever holds more than ``ntasks`` ids)."""
    out: set[int] = set()
    for part in ranges.split(","):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            return []
        first, last = int(lo), int(hi or lo)
        if not first <= last < ntasks:
            return []
        out.update(range(first, last + 1))
    return sorted(out)


@dataclass
class SrunStep:
    nodes: tuple[str, ...]
    proc: subprocess.Popen[bytes]
    failed: list[str] = field(default_factory=list)
    exits: dict[int, int] = field(default_factory=dict)
    readers: list[threading.Thread] = field(default_factory=list)
    broken: str | None = None  # why a reader stopped reading (then the step is ended)


def srun_argv(srun: str, job_id: str, nodes: Sequence[str], argv: Sequence[str],
              overlap: bool = True, error: str | None = None) -> list[str]:
    """``error``: where srun writes the tasks' stderr (a file name srun opens itself)."""
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
            *([f"--error={error}"] if error is not None else []), *argv]


def _drain(fd: int) -> None:
    """Read to the end, keeping nothing: whatever went wrong, srun must never block writing."""
    with contextlib.suppress(OSError):
        while os.read(fd, _CHUNK):
            pass


class SrunSteps:
    """The real thing: one ``srun`` per step from the batch script's host. Its stdout (the
    tasks' stdout) goes where the launcher's goes; the tasks' stderr comes through a pipe of
    its own and goes on to the launcher's stderr untouched; srun's own stderr goes there too,
    read on the way for node failures and tasks' ends."""

    def __init__(self, job_id: str, runner: CommandRunner, srun: str = "srun",
                 scancel: str = "scancel", overlap: bool = True,
                 stderr: IO[str] | None = None) -> None:
        self.job_id, self.runner, self.overlap = job_id, runner, overlap
        self.srun, self.scancel = srun, scancel
        self.stderr = stderr if stderr is not None else sys.stderr
        self._writing = threading.Lock()  # two readers, one stderr: whole writes
        self._write_failed = False

    def start(self, nodes: Sequence[str], env: Mapping[str, str],
              argv: Sequence[str]) -> SrunStep:
        full = {k: v for k, v in os.environ.items() if k != "SLURM_HOSTFILE"}
        full.update(env)
        tasks_err, child_end = os.pipe()
        cmd = srun_argv(self.srun, self.job_id, nodes, argv, self.overlap,
                        error=f"/proc/self/fd/{child_end}")
        log.info("starting: %s", " ".join(cmd))
        try:
            proc = subprocess.Popen(cmd, env=full, stdin=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, pass_fds=(child_end,))
        except OSError as exc:
            os.close(tasks_err)
            raise StepError(f"cannot run {self.srun}: {exc}") from None
        finally:
            os.close(child_end)  # srun holds it now: the pipe ends when srun does
        step = SrunStep(tuple(nodes), proc)
        step.readers = [
            threading.Thread(target=self._read_srun, args=(step,), daemon=True,
                             name="gpuwarden-srun-stderr"),
            threading.Thread(target=self._pass_on, args=(step, tasks_err), daemon=True,
                             name="gpuwarden-tasks-stderr")]
        for t in step.readers:
            t.start()
        return step

    def _read_srun(self, step: SrunStep) -> None:
        """srun's own lines: matched before they are written on (a slow stderr must not hide
        a node failure). A piece of a line (over _MAX_LINE, or the last one without its
        newline) and whatever follows it on the same line is passed on but never matched."""
        assert step.proc.stderr is not None
        stream = step.proc.stderr
        whole = True  # the next read starts a line
        try:
            while raw := stream.readline(_MAX_LINE):
                ends = raw.endswith(b"\n")
                if whole and ends:
                    self._heard(step, raw.decode(errors="replace"))
                whole = ends
                self._write(raw)
        except Exception as exc:  # never silently: the launcher ends the step on it
            self._broke(step, "srun's stderr", exc)
            _drain(stream.fileno())

    def _heard(self, step: SrunStep, line: str) -> None:
        node = node_failure(line, step.nodes)
        if node is not None and node not in step.failed:
            step.failed.append(node)
        for rank, code in task_exits(line, len(step.nodes)).items():
            step.exits.setdefault(rank, code)

    def _pass_on(self, step: SrunStep, fd: int) -> None:
        """The tasks' stderr, byte for byte as it comes: theirs, so never read for srun's."""
        try:
            while chunk := os.read(fd, _CHUNK):
                self._write(chunk)
        except Exception as exc:
            self._broke(step, "the tasks' stderr", exc)
            _drain(fd)
        finally:
            os.close(fd)

    def _write(self, raw: bytes) -> None:
        with self._writing:
            try:
                binary = getattr(self.stderr, "buffer", None)
                if binary is not None:  # the bytes as the ranks wrote them
                    self.stderr.flush()
                    binary.write(raw)
                    binary.flush()
                else:
                    self.stderr.write(raw.decode(errors="replace"))
            except (OSError, ValueError) as exc:  # a full disk must not stop the watching
                if not self._write_failed:
                    log.warning("cannot pass srun's output on to stderr: %s", exc)
                self._write_failed = True

    def _broke(self, step: SrunStep, what: str, exc: BaseException) -> None:
        step.broken = step.broken or f"reading {what} failed: {exc!r}"
        log.error("reading %s failed: the step is ended", what, exc_info=exc)

    def broken(self, step: Step) -> str | None:
        assert isinstance(step, SrunStep)
        return step.broken

    def poll(self, step: Step) -> int | None:
        assert isinstance(step, SrunStep)
        code = step.proc.poll()
        if code is None:
            return None
        for t in step.readers:
            # srun's last lines (a node failure, a task's exit) count before its status.
            t.join(10.0)
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
