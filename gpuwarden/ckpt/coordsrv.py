"""The job's coordinator: agreement between its ranks where there is no shared filesystem.

Run on the batch host (the one node whose loss always ends the job) by the sbatch templates'
wrapper, listening on a port the kernel picks (``bind(0)``: nothing to squat); the ranks learn
``host:port`` from their environment and reach it with `coordnet.NetCoordinator`. It holds, in
memory, what `coord.FileCoordinator` keeps in ``<shared>/job-N/coord``: the rounds of
``exchange`` (every rank's value, answered to all when the last arrives), first-wins
proposals, and each rank's newest durable step per tier (retention's floor; node memory's
step too, under tier 0's name).

Authentication is the peer channel's (`peerauth`) under the coordinator's own magic and labels:
the job's key, nonces from both sides, the server proves the key before anyone waits on it.
Strangers get one short deadline for the whole handshake (a quarter of it for their first
frame), small frames, a few handshakes per source (all of loopback is one) and together a
quarter of the connections: the rest is kept for the allocation's nodes (`peeradmit`); their
headers are never decoded. What the job's ranks send is bounded
too: values of at most 64 KiB, a bounded number of rounds and bytes held, and rounds of runs
older than the two newest are dropped (a spare relaunch is a new run; its stragglers can never
complete or disturb the new run's rounds).

Messages (one request per connection, JSON; every request carries ``v``, ``op``, ``job``,
``rank``, ``world``):

* ``exchange`` ``round``, ``value``, ``wait_s``: ``{"ok": true, "values": [...]}`` in rank
  order once every rank sent one, else at ``wait_s`` ``{"ok": false, "missing": [...]}``;
  the same value again is a retry, another value an error.
* ``propose`` ``name``, ``value`` (int): the first proposal's value.
* ``durable`` ``tier``, ``step`` (int, -1: none): recorded; ``floor`` ``tier``: the minimum over
  ranks ``0..world-1``, null while one is missing.
* ``ping``: ``{"ok": true, "ranks_seen": n}``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.ckpt.names import BadName, check_name
from gpuwarden.ckpt.peeradmit import FIRST_SHARE, Admission, Ticket, allocation
from gpuwarden.ckpt.peerauth import (
    COORD,
    GatedServer,
    KeyRefused,
    prove,
    send_response,
    serve_handshake,
)
from gpuwarden.ckpt.peerwire import PeerError, decode_message

log = logging.getLogger(__name__)

VERSION = 1
MAX_CONNECTIONS = 4096  # at once: one waiting thread per rank of a large job
PER_SOURCE = 16  # connections from one source still in the handshake (peeradmit.source_of)
HANDSHAKE_S = 5.0  # from accept to the key shown (the first frame: a quarter of it)
SEND_S = 10.0  # to send an authenticated rank its answer
MAX_VALUE = 64 << 10  # one rank's value in one round, as JSON
MAX_WAIT_S = 3600.0  # the longest a rank may ask to be held in one exchange
MAX_WORLD = 1 << 20
MAX_ROUNDS = 512  # rounds and proposals held at once
MAX_TIERS = 16
MAX_HELD = 256 << 20  # bytes of values held, all rounds together (answers: as much again)
KEEP_RUNS = 2  # a relaunch's new run and the one it replaced (its last rounds may overlap)
_RUN = re.compile(r"-r(\d{1,9})-s(\d{1,9})(?=-|$)")


class Refusal(Exception):
    """A request answered ``{"ok": false, "error": ...}``."""


def run_of(name: str) -> tuple[int, int] | None:
    """The run (restart count, step id) a round or proposal name is of: ``agree-r1-s0`` and
    ``fresh-r1-s0-2`` are run (1, 0); None for a name without one. Pure."""
    m = _RUN.search(name)
    return None if m is None else (int(m.group(1)), int(m.group(2)))


def _int(req: dict[str, Any], name: str, low: int, high: int) -> int:
    v = req.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v < high:
        raise Refusal(f"{name}: expected an integer from {low} to {high - 1}")
    return v


def _name(req: dict[str, Any], name: str, what: str) -> str:
    v = req.get(name)
    if not isinstance(v, str):
        raise Refusal(f"{what}: expected a name")
    return check_name(v, what)


@dataclass
class _Round:
    world: int
    run: tuple[int, int] | None
    values: dict[int, Any] = field(default_factory=dict)
    texts: dict[int, str] = field(default_factory=dict)  # canonical JSON: retries compare it
    dropped: str = ""  # why, once dropped: its waiters are answered with it
    answer: bytes | None = None  # the complete round's answer


class CoordServer:
    """One job's coordinator. ``stop()`` when the job's step ends."""

    def __init__(self, key: bytes, job: str, host: str = "0.0.0.0", port: int = 0,  # noqa: S104 - every rank must reach it; the key guards it
                 max_connections: int = MAX_CONNECTIONS, per_source: int = PER_SOURCE,
                 handshake_s: float = HANDSHAKE_S, max_rounds: int = MAX_ROUNDS,
                 max_held: int = MAX_HELD, clock: Callable[[], float] = time.monotonic,
                 hosts: Sequence[str] | None = None) -> None:
        """``hosts``: the allocation's nodes, whose connections keep a share of the slots
        that strangers cannot take (None: ``SLURM_JOB_NODELIST``'s)."""
        self.job = check_name(job, "job")
        self._key = key
        self.handshake_s, self.max_rounds, self.max_held = handshake_s, max_rounds, max_held
        self._clock = clock
        self._admission = Admission(max_connections, per_source)
        self._admission.own_hosts(allocation(os.environ) if hosts is None else hosts)
        self._cv = threading.Condition()
        self._rounds: dict[str, _Round] = {}
        self._proposals: dict[str, tuple[tuple[int, int] | None, int]] = {}
        self._durable: dict[str, dict[int, int]] = {}
        self._runs: set[tuple[int, int]] = set()
        self._seen: set[int] = set()
        self._held = 0
        self._closed = False
        try:
            # A backlog of 1024: a job's ranks all connect at once at start.
            self._srv = GatedServer((host, port), self._admission, "coordinator", self._handle,
                                    backlog=1024)
        except OSError as exc:
            raise PeerError(f"coordinator: cannot listen on {host}:{port} ({exc.strerror})"
                            ) from None
        self.port: int = self._srv.server_address[1]
        self._thread = threading.Thread(target=self._srv.serve_forever,
                                        name="gpuwarden-coord", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:  # never the key
        return f"CoordServer({self.job}, port {self.port})"

    def stop(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()  # waiting ranks are answered at once, not at their wait_s
        self._srv.shutdown()
        self._srv.server_close()

    # ---- the connection -----------------------------------------------------------------------
    def _handle(self, sock: socket.socket, source: str, ticket: Ticket) -> None:
        in_handshake = True
        try:
            try:
                now = time.monotonic()
                session, header = serve_handshake(sock, self._key, COORD,
                                                  now + self.handshake_s,
                                                  header_limit=MAX_VALUE + (4 << 10),
                                                  first=now + self.handshake_s / FIRST_SHARE)
            except KeyRefused:
                if self._admission.should_log(source):
                    log.warning("coordinator %s: refused a request without this job's key",
                                source)
                return
            self._admission.authenticated(ticket)
            in_handshake = False
            prove(sock, session, time.monotonic() + SEND_S)
            try:
                resp = self.serve(decode_message(header, "request"))
            except (PeerError, Refusal) as exc:
                resp = {"ok": False, "error": str(exc)}
            if isinstance(resp, dict) and not resp.get("ok"):
                log.warning("coordinator %s: %s", source, str(resp.get("error"))[:300])
            send_response(sock, session, resp, time.monotonic() + SEND_S)
        except (OSError, PeerError, ValueError) as exc:
            if not in_handshake or self._admission.should_log(source):
                log.warning("coordinator %s: %s%s", source, exc,
                            f" (within the {self.handshake_s:g} s handshake)"
                            if in_handshake else "")
        finally:
            self._admission.leave(ticket)
            with contextlib.suppress(OSError):
                sock.close()

    # ---- the operations (an authenticated request's header, decoded) ---------------------------
    def serve(self, req: dict[str, Any]) -> dict[str, Any] | bytes:
        """The answer to one of the job's ranks (bytes: encoded already, once for all the
        ranks of a round). Refusal when the request is malformed."""
        if req.get("v") != VERSION:
            raise Refusal(f"protocol version {str(req.get('v'))[:20]!r}, this coordinator "
                          f"speaks {VERSION}")
        if req.get("job") != self.job:
            raise Refusal(f"a request of {str(req.get('job'))[:40]!r} sent to {self.job}'s "
                          "coordinator")
        world = _int(req, "world", 1, MAX_WORLD + 1)
        rank = _int(req, "rank", 0, world)
        op = req.get("op")
        try:
            with self._cv:
                self._seen.add(rank)
            if op == "exchange":
                return self._exchange(req, rank, world)
            if op == "propose":
                return self._propose(req)
            if op == "durable":
                return self._publish(req, rank)
            if op == "floor":
                return self._floor(req, world)
            if op == "ping":
                with self._cv:
                    return {"ok": True, "ranks_seen": len(self._seen)}
        except BadName as exc:
            raise Refusal(str(exc)) from None
        raise Refusal(f"unknown op {str(op)[:20]!r}")

    def _exchange(self, req: dict[str, Any], rank: int, world: int) -> dict[str, Any] | bytes:
        name = _name(req, "round", "round")
        wait_s = req.get("wait_s")
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not (
                0 <= wait_s <= MAX_WAIT_S):
            raise Refusal(f"wait_s: expected seconds from 0 to {MAX_WAIT_S:g}")
        value = req.get("value")
        text = json.dumps(value, sort_keys=True, separators=(",", ":"))
        if len(text) > MAX_VALUE:
            raise Refusal(f"round {name}: a value of {len(text)} bytes, more than {MAX_VALUE}")
        with self._cv:
            rnd = self._rounds.get(name)
            if rnd is None:
                self._admit_name(name)
                rnd = self._rounds[name] = _Round(world, run_of(name))
            if rnd.world != world:
                raise Refusal(f"round {name} is of {rnd.world} ranks; rank {rank} says {world}")
            before = rnd.texts.get(rank)
            if before is None:
                if self._held + len(text) > self.max_held:
                    raise Refusal(f"round {name}: the coordinator holds {self._held} bytes "
                                  "already, the most it may")
                rnd.values[rank], rnd.texts[rank] = value, text
                self._held += len(text)
                self._cv.notify_all()
            elif before != text:
                raise Refusal(f"rank {rank} sent two values for round {name}")
            end = self._clock() + float(wait_s)
            while len(rnd.values) < rnd.world and not rnd.dropped and not self._closed:
                left = end - self._clock()
                if left <= 0:
                    break
                self._cv.wait(left)
            if len(rnd.values) == rnd.world:
                if rnd.answer is None:  # encoded once: N answers of N values each
                    rnd.answer = (b'{"ok":true,"values":['
                                  + ",".join(rnd.texts[r] for r in range(rnd.world)).encode()
                                  + b"]}")
                return rnd.answer
            if rnd.dropped or self._closed:
                return {"ok": False,
                        "error": f"{name}: {rnd.dropped or 'the coordinator is stopping'}"}
            missing = [r for r in range(rnd.world) if r not in rnd.values]
            return {"ok": False, "missing": missing,
                    "error": f"{name}: ranks {_ranges(missing)} did not report within "
                             f"{float(wait_s):g} s"}

    def _propose(self, req: dict[str, Any]) -> dict[str, Any]:
        name = _name(req, "name", "proposal")
        value = req.get("value")
        if isinstance(value, bool) or not isinstance(value, int) or abs(value) >= 1 << 62:
            raise Refusal(f"proposal {name}: the value is not a step")
        with self._cv:
            if name not in self._proposals:
                self._admit_name(name)
                self._proposals[name] = (run_of(name), value)
            return {"ok": True, "value": self._proposals[name][1]}

    def _publish(self, req: dict[str, Any], rank: int) -> dict[str, Any]:
        tier = _name(req, "tier", "tier")
        step = _int(req, "step", -1, 1 << 62)
        with self._cv:
            if tier not in self._durable and len(self._durable) >= MAX_TIERS:
                raise Refusal(f"tier {tier}: {MAX_TIERS} tiers recorded already")
            self._durable.setdefault(tier, {})[rank] = step
        return {"ok": True}

    def _floor(self, req: dict[str, Any], world: int) -> dict[str, Any]:
        tier = _name(req, "tier", "tier")
        with self._cv:
            held = self._durable.get(tier, {})
            steps = [held.get(r) for r in range(world)]
        if any(s is None for s in steps):
            return {"ok": True, "floor": None}
        return {"ok": True, "floor": min(s for s in steps if s is not None)}

    # ---- bounds ---------------------------------------------------------------------------------
    def _admit_name(self, name: str) -> None:
        """Before a new round or proposal is held (under the condition): its run must be one of
        the newest; a newer run drops the rounds of runs beyond the newest ``KEEP_RUNS``."""
        run = run_of(name)
        if run is not None and run not in self._runs:
            newest = sorted(self._runs, reverse=True)[:KEEP_RUNS]
            if len(newest) == KEEP_RUNS and run < newest[-1]:
                raise Refusal(f"{name} is of run r{run[0]}-s{run[1]}, older than the runs "
                              "this coordinator serves now")
            self._runs.add(run)
            for old in sorted(self._runs, reverse=True)[KEEP_RUNS:]:
                self._drop_run(old)
        if len(self._rounds) + len(self._proposals) >= self.max_rounds:
            raise Refusal(f"{name}: {self.max_rounds} rounds and proposals held already")

    def _drop_run(self, run: tuple[int, int]) -> None:
        self._runs.discard(run)
        why = f"run r{run[0]}-s{run[1]} was replaced by a newer one"
        for name in [n for n, r in self._rounds.items() if r.run == run]:
            rnd = self._rounds.pop(name)
            rnd.dropped = why
            self._held -= sum(len(t) for t in rnd.texts.values())
        for name in [n for n, (r, _) in self._proposals.items() if r == run]:
            del self._proposals[name]
        self._cv.notify_all()
        log.info("coordinator: dropped the rounds of %s", why)


def _ranges(ranks: list[int]) -> str:
    shown = ",".join(str(r) for r in ranks[:16])
    return shown + (f",... ({len(ranks)} in all)" if len(ranks) > 16 else "")
