"""Node memory's floor: the step this rank holds in memory, published, and the oldest of the
ranks' such steps, read, on a thread of their own.

Tier 0's pruner must never wait on the coordinator (a shared filesystem that stalls, a
coordinator host out of reach: seconds a call, or forever), or node memory fills up while it
waits. It hands this thread the step to publish and asks it for a fresh floor; until one newer
than its question comes back it keeps the steps the floor could be, for at most ``wait_s``;
after that the floor counts as unknown and the pruner deletes as if there were none (memory
stays bounded; a warning says so, once until a read comes back). Fresh reads are coalesced, at
most one every ``gap_s``: with `FileCoordinator` each is a file per rank on the shared
filesystem, for every rank.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from gpuwarden.ckpt.coord import Coordinator

log = logging.getLogger(__name__)

FLOOR_WAIT_S = 5.0  # how long the pruner keeps a step for a floor read that has not come back
READ_GAP_S = 1.0  # fresh reads at most this often


class MemoryFloor:
    """Publishes this rank's step in node memory and reads the ranks' floor for it (``tier``),
    off the pruner's thread. ``on_read``: called after each read (the pruner looks again)."""

    def __init__(self, coord: Coordinator, tier: str, on_read: Callable[[], None],
                 wait_s: float = FLOOR_WAIT_S, gap_s: float = READ_GAP_S) -> None:
        self.coord, self.tier, self._on_read = coord, tier, on_read
        self.wait_s, self.gap_s = wait_s, gap_s
        self._cv = threading.Condition()
        self._published: int | None = None
        self._to_publish: int | None = None
        self._floor: int | None = None  # the last read's (None: unknown)
        self._asked = 0  # questions asked (numbered); the one open was asked at _asked_at
        self._asked_at: float | None = None
        self._answered = 0  # the newest question a read has answered
        self._read_at = float("-inf")  # when the last read began
        self._warned = False
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="gpuwarden-ckpt-floor",
                                        daemon=True)
        self._thread.start()

    # ---- the pruner's side: no I/O ----------------------------------------------------------
    def publish(self, step: int | None) -> None:
        """``step`` is this rank's step in memory now: published behind, if newer."""
        with self._cv:
            known = [s for s in (self._published, self._to_publish) if s is not None]
            if step is None or step <= max(known, default=-1):
                return
            self._to_publish = step
            self._cv.notify_all()

    def published(self, step: int) -> None:
        """The caller published ``step`` itself (`Checkpointer.forget_newer`)."""
        with self._cv:
            self._published, self._to_publish = step, None

    def keep(self, doomed: list[int]) -> tuple[set[int], float | None]:
        """Which of ``doomed`` to keep now, and in how many seconds to look again (None: on
        the next save or read). Below the last floor read a step goes; at or above it, the
        floor may have risen to it: kept until a read newer than the question answers, then
        only the floor is kept; after ``wait_s`` without one, none is."""
        with self._cv:
            floor = self._floor
            doubt = {s for s in doomed if floor is None or s >= floor}
            if not doubt:
                self._asked_at = None
                return set(), None
            if self._asked_at is not None and self._answered >= self._asked:
                self._asked_at = None  # answered: its floor decides
                return {floor} if floor is not None else set(), None
            now = time.monotonic()
            if self._asked_at is None:
                self._asked += 1
                self._asked_at = now
                self._cv.notify_all()
            left = self._asked_at + self.wait_s - now
            if left > 0:
                return doubt | ({floor} if floor is not None else set()), left
            if not self._warned:
                self._warned = True
                log.warning("the ranks' step in %s not read within %.0f s (the coordinator is "
                            "slow or away): node memory keeps its newest steps only, not the "
                            "one a restart after a lost node would take", self.tier, self.wait_s)
            return set(), None

    # ---- the last pass, and the end -----------------------------------------------------------
    def final(self, step: int | None, read: bool) -> int | None:
        """Publish ``step`` and (``read``) read the floor afresh, now, within ``wait_s``
        (None: not read, or not in time). The last pass: `Checkpointer.prune_tier0`."""
        out: list[int | None] = []

        def call() -> None:
            if step is not None and (self._published is None or step > self._published):
                self._publish(step)
            if read:
                out.append(self._read())
        worker = threading.Thread(target=call, name="gpuwarden-ckpt-floor-last", daemon=True)
        worker.start()
        worker.join(self.wait_s)
        if worker.is_alive():
            log.warning("the ranks' step in %s not read within %.0f s at close: node memory "
                        "keeps its newest steps only", self.tier, self.wait_s)
        return out[0] if out else None

    def stop(self, timeout: float | None = None) -> None:
        """End the thread (a call hung on the coordinator is left to its daemon thread)."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(self.wait_s if timeout is None else min(timeout, self.wait_s))

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._stopped:
                        return
                    due = self._read_at + self.gap_s - time.monotonic()
                    asked = self._asked > self._answered
                    if self._to_publish is not None or (asked and due <= 0):
                        break
                    self._cv.wait(due if asked else None)
                read = asked and due <= 0
            with self._cv:
                step, self._to_publish = self._to_publish, None
            if step is not None:
                self._publish(step)
            if read:
                self._read()
                self._on_read()

    def _publish(self, step: int) -> None:
        try:
            self.coord.publish_durable(self.tier, step)
        except Exception as exc:  # logged: a bug must not end the floor thread unseen
            log.warning("cannot publish step %d as held in %s: %s", step, self.tier, exc)
            return
        with self._cv:
            self._published = step if self._published is None else max(step, self._published)

    def _read(self) -> int | None:
        with self._cv:
            question, self._read_at = self._asked, time.monotonic()
        try:
            floor = self.coord.durable_floor(self.tier, fresh=True)
        except Exception as exc:  # logged: a bug must not end the floor thread unseen
            log.warning("cannot read the step every rank holds in %s (%s): keeping its newest "
                        "steps only", self.tier, exc)
            floor = None
        with self._cv:
            self._floor, self._answered = floor, max(question, self._answered)
            self._warned = False
        return floor
