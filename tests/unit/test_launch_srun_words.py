"""Issue 33: the launcher acts only on what srun itself says, never on a rank's stderr.

A rank's stderr may carry any text (a dataset record written by another user, logged), and
the launcher used to read srun's reports (a node failure, a task's exit) from the same pipe:
a forged line spent a spare on a healthy node, ended a live job, or (a 4-billion task range)
killed the reader so the ranks blocked writing. Here through `SrunSteps` and a fake srun
(tests/unit/fake_srun.py) that handles output as the real one does, with real ranks beating.
"""

from __future__ import annotations

import io
import os
import re
import resource
import shlex
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.launch.launcher import launch
from gpuwarden.launch.report import Events, Recorded
from gpuwarden.launch.settings import LaunchSettings
from gpuwarden.launch.steps import SrunStep, SrunSteps
from gpuwarden.slurm.runner import CommandResult

pytestmark = pytest.mark.timeout(120)

FAKE = Path(__file__).with_name("fake_srun.py")
S = LaunchSettings(spares=1, beat_s=0.1, deadline_s=1.0, start_s=10, hang_s=0, stop_s=5)
HUGE = "bad record: srun: error: x: tasks 0-4000000000: Exited with exit code 1\n"

# Beats and trains 30 steps; rank 1 writes the forged bytes at step 5 (pieces split at
# "<pause>" written 0.2 s apart: a partial line), then logs on (400 KiB, more than the pipes
# holds, with srun's between); "crash": rank 1 then really exits 3.
RANK = r"""
import os, sys, time
from gpuwarden.ckpt import beat
rank = int(os.environ["SLURM_PROCID"])
b = beat.from_env(os.environ, os.environ["SLURM_JOB_ID"], rank, os.environ["SLURMD_NODENAME"],
                  os.environ["SLURM_STEP_ID"])
forged, mode = open(sys.argv[1], "rb").read(), sys.argv[2]
for i in range(1, 31):
    b.progress(i)
    if i == 5 and rank == 1:
        for n, piece in enumerate(forged.split(b"<pause>")):
            if n:
                time.sleep(0.2)
            os.write(2, piece)
        for n in range(8000):
            os.write(2, b"step %05d: loss 0.25, a log line of fifty bytes\n" % n)
    time.sleep(0.1)
if mode == "crash" and rank == 1:
    os._exit(3)
b.done(); time.sleep(0.2)
"""


class NoScancel:
    def run(self, argv: Any, timeout: float) -> CommandResult:
        return CommandResult(tuple(argv), 0, "", "")


class Recording(SrunSteps):
    """SrunSteps that remembers its steps, to end them whatever a test's outcome."""

    def __init__(self, srun: str, stderr: io.StringIO) -> None:
        super().__init__("4242", NoScancel(), srun, stderr=stderr)  # type: ignore[arg-type]
        self.started: list[SrunStep] = []

    def start(self, *args: Any) -> SrunStep:
        step = super().start(*args)
        self.started.append(step)
        return step


@pytest.fixture
def srun(tmp_path: Path) -> str:
    exe = tmp_path / "srun"
    exe.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(FAKE))} "
                   '"$@"\n')
    exe.chmod(0o755)
    return str(exe)


@pytest.fixture
def capped() -> Iterator[None]:
    """At most 2 GiB more address space while the test runs: a parse that builds billions
    of ids fails here (MemoryError) instead of taking a shared machine's memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        now = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = now + (2 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (min(cap, hard) if hard > 0 else cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def run_job(tmp_path: Path, srun: str, forged: str, mode: str = "") -> dict[str, Any]:
    rank = tmp_path / "rank.py"
    rank.write_text(RANK)
    (tmp_path / "forged").write_bytes(forged.encode())
    err, ev, rep = io.StringIO(), Events(), Recorded()
    steps = Recording(srun, err)
    out: dict[str, Any] = {}
    th = threading.Thread(target=lambda: out.setdefault("rc", launch(
        "4242", ["n0", "n1", "n2"], [sys.executable, str(rank), str(tmp_path / "forged"),
                                     mode], S, steps, rep, ev, "127.0.0.1")), daemon=True)
    th.start()
    th.join(60)
    for step in steps.started:  # a hung launcher's step must not outlive the test
        steps.kill(step)
    assert not th.is_alive(), f"the launcher never ended the job: {ev.seen}"
    return {"rc": out["rc"], "events": ev, "lost": rep.so_far, "stderr": err.getvalue(),
            "steps": steps.started}


@pytest.mark.usefixtures("capped")
@pytest.mark.parametrize("forged", [
    # The review's three, then a rank's own text after an embedded newline, and a line that
    # is srun's word for word but comes in pieces (a partial line, then the rest).
    "WARNING dataloader: bad sample name: srun: error: Node failure on n1\n",
    "reading shard: srun: error: n1: task 1: Exited with exit code 3\n",
    HUGE,
    "bad sample name: x\nsrun: error: Node failure on n1\n",
    "srun: error: n0: task 0: Killed<pause>\nsrun: error: Node failure on n0<pause>\n",
])
def test_a_rank_forging_sruns_words_spends_no_spare_and_ends_nothing(
        tmp_path: Path, srun: str, forged: str) -> None:
    job = run_job(tmp_path, srun, forged)
    assert job["rc"] == 0, job["events"].seen
    assert job["lost"] == [] and not job["events"].named("lost"), job["events"].seen
    assert len(job["steps"]) == 1 and not job["events"].named("failed")
    # What the rank wrote reaches the job's stderr as it wrote it, and all of it.
    assert forged.replace("<pause>", "") in job["stderr"]
    assert "step 07999: loss" in job["stderr"]


def test_after_forged_lines_a_ranks_real_exit_is_still_read(tmp_path: Path,
                                                            srun: str) -> None:
    job = run_job(tmp_path, srun, HUGE + "srun: error: Node failure on n1\n", "crash")
    assert job["rc"] == 3, job["events"].seen
    assert job["lost"] == [] and not job["events"].named("lost")
    assert "srun: error: n1: task 1: Exited with exit code 3" in job["stderr"]


def start_scripted(tmp_path: Path, own: bytes, steps: SrunSteps | None = None,
                   nodes: tuple[str, ...] = ("n0", "n1", "n2")) -> tuple[SrunStep, SrunSteps]:
    """An srun that writes ``own`` to its own stderr (srun's words) and exits 1."""
    (tmp_path / "own").write_bytes(own)
    fake = tmp_path / "srun-own"
    fake.write_text(f"#!/bin/sh\ncat {shlex.quote(str(tmp_path / 'own'))} >&2\nexit 1\n")
    fake.chmod(0o755)
    steps = steps or SrunSteps("1", NoScancel(), str(fake), stderr=io.StringIO())  # type: ignore[arg-type]
    steps.srun = str(fake)
    step = steps.start(list(nodes), {}, [])
    deadline = time.monotonic() + 30
    while steps.poll(step) is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return step, steps


def test_sruns_own_reports_are_read_only_whole_and_within_the_step(tmp_path: Path) -> None:
    own = ("srun: error: n0: task 0: Exited with exit code 3\n"
           + "x" * 5000 + "srun: error: Node failure on n2\n"  # the tail of an over-long line
           + "srun: error: n1: tasks 1-7: Exited with exit code 4\n"  # beyond a 3-task step
           + "srun: error: n1: task 1: Exited with exit code 300\n"  # no exit code
           + "srun: error: Node failure on n9\n"  # not a node of the step
           + "srun: error: n2: tasks 1-2: Segmentation fault (core dumped)\n"
           + "srun: error: Node failure on n1\n"
           + "srun: error: Node failure on n2")  # no newline: srun died mid-line
    step, steps = start_scripted(tmp_path, own.encode())
    assert steps.failed_nodes(step) == ["n1"]
    assert steps.exits(step) == {0: 3, 1: 139, 2: 139}
    assert steps.broken(step) is None
    assert steps.stderr.getvalue() == own  # type: ignore[attr-defined]


@pytest.mark.usefixtures("capped")
@pytest.mark.parametrize(("line", "ntasks", "want"), [
    (HUGE, 3, {}),
    ("srun: error: x: tasks 0-4000000000: Exited with exit code 1", 3, {}),
    ("srun: error: x: tasks 0-4000000000: Killed", 3, {}),
    ("srun: error: n1: task 3: Exited with exit code 1", 3, {}),
    ("srun: error: n1: tasks 2-1: Exited with exit code 1", 3, {}),
    ("srun: error: n1: tasks 0-1,9: Exited with exit code 1", 3, {}),
    ("srun: error: n1: task 1: Exited with exit code 256", 3, {}),
    ("srun: error: n1: task 1: Exited with exit code 3 and more", 3, {}),
    ("reading shard: srun: error: n1: task 1: Exited with exit code 3", 3, {}),
    ("srun: error: n1: tasks 0-1,2: Exited with exit code 3\n", 3, {0: 3, 1: 3, 2: 3}),
    ("srun: error: n1: task 2: Killed", 3, {2: 137}),
])
def test_every_number_in_sruns_reports_is_bounded_by_the_step(
        line: str, ntasks: int, want: dict[int, int]) -> None:
    from gpuwarden.launch.steps import task_exits
    began = time.monotonic()
    assert task_exits(line, ntasks) == want
    assert time.monotonic() - began < 1


def test_a_node_failure_names_a_node_of_the_step_in_a_whole_line() -> None:
    from gpuwarden.launch.steps import node_failure
    nodes = ("n0", "n1")
    assert node_failure("srun: error: Node failure on n1\n", nodes) == "n1"
    for line in ("WARNING: srun: error: Node failure on n1", "srun: error: Node failure on n7",
                 "srun: error: Node failure on n1 (and more)"):
        assert node_failure(line, nodes) is None, line


def test_a_reader_that_fails_ends_the_step_loudly_and_srun_never_blocks(
        tmp_path: Path, srun: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    # The launcher's own failure while reading srun's stderr: the reader kept nothing, the
    # ranks (and srun) blocked writing, and the launcher waited forever.
    def boom(self: SrunSteps, step: SrunStep, line: str) -> None:
        if "boom" in line:
            raise RuntimeError("a bug of the launcher's own")
    monkeypatch.setattr(SrunSteps, "_heard", boom)
    # srun says "boom", then 1 MiB more: far more than a pipe holds.
    step, steps = start_scripted(tmp_path, b"srun: boom\n" + b"srun: more\n" * 100_000)
    assert steps.broken(step) is not None and "a bug of the launcher's own" in str(
        steps.broken(step))
    assert "reading srun's stderr failed" in caplog.text
    # ... and through the launcher: it ends the step, says why, and exits non-zero.
    monkeypatch.setenv("FAKE_SRUN_SAYS", "srun: boom")
    job = run_job(tmp_path, srun, "nothing forged\n")
    assert job["rc"] == 1 and job["events"].named("failed"), job["events"].seen
    assert "a bug of the launcher's own" in job["events"].named("failed")[0]["why"]


def test_the_step_runs_with_the_tasks_stderr_apart_from_sruns(tmp_path: Path,
                                                              srun: str) -> None:
    err = io.StringIO()
    steps = SrunSteps("9", NoScancel(), srun, stderr=err)  # type: ignore[arg-type]
    # One write(2) per line, as a pipe keeps each whole: print() to a non-tty stderr writes
    # "err" and "\n" apart, so the two tasks' lines could interleave ("errerr\n\n").
    step = steps.start(["n0", "n1"], {}, [sys.executable, "-c",
                                          "import os; os.write(1, b'out\\n'); "
                                          "os.write(2, b'err\\n')"])
    while steps.poll(step) is None:
        time.sleep(0.01)
    assert err.getvalue() == "err\nerr\n"
    assert re.fullmatch(r"/proc/self/fd/\d+",
                        next(a for a in step.proc.args if a.startswith("--error="))[8:])
