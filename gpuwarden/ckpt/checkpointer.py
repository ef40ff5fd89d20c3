"""What a training job calls: save to node memory now, write back to slower tiers behind.

`save(step, state)` blocks only for the copy into tier 0; a background thread then copies the
step, read back and verified from tier 0, to each durable tier in order (shared filesystem,
S3). While a tier is unreachable the writer retries with backoff and training goes on; when it
comes back, the newest pending step goes first (older pending steps are superseded: only the
newest matters to a restart). A tier that fails does not hold back the others: the peers and
the first durable tier (the shared filesystem) share one writer, and each further durable
tier (S3) has a writer of its own, so an S3 request hanging until its timeouts never delays
the next step on the shared filesystem. Extra host memory stays at one copy of the state per
writer, the one it is writing back.

Replicas (tier 1, peers) are written first but are not durable: `wait_durable` waits for the
durable tiers only. Retention keeps `keep` steps per durable tier, never deletes a tier's newest
step, and never deletes a step that some rank may still need to restore from: everything from
the oldest of the ranks' newest durable steps on is kept (the coordinator knows it). It runs
after each commit (a new step is written before an old one goes: keep+1 steps exist while a
save is in flight) and once more at `close`, with the ranks' floor read afresh, so a finished
job holds `keep` steps per rank unless another rank still needs an older one.

Tier 0 keeps its newest `keep` steps and one more: the oldest of the steps the ranks publish as
held in node memory and on their replicas (without replicas: their newest durable step), which
is the step a restart after a node's loss takes, from memory if the survivors still hold it
(ranks save without a barrier, and the survivors train on until they are stopped). Only that
step, not every step from it on: a lost rank never publishes again, and must not make the
others hoard memory. The publishing and the reading of that floor run on a thread of their
own (`floor0`): the pruner never waits on the coordinator, and with the coordinator slow or
away (no floor read within `floor0.FLOOR_WAIT_S`) tier 0 keeps its newest `keep` only. The
guarantee holds while the ranks' published steps lag one another by fewer than `keep` saves:
a step a rank deleted before it became the floor is restored from a slower tier.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpuwarden.ckpt import nested
from gpuwarden.ckpt.codec import StateError, encode
from gpuwarden.ckpt.coord import Coordinator, SoloCoordinator
from gpuwarden.ckpt.floor0 import FLOOR_WAIT_S, MemoryFloor
from gpuwarden.ckpt.fstier import FsTier, Staged
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.names import check_step
from gpuwarden.ckpt.restore import Restored, listed, restore
from gpuwarden.ckpt.retention import readable, to_delete
from gpuwarden.ckpt.tier import CorruptStep, Tier, TierError

log = logging.getLogger(__name__)


def _metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """The manifest's metadata, refused at save when a restore could not read it back (the
    manifest's reader takes strings of text only: `safejson`)."""
    meta = dict(metadata or {})
    for k, v in meta.items():
        if not (isinstance(k, str) and isinstance(v, str)):
            raise StateError(f"metadata {str(k)[:40]!r}: keys and values must be str, not "
                             f"{type(k).__name__}: {type(v).__name__}")
        try:
            (k + v).encode("utf-8")
        except UnicodeEncodeError:
            raise StateError(f"metadata {k[:40]!r}: a lone surrogate is not text a manifest can "
                             "hold (decode file names with errors='replace')") from None
    return meta


class PendingSave:
    """A save whose `nested.Later` values are still to come (`Checkpointer.begin`)."""

    def __init__(self, ck: Checkpointer, staged: Staged, later: Mapping[str, nested.Later]) -> None:
        self._ck, self._staged, self._later = ck, staged, dict(later)
        ck._live.add(self)

    def commit(self) -> Manifest:
        """The Later values and the manifest into tier 0: the step is saved (write-back
        follows). A Later left unset is a StateError, and nothing is saved."""
        unset = [k for k, v in self._later.items() if v.value is None]
        if unset:
            self.abort()
            raise StateError(f"step {self._staged.manifest.step}: the late values of shards "
                             f"{unset} were never given: nothing saved")
        try:
            shards, data = encode({k: v.value for k, v in self._later.items()})
        except BaseException:
            self.abort()
            raise
        self._ck._live.discard(self)
        m = self._staged.commit(shards, data)
        self._ck._saved(m.step)
        return m

    def abort(self) -> None:
        self._ck._live.discard(self)
        self._staged.abort()


class _Lane:
    """One writer: the tiers it writes in order, the steps waiting for it, the one it is
    reading out of tier 0 (the Checkpointer's condition guards all but ``tiers``)."""

    def __init__(self, tiers: list[Any]) -> None:
        self.tiers = tiers
        self.pending: list[int] = []
        self.writing: int | None = None
        self.thread: threading.Thread | None = None

    @property
    def names(self) -> str:
        return ", ".join(t.name for t in self.tiers)


class Checkpointer:
    def __init__(self, job: str, tier0: FsTier, durable: Sequence[Any], rank: int = 0,
                 world_size: int = 1, keep: int = 2,
                 sleep: Callable[[float], None] = time.sleep,
                 replicas: Sequence[Any] = (), coord: Coordinator | None = None,
                 floor_wait_s: float = FLOOR_WAIT_S) -> None:
        if keep < 1:
            raise ValueError("keep must be at least 1: a tier's newest step is never deleted")
        self.job, self.rank, self.world_size, self.keep = job, rank, world_size, keep
        self.tier0 = tier0
        self.replicas = list(replicas)
        # A peer tier without a partner (none on another node) holds no replica.
        self._replicating = any(getattr(t, "partners", None) != [] for t in self.replicas)
        self.durable = list(durable)
        self.coord: Coordinator = coord or SoloCoordinator()
        self._sleep = sleep
        self._cv = threading.Condition()
        # The writers: peers and the first durable tier in one, each further durable tier in
        # its own (see the module's docstring).
        first = [*self.replicas, *self.durable[:1]]
        self._lanes = [_Lane(tiers) for tiers in ([first] if first else [])
                       + [[t] for t in self.durable[1:]]]
        self._done: dict[str, set[int]] = {t.name: set() for t in (*self.replicas, *self.durable)}
        self._closed = False
        self._refused: set[tuple[str, int]] = set()  # copies restore could not use: kept
        # Saves begun and not yet committed (a DCP save another rank's failure ended half
        # way): `close` frees their bytes in node memory.
        self._live: weakref.WeakSet[PendingSave] = weakref.WeakSet()
        for i, lane in enumerate(self._lanes):
            lane.thread = threading.Thread(target=self._writeback, args=(lane,),
                                           name=f"gpuwarden-ckpt-{i}", daemon=True)
            lane.thread.start()
        # Tier 0's retention runs beside the save, not in it: freeing a step's pages takes
        # as long as a good part of writing them, and the training loop need not wait for it.
        # Its own thread, not the writer's, so that a durable tier retried for minutes never
        # leaves node memory to fill up.
        self._prune_due = False
        # Node memory's floor, published and read off the pruner's thread (one rank: none).
        self._floor0 = None if world_size == 1 else MemoryFloor(
            self.coord, tier0.name, self._floor_read, wait_s=floor_wait_s)
        self._janitor = threading.Thread(target=self._prune_tier0, name="gpuwarden-ckpt-prune",
                                         daemon=True)
        self._janitor.start()

    # ---- the training loop's side -----------------------------------------------------------
    def save(self, step: int, state: Mapping[str, Any],
             metadata: Mapping[str, str] | None = None) -> Manifest:
        return self.begin(step, state, metadata).commit()

    def begin(self, step: int, state: Mapping[str, Any],
              metadata: Mapping[str, str] | None = None) -> PendingSave:
        """The first half of `save`: every shard but the `nested.Later` leaves written into
        tier 0, nothing visible until `PendingSave.commit` (after each Later is set)."""
        check_step(step)
        if nested.is_flat(state):
            if nested.STRUCTURE in state:
                raise StateError(f"state key {nested.STRUCTURE!r} is reserved")
        else:
            state = nested.flatten(state)  # a torch state_dict, nested dicts, scalars
        later = {k: v for k, v in state.items() if isinstance(v, nested.Later)}
        shards, data = encode({k: v for k, v in state.items() if k not in later}, hashed=False)
        header = Manifest(self.job, step, self.world_size, self.rank, tuple(shards), time.time(),
                          _metadata(metadata))
        # The only part the caller waits for; the checksums are computed while writing.
        return PendingSave(self, self.tier0.stage(header, data, hash_while_writing=True), later)

    def _saved(self, step: int) -> None:
        with self._cv:
            for lane in self._lanes:
                lane.pending.append(step)
            self._prune_due = True
            self._cv.notify_all()

    def wait_durable(self, step: int, timeout: float | None = None) -> bool:
        """True once ``step`` (or a newer one) is on every durable tier."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while not all(any(s >= step for s in self._done[t.name]) for t in self.durable):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def durable_step(self) -> int | None:
        """The newest step this rank has on every durable tier (None: none yet)."""
        if not self.durable:
            return None
        with self._cv:
            newest = [max(self._done[t.name], default=-1) for t in self.durable]
        low = min(newest)
        return low if low >= 0 else None

    def tiers(self) -> list[Tier]:
        """Fastest first: what restore tries."""
        return [self.tier0, *self.replicas, *self.durable]

    def held(self) -> list[int]:
        """Every step this rank could restore from some tier (unverified: listing only)."""
        return self.listing()[0]

    def listing(self, durable_only: bool = False) -> tuple[list[int], list[str]]:
        """`held`, and why the tiers left out of it could not be listed (each tier on its own:
        one that fails does not hide the others). ``durable_only``: the durable tiers' steps,
        the ones other ranks can read too."""
        held, failed = listed(self.durable if durable_only else self.tiers())
        return sorted(set().union(*held.values())), failed

    def latest(self) -> int | None:
        steps = self.held()
        return steps[-1] if steps else None

    def restore(self, at_most: int | None = None, mapped: bool = False,
                durable_only: bool = False) -> Restored | None:
        """Read-only: see `restore.restore` for what it returns and raises. The copies it
        could not use are remembered: `forget_newer` leaves them in place. ``durable_only``:
        from the durable tiers alone (what other ranks can read)."""
        return restore(self.durable if durable_only else self.tiers(), at_most=at_most,
                       refused=self._refused, mapped=mapped)

    def close(self, timeout: float | None = None) -> None:
        for pending in list(self._live):
            pending.abort()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())
        for lane in self._lanes:
            if lane.thread is not None:
                lane.thread.join(left())
        self._janitor.join(left())
        alive = any(lane.thread is not None and lane.thread.is_alive() for lane in self._lanes)
        if not (alive or self._janitor.is_alive()):
            # The pruner may have stopped while the writer still held a step back.
            self.prune_tier0()
            self.prune_durable()
        if self._floor0 is not None:
            self._floor0.stop(left())

    def prune_tier0(self) -> None:
        """Tier 0's retention with the ranks' floor read afresh, waiting for it at most
        ``floor_wait_s`` (the last pass: `close`, and `finish` once every rank is done). Call
        it only with the writers stopped."""
        self._retain_tier0(fresh=True)

    def prune_durable(self) -> None:
        """Retention on every durable tier with the ranks' floor read afresh: the last pass,
        once the writers are done. The writer's pass after each commit used the floor as it
        was then (other ranks' commits of that step still to come, the floor cached for a
        few seconds), so without this pass a finished job keeps a step more than ``keep``
        per rank. It still keeps what another rank needs (its newest durable step, when that
        is older). Call it only with the writers stopped (`close`)."""
        for tier in self.durable:
            with self._cv:
                wrote = bool(self._done[tier.name])
            if not wrote:
                continue  # nothing committed there by this run (a tier away): leave it be
            try:
                floor = self.coord.durable_floor(tier.name, fresh=True)
            except OSError as exc:
                log.warning("cannot read the ranks' durable steps (%s): deleting nothing", exc)
                continue
            self._retain(tier, protect=set(), floor=floor)

    def _held_for_writer(self) -> set[int]:
        """Tier-0 steps retention must leave: the one the writer will take next (older pending
        ones are superseded) and the one it is reading now."""
        with self._cv:
            held: set[int] = set()
            for lane in self._lanes:
                if lane.pending:
                    held.add(max(lane.pending))
                if lane.writing is not None:
                    held.add(lane.writing)
            return held

    def _prune_tier0(self) -> None:
        again: float | None = None  # seconds: a floor read awaited, look again by then
        while True:
            with self._cv:
                deadline = None if again is None else time.monotonic() + again
                while not self._prune_due and not self._closed:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._cv.wait(left)
                if self._closed and not self._prune_due:
                    return
                self._prune_due = False
            again = self._retain_tier0()

    def _floor_read(self) -> None:
        """The floor thread read the ranks' floor: the pruner looks again."""
        with self._cv:
            self._prune_due = True
            self._cv.notify_all()

    def _retain_tier0(self, fresh: bool = False) -> float | None:
        """All but the newest ``keep`` steps go from tier 0, except the writer's and the ranks'
        floor for tier 0 (`floor0.MemoryFloor`): at most keep + 1 steps beyond the writer's,
        and for a few seconds those the floor may have risen to. Returns in how many seconds
        to look again (None: after the next save). A failure is logged and retried after the
        next save (the writer never waits on it). No coordinator I/O unless ``fresh``."""
        try:
            mine = self._memory_step()
            doomed = to_delete(self.tier0, self.keep, self._held_for_writer())[0]
            spare: set[int] = set()
            again = None
            if self._floor0 is not None and fresh:
                floor = self._floor0.final(mine, read=bool(doomed))
                spare = set() if floor is None else {floor}
            elif self._floor0 is not None:
                self._floor0.publish(mine)
                if doomed:
                    spare, again = self._floor0.keep(doomed)
            for s in doomed:
                # Tier 0's list may be older than the writer's latest step: ask again.
                if s in spare or s in self._held_for_writer():
                    continue
                self.tier0.delete(s)
            return again
        except Exception as exc:
            log.warning("retention on %s failed (%s); retrying after the next save",
                        self.tier0.name, exc)
            return None

    def _memory_step(self) -> int | None:
        """The step this rank publishes (under tier 0's name, as durable steps are) as the one
        its restart takes whether or not its node is lost: the newest it holds in node memory
        and on every replica (one still being written when the node went is not held); with no
        replica working, its newest durable step (what a lost rank restores)."""
        if self.world_size == 1:
            return None
        if not self._replicating:
            return self.durable_step()
        held = set(self.tier0.steps())
        with self._cv:
            for t in self.replicas:
                held &= self._done[t.name]
        return max(held, default=None)

    def _loaded(self, lane: _Lane) -> None:
        """The writer has its step in memory (or gave up on it): tier 0 may let it go."""
        with self._cv:
            if lane.writing is not None:
                lane.writing = None
                self._prune_due = True
                self._cv.notify_all()

    # ---- the writer -------------------------------------------------------------------------
    def _writeback(self, lane: _Lane) -> None:
        while True:
            with self._cv:
                while not lane.pending and not self._closed:
                    self._cv.wait()
                if not lane.pending:
                    return
                step = max(lane.pending)
                superseded = [s for s in lane.pending if s < step]
                if superseded:
                    log.info("write-back to %s is behind: steps %s superseded by %d",
                             lane.names, superseded, step)
                lane.pending = []
                lane.writing = step
            try:
                self._write_everywhere(lane, step)
            finally:
                self._loaded(lane)

    def _write_everywhere(self, lane: _Lane, step: int) -> None:
        try:
            self._write_step(lane, step)
        except Exception:  # a bug must not end write-back for the rest of the job
            log.exception("write-back of step %d failed; going on with the next step", step)

    def _write_step(self, lane: _Lane, step: int) -> None:
        try:
            manifest, data = self.tier0.load(step)
        except CorruptStep as exc:
            log.error("step %d cannot be written back: %s", step, exc)
            return
        finally:
            # Retention held the step back while it was read: free it now (the writer has
            # its copy), not only after the next save.
            self._loaded(lane)
        todo = list(lane.tiers)
        delay = 1.0
        while True:
            failed = []
            for tier in todo:
                try:
                    tier.commit(manifest, data)
                except TierError as exc:
                    log.warning("%s; will retry (training goes on)", exc)
                    failed.append(tier)
                    continue
                self._committed(tier, step)
            if not failed:
                return
            with self._cv:
                newer = any(s > step for s in lane.pending)
                closing = self._closed and not lane.pending
            names = ", ".join(t.name for t in failed)
            if newer:
                log.warning("step %d not written to %s: a newer step supersedes it", step, names)
                return
            if closing:
                log.error("closing with step %d not on %s", step, names)
                return
            self._sleep(delay * (0.5 + random.random() / 2))  # noqa: S311 - jitter
            delay = min(delay * 2, 60.0)
            todo = failed

    def _committed(self, tier: Any, step: int) -> None:
        with self._cv:
            self._done[tier.name].add(step)
            if (tier in self.replicas if self._replicating else tier in self.durable):
                self._prune_due = True  # maybe a step to publish (`_memory_step`)
            self._cv.notify_all()
        if tier not in self.durable:
            # Replicas keep their own few steps (`peer.PeerServer`): a lost rank pushes no
            # more, so the replica its restart takes stays there without a floor.
            return
        try:
            self.coord.publish_durable(tier.name, step)
        except OSError as exc:
            log.warning("cannot publish step %d as durable on %s: %s", step, tier.name, exc)
        self._retain(tier, protect={step}, floor=self._floor(tier.name))

    def _floor(self, tier: str) -> int | None:
        try:
            return self.coord.durable_floor(tier)
        except OSError as exc:
            log.warning("cannot read the ranks' durable steps (%s): deleting nothing", exc)
            return None

    def _retain(self, tier: Any, protect: set[int], floor: int | None) -> None:
        """Delete all but the newest ``keep`` steps of a durable tier, except protected ones
        and any step from ``floor`` on (None: floor unknown, delete nothing). A failure is
        logged and retried at the next step: it must never stop the writer."""
        if floor is None:
            return
        try:
            for s in to_delete(tier, self.keep, protect, floor)[0]:
                tier.delete(s)
        except Exception as exc:
            log.warning("retention on %s failed (%s); retrying after the next save",
                        tier.name, exc)

    def forget_newer(self, step: int | None) -> None:
        """After a restore of ``step`` (None: a fresh start): delete this rank's steps newer
        than it on every tier it writes, so that a step of an abandoned run (saved before a
        requeue, never held by every rank) cannot be taken for this run's step of the same
        number, and publish what is durable now, and what node memory holds (stale values
        from the abandoned run would move retention's floors).

        Only steps that read as this job's and rank's go: a copy restore refused, or whose
        manifest is refused now, is left in place and logged (`retention`); another user's
        step is never listed."""
        for tier in (self.tier0, *self.durable):
            try:
                steps = tier.steps()
                newer = readable(tier, [s for s in steps if step is None or s > step],
                                 self._refused)[0]
                for s in newer:
                    tier.delete(s)
                if newer:
                    log.info("%s: dropped steps %s of an earlier run, newer than step %s",
                             tier.name, newer, step)
                held = step if step is not None and step in steps else -1
                if tier in self.durable:
                    self.coord.publish_durable(tier.name, held)
                elif self._floor0 is not None:  # tier 0: what it holds now, not the earlier run's
                    self.coord.publish_durable(tier.name, held)
                    self._floor0.published(held)
            except Exception as exc:
                log.warning("%s: cannot drop newer steps of an earlier run: %s", tier.name, exc)
