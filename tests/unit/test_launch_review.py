"""The launcher against the defects a review found (issue 18): a time-limit save, correlated
node losses, a dead spare, a program's own crash, hangs before the first step and at exit,
the user's job comment, a full events disk, a slow stderr, and `sbatch --export=NONE`."""

from __future__ import annotations

import io
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.launch import launcher
from gpuwarden.launch.decide import Lost
from gpuwarden.launch.heartbeat import BeatTable
from gpuwarden.launch.launcher import launch
from gpuwarden.launch.localsteps import LocalStep, LocalSteps
from gpuwarden.launch.report import Events, JobComment, Recorded
from gpuwarden.launch.settings import EXIT_REQUEUE, LaunchSettings
from gpuwarden.launch.steps import SrunSteps, Step, srun_argv
from gpuwarden.slurm.runner import CommandResult
from tests.unit.test_launch_e2e import FAST, Job

pytestmark = pytest.mark.timeout(120)

S = LaunchSettings(spares=1, beat_s=0.1, deadline_s=1.0, start_s=3, hang_s=0, stop_s=5)

# A rank that beats and reports progress; what it does then is the test's (argv[1]).
RANK = """
import os, sys, threading, time
from gpuwarden.ckpt import beat
rank, gen = int(os.environ["SLURM_PROCID"]), int(os.environ["GPUWARDEN_LAUNCH_GEN"])
b = beat.from_env(os.environ, os.environ["SLURM_JOB_ID"], rank, os.environ["SLURMD_NODENAME"],
                  os.environ["SLURM_STEP_ID"])
mode = sys.argv[1]
if mode == "nostart":
    threading.Event().wait()  # beats, never a first step (a hang in the first collective)
for i in range(1, 6):
    b.progress(i); time.sleep(0.1)
if mode == "usr1":  # ck.finish at the time limit, then exit 75; rank 1's teardown is slower
    b.done(); time.sleep(0.3 * rank); sys.exit(75)
if mode == "crash":  # rank 1 hits a bug; the others block in a collective
    if rank == 1:
        os._exit(3)
    threading.Event().wait()
if mode == "done_hang":  # training over; rank 1 hangs at interpreter exit
    b.done()
    if rank == 1:
        threading.Event().wait()
    sys.exit(0)
if mode == "peer_exit":  # a collective fails once a peer's node is gone (gloo, NCCL): exit 1
    while gen == 1:
        b.progress(9); time.sleep(0.1)
        if os.path.exists(sys.argv[2]):
            sys.exit(1)
    b.done(); time.sleep(0.2)
if mode == "gen1_forever":  # the first launch runs until its node dies; later ones finish
    while gen == 1:
        b.progress(9); time.sleep(0.1)
    b.done(); time.sleep(0.2)
"""


@pytest.fixture
def rank(tmp_path: Path) -> list[str]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    return [sys.executable, str(script)]


def in_thread(fn: Any) -> tuple[threading.Thread, dict[str, int]]:
    out: dict[str, int] = {}
    th = threading.Thread(target=lambda: out.setdefault("rc", fn()), daemon=True)
    th.start()
    return th, out


def test_a_time_limit_save_waits_for_every_rank_and_75_reaches_the_template(
        rank: list[str]) -> None:
    # D1: 75 is a "bad exit" to srun; with --kill-on-bad-exit=1 rank 1 was killed before it
    # had saved, and srun exited 137, which the template does not requeue.
    assert "--kill-on-bad-exit=0" in srun_argv("srun", "9", ["a"], ["t"])
    steps, ev = LocalSteps("9700"), Events()
    rc = launch("9700", ["n0", "n1", "n2"], [*rank, "usr1"], S, steps, Recorded(), ev,
                "127.0.0.1")
    steps.reap()
    assert rc == EXIT_REQUEUE, ev.seen
    assert [p.returncode for p in steps.started[0].procs.values()] == [75, 75]


def test_the_fake_reports_what_srun_reports_with_kill_on_bad_exit(rank: list[str]) -> None:
    # With --kill-on-bad-exit=1 the others are SIGKILLed and srun's status is the signal's.
    steps = LocalSteps("9701", kill_on_bad_exit=True)
    step = steps.start(["n0", "n1"], {}, [sys.executable, "-c",
                                          "import os, time\n"
                                          "if os.environ['SLURM_PROCID'] == '0': raise "
                                          "SystemExit(75)\ntime.sleep(30)"])
    while (code := steps.poll(step)) is None:
        time.sleep(0.01)
    steps.reap()
    assert code == 137


def test_two_nodes_dying_together_are_both_replaced_with_two_spares(tmp_path: Path) -> None:
    # D2: n2 went quiet 0.3 s after n1; it was put back into the relaunch, which failed: requeue.
    job = Job(tmp_path, "7102", ["n0", "n1", "n2", "n3", "n4"], replace(FAST, spares=2))
    job.held(3)
    job.steps.kill_node("n1")
    time.sleep(0.3)
    job.steps.kill_node("n2")
    job.go()
    assert job.finish(90) == 0, job.events.seen
    starts = [e["nodes"] for e in job.events.named("step_started")]
    assert starts[0] == ["n0", "n1", "n2"] and starts[-1] == ["n0", "n3", "n4"], starts
    assert sorted(x.node for x in job.reporter.so_far) == ["n1", "n2"]
    assert not job.events.named("requeue")


class DeadSpare(LocalSteps):
    """A spare that is itself down: srun fails creating the step (exit 1), or waits forever
    ("Job step creation temporarily disabled, retrying")."""

    def __init__(self, job_id: str, down: str, mode: str) -> None:
        super().__init__(job_id)
        self.down, self.mode = down, mode

    def start(self, nodes: Any, env: Any, argv: Any) -> LocalStep:
        if self.down in nodes:
            st = LocalStep(tuple(nodes), "refused")
            st.code = 1 if self.mode == "fail" else None
            return st
        return super().start(nodes, env, argv)

    def poll(self, step: Step) -> int | None:
        assert isinstance(step, LocalStep)
        return step.code if step.step_id == "refused" else super().poll(step)


@pytest.mark.parametrize("mode", ["fail", "wait"])
def test_a_dead_spare_is_passed_over_for_the_next(rank: list[str], mode: str) -> None:
    # D3: the relaunch on a dead spare failed the job (rc 1) or left the launcher blind forever.
    rc, ev, rep = lose_n1_with_two_spares(DeadSpare("9300", "n3", mode), rank)
    assert rc == 0, ev.seen
    assert [x.node for x in rep.so_far] == ["n1", "n3"]
    assert [e["nodes"] for e in ev.named("step_started")][-1] == ["n0", "n4", "n2"]


class KillWait(LocalSteps):
    """srun after a task's bad exit: the others end only when slurmd's KillWait runs out
    (30 s by default), long after the launcher's deadline."""

    def poll(self, step: Step) -> int | None:
        assert isinstance(step, LocalStep)
        if any(p.poll() not in (None, 0) for p in step.procs.values()) and not step.cancelled:
            at = getattr(step, "bad_at", None) or time.monotonic()
            step.bad_at = at  # type: ignore[attr-defined]
            if time.monotonic() - at < 30:
                return None
        return super().poll(step)


def test_a_ranks_own_crash_is_passed_on_and_no_node_is_called_lost(rank: list[str]) -> None:
    # D4: rank 1's exit 3 was taken for a lost node: spares burned, healthy nodes reported,
    # a requeue that would crash the same way.
    steps, ev, rep = KillWait("9600"), Events(), Recorded()
    began = time.monotonic()
    rc = launch("9600", ["n0", "n1", "n2", "n3"], [*rank, "crash"], S, steps, rep, ev,
                "127.0.0.1")
    steps.reap()
    assert rc == 3, ev.seen
    assert rep.so_far == [] and not ev.named("lost") and len(steps.started) == 1
    assert time.monotonic() - began < 20  # the launcher ended the step, not KillWait


def test_srun_names_a_ranks_own_exit_and_a_node_failure_even_on_a_slow_stderr(
        tmp_path: Path) -> None:
    # D10: the line was written out (slowly) before it was matched, and the exit was read
    # before the reader had got to it: a node failure became the job's failure.
    fake = tmp_path / "srun"
    fake.write_text("#!/bin/sh\n"
                    "echo 'srun: error: n2: tasks 2-3: Exited with exit code 3' >&2\n"
                    "echo 'srun: error: Node failure on n1' >&2\nexit 1\n")
    fake.chmod(0o755)

    class Slow(io.StringIO):
        def write(self, s: str) -> int:
            time.sleep(0.3)
            return super().write(s)

    steps = SrunSteps("1", runner=None, srun=str(fake), stderr=Slow())  # type: ignore[arg-type]
    step = steps.start(["n0", "n1", "n2", "n3"], {}, [])
    while steps.poll(step) is None:
        time.sleep(0.001)
    assert steps.failed_nodes(step) == ["n1"]
    assert steps.exits(step) == {2: 3, 3: 3}


def test_a_hang_before_the_first_step_is_relaunched_then_requeued(rank: list[str]) -> None:
    # D6: a hang in the first collective (no progress ever) was never caught.
    steps, ev = LocalSteps("9800"), Events()
    th, out = in_thread(lambda: launch("9800", ["n0", "n1", "n2"], [*rank, "nostart"],
                                       replace(S, start_s=2, hang_s=1), steps, Recorded(), ev,
                                       "127.0.0.1"))
    th.join(60)
    steps.reap()
    assert not th.is_alive() and out["rc"] == EXIT_REQUEUE, ev.seen
    assert len(ev.named("hung")) == 2 and not ev.named("lost")


def test_a_rank_stuck_at_exit_does_not_hold_the_allocation(rank: list[str]) -> None:
    # D6: every rank said done, one never exits: the launcher waited forever.
    steps, ev = LocalSteps("9500"), Events()
    th, out = in_thread(lambda: launch("9500", ["n0", "n1", "n2"], [*rank, "done_hang"],
                                       replace(S, stop_s=2), steps, Recorded(), ev,
                                       "127.0.0.1"))
    th.join(60)
    steps.reap()
    assert not th.is_alive() and out["rc"] == 0, ev.seen
    assert ev.named("stuck_at_exit")[0]["ranks"] == [1]


class Scontrol:
    def __init__(self, comment: str) -> None:
        self.comment = comment
        self.ran: list[list[str]] = []

    def run(self, argv: list[str], timeout: float) -> CommandResult:
        self.ran.append(list(argv))
        out = f"JobId=77 JobName=t\n   Comment={self.comment}\n   Priority=1\n"
        return CommandResult(tuple(argv), 0, out if argv[1] == "show" else "", "")


@pytest.mark.parametrize(("current", "written"), [
    ("my sweep 12, lr=3e-4", False),
    ("(null)", True),
    ("gpuwarden: this job may wait 2h for 4 nodes under 1 leaf", True),
    ("gpuwarden-launch: lost c1 (rank 0: ...)", True)])
def test_the_users_own_job_comment_is_never_overwritten(current: str, written: bool) -> None:
    # D8: the whole Comment was replaced, the user's --comment with it.
    runner = Scontrol(current)
    JobComment("77", runner).lost([Lost(1, "c3", "no heartbeat for 10.2 s")])  # type: ignore[arg-type]
    updates = [a for a in runner.ran if a[1] == "update"]
    assert bool(updates) == written
    if written:
        assert updates[0][-1].startswith("Comment=gpuwarden-launch: lost c3")


def test_a_full_events_disk_neither_stops_the_launcher_nor_leaves_the_step_running(
        rank: list[str]) -> None:
    # D9: the write raised out of the launcher, and the step ran on without it.
    class Full(io.StringIO):
        def write(self, s: str) -> int:
            raise OSError(28, "No space left on device")

    Events(Full())("launch", job="1")  # logged, not raised

    class Raises(Events):
        def __call__(self, event: str, **fields: Any) -> None:
            super().__call__(event, **fields)
            if event == "all_beating":
                raise RuntimeError("a bug in the launcher")

    steps = LocalSteps("9400")
    with pytest.raises(RuntimeError):
        launch("9400", ["n0", "n1", "n2"], [*rank, "gen1_forever"], S, steps, Recorded(),
               Raises(), "127.0.0.1")
    step = steps.started[0]
    deadline = time.monotonic() + 10
    while any(p.poll() is None for p in step.procs.values()):
        assert time.monotonic() < deadline, "the ranks outlived the launcher"
        time.sleep(0.02)
    steps.reap()


def test_the_launchers_variables_reach_the_ranks_under_export_none() -> None:
    # srun would inherit SLURM_EXPORT_ENV=NONE from `sbatch --export=NONE`.
    argv = srun_argv("srun", "9", ["a", "b"], ["python", "t.py"])
    assert "--export=ALL" in argv and argv.index("--export=ALL") < argv.index("python")
    assert not [a for a in argv if a.startswith("--export=") and a != "--export=ALL"]


# ---- a second review (issue 18) -----------------------------------------------------------
def test_survivors_whose_collective_fails_on_the_lost_peer_get_a_spare(rank: list[str],
                                                                       tmp_path: Path) -> None:
    # R1: with real collectives the survivors exit 1 as soon as their peer's node is gone;
    # that was taken for the program's own failure: rc 1, no spare, no requeue.
    gone = tmp_path / "peer_gone"

    def peers_notice() -> None:
        time.sleep(0.2)
        gone.touch()
    rc, ev, rep = lose_n1(LocalSteps("9410"), [*rank, "peer_exit", str(gone)],
                          ["n0", "n1", "n2", "n3"], S, then=peers_notice)
    assert rc == 0, ev.seen
    assert [x.node for x in rep.so_far] == ["n1"]
    assert [e["nodes"] for e in ev.named("step_started")] == [["n0", "n1", "n2"],
                                                              ["n0", "n3", "n2"]]
    assert not ev.named("failed")


@pytest.fixture
def tables(monkeypatch: pytest.MonkeyPatch) -> list[BeatTable]:
    """The beat tables the launcher makes: what it has heard of each rank."""
    made: list[BeatTable] = []

    class Kept(BeatTable):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)
    monkeypatch.setattr(launcher, "BeatTable", Kept)
    return made


class LaunchTimesOut(LocalSteps):
    """A spare that is dead but not yet DOWN in slurmctld: the step is created, the other
    nodes' tasks start and beat, the launch RPC to the dead one times out and srun ends the
    step with exit ``code`` (1). Ended once the launcher has heard every other rank of the
    step (``tables``), not after a fixed time: whether they had beaten by then must not
    depend on how fast they start."""

    def __init__(self, job_id: str, down: str, tables: list[BeatTable], code: int = 1) -> None:
        super().__init__(job_id)
        self.down, self.tables, self.code = down, tables, code
        self.timing_out: set[str] = set()  # steps with the dead node

    def start(self, nodes: Any, env: Any, argv: Any) -> LocalStep:
        step = super().start(nodes, env, argv)
        if self.down in nodes:
            p = step.procs.pop(self.down)
            p.kill()
            p.wait()
            self.timing_out.add(step.step_id)
        return step

    def poll(self, step: Step) -> int | None:
        assert isinstance(step, LocalStep)
        if step.step_id in self.timing_out and step.code is None:
            if all(v.last is not None for v in self.tables[-1].views()
                   if step.nodes[v.rank] != self.down):
                self.end(step, self.code)  # the others gone before the status: as srun
            return step.code
        return super().poll(step)


def lose_n1(steps: LocalSteps, argv: list[str], nodes: list[str], s: LaunchSettings,
            then: Callable[[], None] | None = None) -> tuple[int, Events, Recorded]:
    """The launcher on ``nodes``; n1 dies once every rank beats (``then`` runs after).
    (rc, events, reports)."""
    ev, rep = Events(), Recorded()
    th, out = in_thread(lambda: launch(steps.job_id, nodes, argv, s, steps, rep, ev,
                                       "127.0.0.1"))
    while not ev.named("all_beating"):
        assert th.is_alive(), ev.seen
        time.sleep(0.02)
    steps.kill_node("n1")
    if then is not None:
        then()
    th.join(60)
    steps.reap()
    assert not th.is_alive(), ev.seen
    return out["rc"], ev, rep


def lose_n1_with_two_spares(steps: LocalSteps, rank: list[str]) -> tuple[int, Events, Recorded]:
    """Five nodes, two of them spares, every rank training until its node dies."""
    return lose_n1(steps, [*rank, "gen1_forever"], ["n0", "n1", "n2", "n3", "n4"],
                   replace(S, spares=2))


def test_a_dead_spare_whose_launch_times_out_is_passed_over_for_the_next(
        rank: list[str], tables: list[BeatTable]) -> None:
    # R2: the survivors beat, srun failed on the dead spare: rc 1 with a spare still left.
    rc, ev, rep = lose_n1_with_two_spares(LaunchTimesOut("9310", "n3", tables), rank)
    assert rc == 0, ev.seen
    assert [x.node for x in rep.so_far] == ["n1", "n3"]
    assert [e["nodes"] for e in ev.named("step_started")][-1] == ["n0", "n4", "n2"]


@pytest.mark.parametrize(("line", "want"), [
    ("srun: error: n2: task 1: Killed", {1: 137}),  # the OOM killer
    ("srun: error: n2: tasks 0,2: Segmentation fault (core dumped)", {0: 139, 2: 139}),
    ("srun: error: n3: task 4: Aborted (core dumped)", {4: 134}),  # NCCL's watchdog
    ("srun: error: n2: task 1: Exited with exit code 3", {1: 3}),
    ("srun: error: Node failure on n1", {}),
    ("srun: error: n2: task 1: something srun never says", {}),
])
def test_srun_s_signal_deaths_are_a_ranks_own_end(line: str, want: dict[int, int]) -> None:
    from gpuwarden.launch.steps import task_exits
    assert task_exits(line, 5) == want


def test_a_rank_killed_by_a_signal_on_a_live_node_is_the_programs_failure(
        rank: list[str]) -> None:
    # R3: only "Exited with exit code" was read: a segfaulting or OOM-killed rank fell silent,
    # and with another rank's exit 1 beside it, the silence was taken for a lost node (a
    # spare spent, the bug run again, at last a requeue loop).
    from gpuwarden.launch import decide
    from gpuwarden.launch.decide import Layout, ProgressWatch, RankView
    lay = Layout(("n0", "n1", "n2"), ("n3",))
    views = [RankView(0, "n0", 89.0, 5, False), RankView(1, "n1", 80.0, 5, False),
             RankView(2, "n2", 100.0, 5, False)]
    v = decide.judge(views, lay, 0, 100, replace(S, deadline_s=10, start_s=60), ProgressWatch(), None,
                     exits={0: 1, 1: 139})
    assert v.kind == "failed" and v.code == 1, v
    # The same silence on a node srun reported failed is a lost node, whatever it said of
    # the task there.
    v = decide.judge(views, lay, 0, 100, replace(S, deadline_s=10, start_s=60), ProgressWatch(), None,
                     failed_nodes=["n1"], exits={0: 1, 1: 137})
    assert v.kind == "lost" and [x.node for x in v.lost] == ["n1"], v


def test_a_time_limit_save_right_after_a_relaunch_requeues_and_spends_no_spare(
        rank: list[str], tables: list[BeatTable]) -> None:
    # R4: srun's 75 was taken for a failed launch on the fresh node: a spare spent seconds
    # before the kill, and the 75 the template requeues on was lost. Here the time-limit
    # warning comes right after the relaunch onto n3: the beating ranks save and exit 75, n3's
    # rank, still starting, dies of the signal; srun exits 75.
    rc, ev, rep = lose_n1_with_two_spares(
        LaunchTimesOut("9320", "n3", tables, code=EXIT_REQUEUE), rank)
    assert rc == EXIT_REQUEUE, ev.seen
    assert [x.node for x in rep.so_far] == ["n1"]
