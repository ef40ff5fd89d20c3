"""Heartbeats from a rank to `gpuwarden launch`: alive, and how far training got.

Started by `JobCheckpointer.from_slurm` when the launcher's variables are in the environment
(a step that `gpuwarden launch` started), so training scripts need no change. A daemon thread
sends one UDP datagram every ``beat_s``; the launcher tells a lost node (beats stop) from a
hung job (beats go on, progress stops). Each datagram carries an HMAC-SHA256 with a random
token only the launcher and this step's environment hold; see `gpuwarden.launch.heartbeat`.

Light on purpose (no numpy): the launcher on the batch host imports the wire format from here.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from gpuwarden.core import safejson

log = logging.getLogger(__name__)

ENV_ADDR = "GPUWARDEN_LAUNCH_BEAT"  # host:port of the launcher's receiver
ENV_TOKEN = "GPUWARDEN_LAUNCH_TOKEN"  # noqa: S105 - the variable's name; hex, 32 random bytes per launcher
ENV_GEN = "GPUWARDEN_LAUNCH_GEN"  # which launch of the step (1, 2, ...): stale beats are dropped
ENV_BEAT_S = "GPUWARDEN_LAUNCH_BEAT_S"

MAGIC = b"GWB1"
MAC_LEN = 32
MAX_DATAGRAM = 1024
_DOMAIN = b"gpuwarden-beat\0"  # a MAC over a beat is never valid for anything else


class BadBeat(ValueError):
    """A datagram that is not a beat of this job with this token."""


@dataclass(frozen=True)
class Beat:
    job: str
    gen: int
    rank: int
    host: str
    step_id: str  # SLURM_STEP_ID: what the launcher passes to scancel
    seq: int  # rises with every beat of one rank process: a replayed datagram is refused
    progress: int  # the newest step saved or reported; -1 none yet in this launch
    done: bool  # the rank is finishing (`finish`): its silence from then on is no loss
    sent: float  # the rank's wall clock, for the log only (deadlines use the receiver's clock)


def encode(token: bytes, beat: Beat) -> bytes:
    payload = json.dumps(asdict(beat), separators=(",", ":")).encode()
    return MAGIC + hmac.new(token, _DOMAIN + payload, hashlib.sha256).digest() + payload


_FIELDS: dict[str, type | tuple[type, ...]] = {
    "job": str, "gen": int, "rank": int, "host": str, "step_id": str, "seq": int,
    "progress": int, "done": bool, "sent": (int, float)}


def decode(token: bytes, data: bytes) -> Beat:
    """The beat, or BadBeat: the MAC is checked before anything is parsed."""
    if len(data) > MAX_DATAGRAM or not data.startswith(MAGIC):
        raise BadBeat("not a gpuwarden beat")
    mac, payload = data[len(MAGIC):len(MAGIC) + MAC_LEN], data[len(MAGIC) + MAC_LEN:]
    if not hmac.compare_digest(mac, hmac.new(token, _DOMAIN + payload, hashlib.sha256).digest()):
        raise BadBeat("wrong MAC: not sent with this launcher's token")
    try:
        raw = safejson.loads(payload, max_bytes=MAX_DATAGRAM)
    except safejson.JsonError as exc:
        raise BadBeat(f"payload: {exc}") from None
    if not isinstance(raw, dict) or set(raw) != set(_FIELDS):
        raise BadBeat("payload does not have a beat's fields")
    for key, tp in _FIELDS.items():
        value = raw[key]
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise BadBeat(f"{key}: {str(value)[:20]!r} has the wrong type")
    return Beat(**raw)


class Beater:
    """Sends this rank's beats until the process ends (a daemon thread). Never raises into
    training: a send that fails is logged once and tried again at the next beat."""

    def __init__(self, addr: tuple[str, int], token: bytes, job: str, gen: int, rank: int,
                 host: str, step_id: str, every_s: float) -> None:
        self.addr, self.token, self.every_s = addr, token, every_s
        self._fixed = (job, gen, rank, host, step_id)
        self._lock = threading.Lock()
        self._progress, self._done, self._seq = -1, False, 0
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._target: tuple[str, int] | None = None
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="gpuwarden-beat", daemon=True)
        self._thread.start()

    def progress(self, step: int) -> None:
        with self._lock:
            self._progress = max(self._progress, step)

    def done(self) -> None:
        """The rank is finishing: beats go on (it is alive) but its silence is no loss."""
        with self._lock:
            self._done = True
        self.beat()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2 * self.every_s + 1)
        self._sock.close()

    def beat(self) -> None:
        job, gen, rank, host, step_id = self._fixed
        with self._lock:
            self._seq += 1
            b = Beat(job, gen, rank, host, step_id, self._seq, self._progress, self._done,
                     time.time())
        try:
            if self._target is None:
                # Resolved once: a name lookup per beat would add the resolver's stalls.
                info = socket.getaddrinfo(self.addr[0], self.addr[1], socket.AF_INET,
                                          socket.SOCK_DGRAM)
                self._target = (str(info[0][4][0]), int(info[0][4][1]))
            self._sock.sendto(encode(self.token, b), self._target)
        except OSError as exc:
            if not self._warned:
                log.warning("rank %d: heartbeat to %s:%d failed (%s); retrying every %g s",
                            rank, self.addr[0], self.addr[1], exc, self.every_s)
                self._warned = True

    def _run(self) -> None:
        while not self._stop.is_set():
            self.beat()
            self._stop.wait(self.every_s)


def from_env(environ: Mapping[str, str], job: str, rank: int, host: str,
             step_id: str) -> Beater | None:
    """A running Beater when this step was started by `gpuwarden launch`, else None.
    Malformed variables are logged and ignored: a training run never fails on them."""
    addr = environ.get(ENV_ADDR)
    if not addr:
        return None
    try:
        name, _, port = addr.rpartition(":")
        token = bytes.fromhex(environ.get(ENV_TOKEN, ""))
        gen, every = int(environ.get(ENV_GEN, "")), float(environ.get(ENV_BEAT_S, "1"))
        if not name or len(token) != 32 or not 0 < every <= 60:
            raise ValueError("incomplete")
        return Beater((name, int(port)), token, job, gen, rank, host, step_id, every)
    except ValueError as exc:
        log.error("rank %d: %s=%r and the other %s* variables do not form a heartbeat target "
                  "(%s): no heartbeats, `gpuwarden launch` cannot watch this rank", rank,
                  ENV_ADDR, addr[:60], ENV_ADDR.rsplit("_", 1)[0], exc)
        return None
