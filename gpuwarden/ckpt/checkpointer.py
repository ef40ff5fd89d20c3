"""What a training job calls: save to node memory now, write back to slower tiers behind.

`save(step, state)` blocks only for the copy into tier 0; a background thread then copies the
step, read back and verified from tier 0, to each durable tier in order (shared filesystem,
S3). While a tier is unreachable the writer retries with backoff and training goes on; when it
comes back, the newest pending step goes first (older pending steps are superseded: only the
newest matters to a restart). Extra host memory stays at one copy of the state, the one being
written back. Retention keeps `keep` steps per tier and never deletes a tier's newest step.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpuwarden.ckpt.codec import encode
from gpuwarden.ckpt.fstier import CorruptStep, FsTier, TierError
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.names import check_step
from gpuwarden.ckpt.restore import Restored, Tier, restore

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, job: str, tier0: FsTier, durable: Sequence[Any], rank: int = 0,
                 world_size: int = 1, keep: int = 2,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1: a tier's newest step is never deleted")
        self.job, self.rank, self.world_size, self.keep = job, rank, world_size, keep
        self.tier0 = tier0
        self.durable = list(durable)
        self._sleep = sleep
        self._cv = threading.Condition()
        self._pending: list[int] = []
        self._done: dict[str, set[int]] = {t.name: set() for t in self.durable}
        self._closed = False
        self._thread = threading.Thread(target=self._writeback, name="gpuwarden-ckpt",
                                        daemon=True)
        self._thread.start()

    # ---- the training loop's side -----------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any],
             metadata: Mapping[str, str] | None = None) -> Manifest:
        check_step(step)
        shards, data = encode(state)
        m = Manifest(self.job, step, self.world_size, self.rank, tuple(shards), time.time(),
                     dict(metadata or {}))
        self.tier0.commit(m, data)  # the only part the caller waits for
        with self._cv:
            self._pending.append(step)
            self._cv.notify_all()
        self._retain(self.tier0, protect=set(self._pending))
        return m

    def wait_durable(self, step: int, timeout: float | None = None) -> bool:
        """True once ``step`` (or a newer one) is on every durable tier."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while not all(any(s >= step for s in done) for done in self._done.values()):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def latest(self) -> int | None:
        steps = [s for t in (self.tier0, *self.durable) for s in t.steps()]
        return max(steps) if steps else None

    def restore(self) -> Restored | None:
        tiers: list[Tier] = [self.tier0, *self.durable]
        return restore(tiers)

    def close(self, timeout: float | None = None) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)

    # ---- the writer -------------------------------------------------------------------------
    def _writeback(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait()
                if not self._pending:
                    return
                step = max(self._pending)
                superseded = [s for s in self._pending if s < step]
                if superseded:
                    log.info("write-back is behind: steps %s superseded by %d", superseded, step)
                self._pending = []
            self._write_everywhere(step)

    def _write_everywhere(self, step: int) -> None:
        try:
            manifest, data = self.tier0.load(step)
        except CorruptStep as exc:
            log.error("step %d cannot be written back: %s", step, exc)
            return
        for tier in self.durable:
            delay = 1.0
            while True:
                try:
                    tier.commit(manifest, data)
                    break
                except TierError as exc:
                    if self._closed_now():
                        log.error("closing with step %d not on %s: %s", step, tier.name, exc)
                        return
                    log.warning("%s; retrying in %.0f s (training goes on)", exc, delay)
                    self._sleep(delay * (0.5 + random.random() / 2))  # noqa: S311 - jitter
                    delay = min(delay * 2, 60.0)
            with self._cv:
                self._done[tier.name].add(step)
                self._cv.notify_all()
            self._retain(tier, protect={step})

    def _closed_now(self) -> bool:
        with self._cv:
            return self._closed and not self._pending

    def _retain(self, tier: Any, protect: set[int]) -> None:
        try:
            steps = tier.steps()
        except TierError as exc:
            log.warning("retention skipped on %s: %s", tier.name, exc)
            return
        for s in steps[:-self.keep]:
            if s not in protect:
                tier.delete(s)
