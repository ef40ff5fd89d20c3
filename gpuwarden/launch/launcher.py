"""The launcher's loop: start the step, watch it, on a lost node end it and relaunch it on the
survivors plus a spare; requeue (exit 75) when no spare is left or a hang comes back.

    rc = launch(job_id, nodes, argv, settings, steps, reporter, events)

runs until the training ends and returns the batch script's exit status: the training's own,
or 75 for the template's requeue path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Protocol

from gpuwarden.launch import decide
from gpuwarden.launch.decide import Layout, Lost, ProgressWatch, Verdict
from gpuwarden.launch.heartbeat import BeatTable, UdpReceiver
from gpuwarden.launch.report import Events, Reporter
from gpuwarden.launch.settings import EXIT_REQUEUE, LaunchSettings
from gpuwarden.launch.steps import Step, StepError, Steps

log = logging.getLogger(__name__)

# The launcher could no longer watch its step (a bug of its own): ended, never requeued (it
# would fail the same way again).
EXIT_BLIND = 1


class Clock(Protocol):
    def monotonic(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...


class RealClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class Launcher:
    def __init__(self, argv: Sequence[str], layout: Layout, steps: Steps, table: BeatTable,
                 beat_addr: str, reporter: Reporter, s: LaunchSettings, events: Events,
                 clock: Clock | None = None, leaf_of: Mapping[str, str] | None = None) -> None:
        self.argv, self.layout, self.steps, self.table = list(argv), layout, steps, table
        self.beat_addr, self.reporter, self.s, self.events = beat_addr, reporter, s, events
        self.clock = clock or RealClock()
        self.leaf_of = dict(leaf_of or {})
        self.gen = 0
        self.step: Step | None = None  # the running one, ended if the launcher fails

    def run(self) -> int:
        try:
            return self._run()
        except BaseException:
            # Whatever went wrong here, the step must not outlive its launcher.
            if self.step is not None and self.steps.poll(self.step) is None:
                log.error("the launcher failed: ending step %s", self.table.step_id())
                self.steps.cancel(self.step, self.table.step_id())
                self.steps.kill(self.step)
            raise

    def _run(self) -> int:
        hangs = 0
        watch = ProgressWatch()
        fresh: tuple[str, ...] = ()  # nodes this launch runs on that the last one did not
        while True:
            self.gen += 1
            self.table.begin(self.gen, len(self.layout.ranks))
            try:
                self.step = step = self.steps.start(
                    self.layout.ranks, self.table.env(self.beat_addr, self.s.beat_s), self.argv)
            except StepError as exc:
                before = set(self.layout.ranks) - set(fresh)  # what did start before
                if not self._refused(exc):
                    return EXIT_REQUEUE
                fresh = tuple(n for n in self.layout.ranks if n not in before)
                continue
            started = self.clock.monotonic()
            watch.begin(started)
            self.events("step_started", gen=self.gen, nodes=list(self.layout.ranks),
                        spares=list(self.layout.spares))
            try:
                v = self._watch(step, started, watch, fresh)
            except StepError as exc:
                log.error("cannot watch the step any more (%s): ending it", exc)
                v = Verdict("failed", code=EXIT_BLIND, why=f"cannot watch the step: {exc}")
            if v.kind == "exited":
                assert v.code is not None
                self.events("exited", gen=self.gen, code=v.code, why=v.why)
                return v.code
            if v.kind == "failed":
                assert v.code is not None
                self.events("failed", gen=self.gen, code=v.code, why=v.why)
                self._end(step, list(range(len(self.layout.ranks))))
                return v.code
            if v.kind == "lost":
                self.events("lost", gen=self.gen, lost=[asdict(x) for x in v.lost])
                self.reporter.lost(v.lost)
                gone = {x.rank for x in v.lost}
                self._end(step, [r for r in range(len(self.layout.ranks)) if r not in gone])
                before = set(self.layout.ranks)
                if not self._replace(v.lost):
                    return EXIT_REQUEUE
                fresh = tuple(n for n in self.layout.ranks if n not in before)
                continue
            if v.kind == "blind":  # only after a relaunch: see _watch
                self.events("requeue", why=v.why)
                self._end(step, list(range(len(self.layout.ranks))))
                return EXIT_REQUEUE
            self.events("hung", gen=self.gen, why=v.why)
            self._end(step, list(range(len(self.layout.ranks))))
            fresh = ()
            if not decide.after_hang(hangs, self.s):
                self.events("requeue", why=f"hung again after {hangs} relaunch(es)")
                return EXIT_REQUEUE
            hangs += 1

    def _refused(self, exc: StepError) -> bool:
        """srun refused the step: nodes it names as down (another node of a correlated
        failure) are lost and replaced while spares last. False: requeue."""
        down = [n for n in exc.nodes if n in self.layout.ranks]
        if not down or not self.layout.spares:
            self.events("requeue", why=f"cannot start the step: {exc}")
            return False
        lost = [Lost(self.layout.ranks.index(n), n, f"the step was refused: {exc}")
                for n in down]
        self.events("lost", gen=self.gen, lost=[asdict(x) for x in lost])
        self.reporter.lost(lost)
        return self._replace(lost)

    def _replace(self, lost: Sequence[Lost]) -> bool:
        new = decide.replace_lost(self.layout, [x.node for x in lost], self.leaf_of)
        if new is None:
            self.events("requeue", why=f"{len(lost)} node(s) lost, "
                                       f"{len(self.layout.spares)} spare(s) left")
            return False
        self.layout = new
        return True

    def _watch(self, step: Step, started: float, watch: ProgressWatch,
               fresh: Sequence[str]) -> Verdict:
        said: set[str] = set()
        failed_at: float | None = None
        done_at: float | None = None
        while True:
            broken = self.steps.broken(step)
            if broken is not None:
                raise StepError(broken)
            code = self.steps.poll(step)
            exits = self.steps.exits(step)
            now = self.clock.monotonic()
            views = self.table.views()
            placed = decide.adopt(self.layout, [v.host for v in views])
            if placed != self.layout:
                self.events("placement", gen=self.gen, asked=list(self.layout.ranks),
                            got=list(placed.ranks))
                self.layout = placed
            watch.see(views, now)
            v = decide.judge(views, self.layout, started, now, self.s, watch, code,
                             self.steps.failed_nodes(step), exits)
            never = [Lost(r, n, "its rank never beat after the relaunch onto it")
                     for r, n in enumerate(self.layout.ranks)
                     if n in fresh and views[r].last is None and r not in exits]
            saving = code == EXIT_REQUEUE or EXIT_REQUEUE in exits.values()
            if never and code not in (None, 0) and not saving and any(
                    x.last is not None for x in views):
                # srun ended the step while the other nodes' ranks ran: it could not launch
                # on these (a dead node slurmctld does not know is down yet).
                return Verdict("lost", lost=tuple(never))
            if fresh and all(x.last is None for x in views) and (
                    (code is not None and code != 0)
                    or (v.kind == "blind" and now - started >= self.s.start_s)):
                # A relaunch whose srun failed or hangs before any rank beat: a dead spare
                # (slurmctld refuses or retries the step). The next spare, else requeue.
                if never:
                    return Verdict("lost", lost=tuple(never))
                return Verdict("blind", why=f"the relaunch started no rank (srun: {code})")
            if v.kind == "failed":
                # srun waits for every task (--kill-on-bad-exit=0): the others may block in a
                # collective; they have a deadline to end by themselves, then the step ends.
                # A node lost meanwhile (silent past the deadline) is found within it and
                # explains the failure (decide.judge); one beat more against a late datagram.
                failed_at = now if failed_at is None else failed_at
                if now - failed_at >= self.s.deadline_s + self.s.beat_s:
                    return v
            elif v.kind not in ("running", "blind"):
                return v
            if views and all(x.done or x.rank in exits for x in views) and code is None:
                # Training is over; a rank stuck at exit (a destructor, a thread) must not hold
                # the allocation: stop_s, then the step ends with what the ranks said.
                done_at = now if done_at is None else done_at
                if now - done_at >= self.s.stop_s:
                    stuck = [x.rank for x in views if x.rank not in exits and x.last is not None
                             and now - x.last < 3 * self.s.beat_s]  # still beating
                    codes = sorted(exits.values())
                    rc = EXIT_REQUEUE if EXIT_REQUEUE in codes else (codes[-1] if codes else 0)
                    self.events("stuck_at_exit", gen=self.gen, ranks=stuck, code=rc)
                    self._end(step, [])
                    return Verdict("exited", code=rc, why=f"ranks {stuck} did not exit")
            self._note(said, v, views, watch, now - started)
            self.clock.sleep(self.s.poll_s)

    def _note(self, said: set[str], v: Verdict, views: Sequence[decide.RankView],
              watch: ProgressWatch, since: float) -> None:
        """Milestones of a launch, once each: for the log and for measuring recovery."""
        if v.kind == "blind" and "blind" not in said:
            said.add("blind")
            self.events("blind", gen=self.gen, why=v.why)
            log.error("%s: no spare is used on this; check that the training uses "
                      "JobCheckpointer.from_slurm and that its nodes reach %s", v.why,
                      self.beat_addr)
        if "beating" not in said and all(x.last is not None for x in views):
            said.add("beating")
            self.events("all_beating", gen=self.gen, after_s=round(since, 3))
        if "training" not in said and watch.value is not None:
            said.add("training")
            self.events("training", gen=self.gen, step=watch.value, after_s=round(since, 3))

    def _end(self, step: Step, survivors: Sequence[int]) -> None:
        """End the step: cancel it, wait (bounded) until the survivors' ranks are gone (their
        beats stopped: they no longer hold the GPUs the next step needs), then kill srun if
        it still waits for the lost node."""
        begun = self.clock.monotonic()
        self.steps.cancel(step, self.table.step_id())
        quiet_s = 3 * self.s.beat_s
        while True:
            now = self.clock.monotonic()
            alive = [v.rank for v in self.table.views()
                     if v.rank in survivors and v.last is not None and now - v.last < quiet_s]
            if not alive or now - begun >= self.s.stop_s:
                break
            self.clock.sleep(self.s.poll_s)
        if alive:
            log.warning("ranks %s still beat %g s after the cancel: starting anyway", alive,
                        self.s.stop_s)
        if self.steps.poll(step) is None:
            self.steps.kill(step)
        self.events("ended", gen=self.gen, after_s=round(self.clock.monotonic() - begun, 3),
                    still_beating=alive)


def launch(job_id: str, nodes: Sequence[str], argv: Sequence[str], s: LaunchSettings,
           steps: Steps, reporter: Reporter, events: Events, beat_host: str,
           beat_port: int = 0, leaf_of: Mapping[str, str] | None = None,
           clock: Clock | None = None) -> int:
    """Run ``argv`` on the allocation ``nodes`` with ``s.spares`` of them kept idle; returns
    the exit status for the batch script. ValueError when the allocation cannot hold them."""
    layout = decide.plan(nodes, s.spares)
    table = BeatTable(job_id)
    receiver = UdpReceiver(table, port=beat_port)
    addr = f"{beat_host}:{receiver.port}"
    events("launch", job=job_id, nodes=list(layout.ranks), spares=list(layout.spares),
           beats=addr, settings=asdict(s))
    try:
        return Launcher(argv, layout, steps, table, addr, reporter, s, events, clock,
                        leaf_of).run()
    finally:
        receiver.stop()
        if table.refused:
            log.warning("%d heartbeat datagrams were refused (no valid token)", table.refused)
