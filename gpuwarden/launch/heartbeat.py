"""The launcher's side of the heartbeats: a UDP receiver and the table of what each rank said.

Authentication: the launcher draws a random 32-byte token and hands it to its step only, in
the step's environment (srun carries it to slurmd over Slurm's authenticated RPC). Another
user cannot read it: /proc/PID/environ is readable by the process's owner and root only, and
the token is in no file. A datagram counts only if its HMAC-SHA256 under that token checks,
it names this job and this launch (generation), and its sequence number is above the rank's
last one: a forged beat, a beat of another job or launch, and a replayed one are all refused.
Jobs of the same user can read each other's environments, but that user can cancel the job
anyway. Not the peer tier's job key: that needs `[ckpt] shared_root`, and a token that dies
with the launcher needs no file, no cleanup and no config on the batch host.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable

from gpuwarden.ckpt.beat import (
    ENV_ADDR,
    ENV_BEAT_S,
    ENV_GEN,
    ENV_TOKEN,
    MAX_DATAGRAM,
    BadBeat,
    Beat,
    decode,
)
from gpuwarden.launch.decide import RankView

log = logging.getLogger(__name__)


class BeatTable:
    """What each rank of the current launch last said, and when (on ``clock``, monotonic)."""

    def __init__(self, job: str, token: bytes | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.job = job
        self.token = token if token is not None else secrets.token_bytes(32)
        self.clock = clock
        self.gen, self.world = 0, 0
        self.refused = 0  # datagrams without this job's token, job, or a fresh sequence number
        self.stale = 0  # genuine beats of an earlier launch (its ranks are still ending)
        self._lock = threading.Lock()
        self._last: dict[int, tuple[float, Beat]] = {}
        self._seq: dict[tuple[int, int], int] = {}

    def begin(self, gen: int, world: int) -> None:
        """A new launch of ``world`` ranks: beats of earlier launches no longer count."""
        with self._lock:
            self.gen, self.world = gen, world
            self._last = {}

    def env(self, addr: str, beat_s: float) -> dict[str, str]:
        """What the step's environment needs for its ranks to beat to us."""
        return {ENV_ADDR: addr, ENV_TOKEN: self.token.hex(), ENV_GEN: str(self.gen),
                ENV_BEAT_S: repr(beat_s)}

    def offer(self, data: bytes, source: str = "?") -> str | None:
        """Take one datagram; returns why it was refused, or None when it counted."""
        try:
            b = decode(self.token, data)
        except BadBeat as exc:
            return self._refuse(source, str(exc))
        if b.job != self.job:
            return self._refuse(source, f"a beat of job {b.job[:20]!r}")
        with self._lock:
            key = (b.gen, b.rank)
            if b.seq <= self._seq.get(key, 0):
                why = f"rank {b.rank}: sequence {b.seq} already seen (a replay)"
            elif b.gen != self.gen:
                self._seq[key] = b.seq
                self.stale += 1
                return f"a beat of launch {b.gen}, not {self.gen}"
            elif not 0 <= b.rank < self.world:
                why = f"rank {b.rank} outside a world of {self.world}"
            else:
                self._seq[key] = b.seq
                self._last[b.rank] = (self.clock(), b)
                return None
        return self._refuse(source, why)

    def _refuse(self, source: str, why: str) -> str:
        self.refused += 1
        if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
            log.warning("heartbeat from %s refused (%d so far): %s", source, self.refused, why)
        return why

    def views(self) -> list[RankView]:
        with self._lock:
            last = dict(self._last)
            world = self.world
        out = []
        for r in range(world):
            if r in last:
                at, b = last[r]
                out.append(RankView(r, b.host, at, b.progress, b.done))
            else:
                out.append(RankView(r, None, None, -1, False))
        return out

    def step_id(self) -> str | None:
        """The Slurm step the current launch's ranks run in (from their beats)."""
        with self._lock:
            ids = {b.step_id for _at, b in self._last.values()}
        return ids.pop() if len(ids) == 1 else None


class UdpReceiver:
    """Reads datagrams into a BeatTable from a daemon thread until `stop`."""

    def __init__(self, table: BeatTable, host: str = "0.0.0.0", port: int = 0) -> None:  # noqa: S104 - every rank must reach it; the token guards it
        self.table = table
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((host, port))
        self._sock.settimeout(0.2)  # how soon `stop` is noticed
        self.port: int = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuwarden-beats", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data, source = self._sock.recvfrom(MAX_DATAGRAM + 1)
            except TimeoutError:
                continue
            except OSError as exc:
                if not self._stop.is_set():
                    log.error("heartbeat receiver: %s", exc)
                return
            self.table.offer(data, str(source[0]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        with contextlib.suppress(OSError):
            self._sock.close()
