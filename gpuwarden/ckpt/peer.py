"""Tier 1: each rank's tier 0 replicated into other nodes' memory, over TCP, per-job authenticated.

Every rank runs a small server (a thread) that stores replicas pushed by its partners in its
own node's tier 0 (under ``<job>.peer``) and serves, to the job's ranks only, any rank's steps
this node holds (replicas, and tier-0 steps left by a rank that ran here before). A node that
replaces a dead one, or a rank restarted elsewhere, restores from a peer's memory instead of
the shared filesystem or S3.

Authentication: a random 256-bit key per job, in a 0600 file in the job's private directory
on the shared filesystem (so other users cannot read it). Each connection starts with a fresh
nonce from each side. The request header is authenticated with HMAC-SHA256 before the server
reads anything large; the server then proves the key too, before the client sends any data;
the request body, the response header and the whole response each carry their own HMAC over
both nonces. So nothing can be replayed, read or written without the key, and nothing
received is used before its HMAC and then its manifest checksums match (the handshake and
MACs: `peerauth`, shared with the job's coordinator under another magic). Transfers are
authenticated, not encrypted: root on the network path can read them.

Strangers: a connection gets one absolute deadline (``handshake_s``) to show the key (a quarter
of it to send its first frame), one source (all of loopback is one) may hold at most
``per_source`` connections that have not shown it, and sources outside the job's nodes a
quarter of all connections together (`peeradmit`); a connection over the limits is answered
``BUSY`` and closed, and the client asks again with jittered backoff until its deadline, then
says so. Listing asks every peer at once under one deadline; a peer that does not answer is an
error naming it, never an empty list. What is served is read through `FsTier`, which refuses
links, FIFOs and anything not owned by the job's user (the ``job-N`` and ``job-N.peer``
directories sit in a world-writable spool).
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import os
import random
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from gpuwarden.ckpt import retention
from gpuwarden.ckpt.codec import Buf
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.manifest import Manifest, ManifestError, from_json
from gpuwarden.ckpt.names import BadName, check_name, check_step
from gpuwarden.ckpt.peeradmit import FIRST_SHARE, Admission, Ticket, allocation
from gpuwarden.ckpt.peerauth import (
    PEER,
    GatedServer,
    KeyRefused,
    client_request,
    prove,
    send_response,
    serve_handshake,
)
from gpuwarden.ckpt.peerwire import (
    PeerBusy,
    PeerError,
    decode_message,
    hmac_over,
    recv_exact,
    recv_frame,
    send_frame,
)
from gpuwarden.ckpt.tier import CorruptStep, TierError, check_shard
from gpuwarden.core import safefs as safeio

log = logging.getLogger(__name__)

KEY_FILE = "peer.key"
MAX_CONNECTIONS = 64  # served at once, all sources together
PER_SOURCE = 8  # connections from one source still in the handshake (not shown the key yet)
HANDSHAKE_S = 5.0  # from accept to the key shown: one deadline for the whole handshake
_BUSY_PAUSE = 0.5  # the longest pause between asks of a peer at its limits
LIST_S = 10.0  # PeerTier.steps(): every peer asked at once, one deadline for all of them
_LIST_WORKERS = 32
_T = TypeVar("_T")


# ---- the per-job key ------------------------------------------------------------------------
def job_key(job_dir: str) -> bytes:
    """The job's key, created by whichever rank gets there first (a whole file or none)."""
    path = os.path.join(job_dir, KEY_FILE)
    if not os.path.lexists(path):
        tmp = os.path.join(job_dir, f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, secrets.token_bytes(32))
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)  # the first rank's key wins; the others read it
        os.unlink(tmp)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise PeerError(f"{path}: not a private regular file of ours: refusing it as a key")
        key = os.read(fd, 64)
    finally:
        os.close(fd)
    if len(key) != 32:
        raise PeerError(f"{path}: {len(key)} bytes, expected a 32-byte key")
    return key


def read_job_key(shared_root: str, job: str, owner: int | None) -> bytes:
    """An existing job's key, read (never created) by descriptor from the shared tier: for
    root's commands (``owner`` None: the job directory's owner) and anyone else's reads.
    PeerError when it is not there or not the job user's private 32-byte file."""
    where = os.path.join(shared_root, job, KEY_FILE)
    try:
        with safeio.closing(safeio.walk(shared_root, [job], owner)) as fd:
            uid = os.fstat(fd).st_uid if owner is None else owner
            key = bytes(safeio.read_file(fd, KEY_FILE, uid, 32, where, exact=True))
    except (safeio.Refused, OSError) as exc:
        raise PeerError(f"{where}: cannot read the job's key ({exc})") from None
    return key


# ---- partners -------------------------------------------------------------------------------
def partners(rank: int, hosts: Sequence[str], leaf_of: Mapping[str, str], replicas: int,
             mode: str = "other-leaf") -> list[int]:
    """The ranks that hold this rank's replicas: on other nodes, and by default on another leaf
    switch (a switch failure then takes out no rank together with its replica). With several
    ranks per node, the i-th rank of a node pairs with the i-th rank of the partner node, so
    the replicas of one node spread over as many processes as it has ranks. Pure."""
    world = len(hosts)
    mine = hosts[rank]
    on: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        on.setdefault(h, []).append(r)
    local = on[mine].index(rank)
    order: list[str] = []  # other nodes, nearest after this rank first
    for k in range(1, world):
        h = hosts[(rank + k) % world]
        if h != mine and h not in order:
            order.append(h)
    if mode == "other-leaf" and mine in leaf_of:
        far = [h for h in order if leaf_of.get(h) != leaf_of[mine]]
        order = far + [h for h in order if h not in far]
    return [on[h][local % len(on[h])] for h in order[:replicas]]


@dataclass(frozen=True)
class Address:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


# ---- the server -----------------------------------------------------------------------------
class PeerServer:
    """Serves one job's replicas from this node's tier 0. ``stop()`` when the rank exits."""

    def __init__(self, key: bytes, job: str, memory_root: str, keep: int = 2,
                 host: str = "0.0.0.0", port: int = 0, timeout: float = 60.0,  # noqa: S104 - every rank must reach it; the key guards it
                 handshake_s: float = HANDSHAKE_S, max_connections: int = MAX_CONNECTIONS,
                 per_source: int = PER_SOURCE, hosts: Sequence[str] | None = None) -> None:
        """``hosts``: the job's nodes, whose connections keep a share of the slots that
        strangers cannot take (None: ``SLURM_JOB_NODELIST``'s)."""
        self.key, self.job, self.root, self.keep = key, check_name(job, "job"), memory_root, keep
        self.timeout, self.handshake_s = timeout, handshake_s
        self._admission = Admission(max_connections, per_source)
        self._admission.own_hosts(allocation(os.environ) if hosts is None else hosts)
        try:
            self._srv = GatedServer((host, port), self._admission, "peer", self._handle)
        except OSError as exc:
            raise PeerError(f"peer server: cannot listen on {host}:{port} ({exc.strerror}); "
                            "with several ranks per node, leave [ckpt] peer_port = 0") from None
        self.port = self._srv.server_address[1]
        self._thread = threading.Thread(target=self._srv.serve_forever, name="gpuwarden-peer",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._srv.shutdown()
        self._srv.server_close()

    # Both live in a world-writable spool: FsTier opens every component by descriptor and
    # refuses links, FIFOs and anything not this (the job's) user's, on every read.
    def _own(self, rank: int) -> FsTier:
        return FsTier("memory", self.root, self.job, rank)

    def _replica(self, rank: int) -> FsTier:
        return FsTier("peer", self.root, f"{self.job}.peer", rank)

    def _handle(self, sock: socket.socket, source: str, ticket: Ticket) -> None:
        in_handshake = True
        try:
            # Until the client has shown the key it gets one short deadline for the whole
            # handshake and small frames: a stranger cannot hold a slot or make us allocate.
            try:
                now = time.monotonic()
                session, header = serve_handshake(sock, self.key, PEER, now + self.handshake_s,
                                                  first=now + self.handshake_s / FIRST_SHARE)
            except KeyRefused:
                if self._admission.should_log(source):
                    log.warning("peer %s: refused a request without this job's key", source)
                return
            self._admission.authenticated(ticket)
            in_handshake = False
            sock.settimeout(self.timeout)
            prove(sock, session)
            body: list[Buf] = []
            try:
                req = decode_message(header, "request")
            except PeerError as exc:  # answered: the rank that sent it learns why
                log.warning("peer %s: %s", source, exc)
                resp = {"ok": False, "error": str(exc)}
            else:
                resp, body = self._serve(req, sock, session.nonce_s, session.nonce_c)
            text = send_response(sock, session, resp)
            out = session.mac(PEER.resp, text)
            for part in body:
                out.update(part)
                sock.sendall(part)
            send_frame(sock, out.digest())
        except (OSError, PeerError, ValueError) as exc:
            if not in_handshake or self._admission.should_log(source):
                log.warning("peer %s: %s%s", source, exc,
                            f" (within the {self.handshake_s:g} s handshake)"
                            if in_handshake else "")
        finally:
            self._admission.leave(ticket)
            with contextlib.suppress(OSError):
                sock.close()

    def _serve(self, req: Any, sock: socket.socket, nonce_s: bytes,
               nonce_c: bytes) -> tuple[dict[str, Any], list[Buf]]:
        if not isinstance(req, dict):
            return {"ok": False, "error": "request is not an object"}, []
        op = req.get("op")
        try:
            if op == "put":
                return self._put(req, sock, nonce_s, nonce_c), []
            rank = req.get("rank")
            if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
                raise PeerError("rank: expected an integer >= 0")
            if op == "list":
                steps = sorted(set(self._own(rank).steps()) | set(self._replica(rank).steps()))
                return {"ok": True, "steps": steps}, []
            if op == "get":
                return self._get(rank, check_step(req.get("step", -1)))
            raise PeerError(f"unknown op {str(op)[:20]!r}")
        except TierError as exc:
            log.error("peer: not serving rank %s: %s", req.get("rank"), exc)  # planted? say so
            return {"ok": False, "error": str(exc)}, []
        except (BadName, CorruptStep, OSError) as exc:
            return {"ok": False, "error": str(exc)}, []

    def _get(self, rank: int, step: int) -> tuple[dict[str, Any], list[Buf]]:
        problems = []
        for store in (self._own(rank), self._replica(rank)):
            if step not in store.steps():
                continue
            try:
                m, data = store.load(step)
            except CorruptStep as exc:
                log.warning("peer: not serving %s", exc)
                problems.append(str(exc))
                continue
            return {"ok": True, "manifest": m.to_json()}, [data[s.name] for s in m.shards]
        raise PeerError(f"no verified step {step} of rank {rank} here"
                        + (f" ({'; '.join(problems)})" if problems else ""))

    def _put(self, req: dict[str, Any], sock: socket.socket, nonce_s: bytes,
             nonce_c: bytes) -> dict[str, Any]:
        try:
            m = from_json(str(req.get("manifest", "")), "pushed manifest")
        except ManifestError as exc:
            raise PeerError(str(exc)) from None
        if m.job != self.job:
            raise PeerError(f"a replica of {m.job!r} sent to {self.job!r}")
        tier = self._replica(m.rank)
        tier.ensure_dir()
        free = os.statvfs(tier.dir)
        if m.total_bytes > free.f_bavail * free.f_frsize:
            raise PeerError(f"no room for {m.total_bytes} bytes of rank {m.rank} step {m.step}")
        mac = hmac_over(self.key, b"body", nonce_s, nonce_c)
        data: dict[str, bytes | memoryview] = {}
        for shard in m.shards:
            buf = recv_exact(sock, shard.size)
            mac.update(buf)
            data[shard.name] = memoryview(buf)
        if not hmac.compare_digest(recv_frame(sock, 64), mac.digest()):
            raise PeerError(f"rank {m.rank} step {m.step}: body without this job's key")
        for shard in m.shards:
            check_shard("pushed replica", m.step, shard, data[shard.name])
        tier.commit(m, data)
        # Only replicas that read as this job's and rank's own are ever deleted (retention).
        for old in retention.to_delete(tier, self.keep)[0]:
            tier.delete(old)
        return {"ok": True}


# ---- the client: a tier like the others ----------------------------------------------------
def _request(key: bytes, addr: Address, req: dict[str, Any], body: Sequence[Any] = (),
             timeout: float = 30.0,
             deadline: float | None = None) -> tuple[dict[str, Any], socket.socket, Any]:
    """Send an authenticated request (`peerauth`); returns the response header, the socket
    (positioned at the response body) and the running response MAC. ``timeout`` bounds each
    socket call; ``deadline`` (monotonic), when given, the whole exchange."""
    return client_request(key, addr, PEER, req, body if req.get("op") == "put" else None,
                          timeout, deadline)


def _finish(addr: Address, sock: socket.socket, mac: Any, deadline: float | None = None) -> None:
    try:
        if not hmac.compare_digest(recv_frame(sock, 64, deadline), mac.digest()):
            raise PeerError(f"peer {addr}: a response without this job's key: ignored")
    except OSError as exc:
        raise PeerError(f"peer {addr}: {exc}") from None
    except PeerError as exc:
        raise exc if str(addr) in str(exc) else PeerError(f"peer {addr}: {exc}") from None
    finally:
        sock.close()


def _unless_busy(ask: Callable[[], _T], deadline: float,
                 refused: Callable[[str], None] = lambda _: None) -> _T:
    """``ask()``, asked again with jittered backoff while the peer is at its limits (each
    refusal told to ``refused``), until ``deadline``: then its PeerBusy."""
    pause = 0.02
    while True:
        try:
            return ask()
        except PeerBusy as exc:
            refused(str(exc))
            if time.monotonic() + pause >= deadline:
                raise
            time.sleep(pause * random.uniform(0.5, 1.0))  # noqa: S311 - jitter, not a secret
            pause = min(pause * 2, _BUSY_PAUSE)


def _summary(errors: Sequence[str], most: int = 5) -> str:
    shown = "; ".join(errors[:most])
    return shown + (f"; and {len(errors) - most} more" if len(errors) > most else "")


class PeerTier:
    """Pushes this rank's steps to its partners; restores them from any peer that holds them."""

    def __init__(self, key: bytes, job: str, rank: int, partners: Sequence[Address],
                 everyone: Sequence[Address], timeout: float = 30.0, name: str = "peer",
                 list_timeout: float | None = None) -> None:
        self.name, self.key, self.job, self.rank = name, key, job, rank
        self.partners, self.everyone = list(partners), list(everyone)
        self.timeout = timeout
        self.list_timeout = min(timeout, LIST_S) if list_timeout is None else list_timeout
        self._where: dict[int, list[Address]] = {}

    def commit(self, manifest: Manifest, data: Mapping[str, Buf]) -> None:
        errors = []
        for addr in self.partners:
            try:
                resp, sock, mac = _unless_busy(functools.partial(
                    _request, self.key, addr, {"op": "put", "manifest": manifest.to_json()},
                    [data[s.name] for s in manifest.shards], self.timeout),
                    time.monotonic() + self.timeout)
                _finish(addr, sock, mac)
                if not resp.get("ok"):
                    raise PeerError(f"peer {addr}: {str(resp.get('error'))[:1000]}")
            except PeerError as exc:
                errors.append(str(exc))
        if errors:
            raise PeerError(f"{self.name}: step {manifest.step} not replicated: "
                            + "; ".join(errors))

    def steps(self) -> list[int]:
        """Every peer asked at once, all within ``list_timeout``. Peers that do not answer are
        logged as errors by address; when none answers, PeerError names them: an attacker
        holding a peer's connections must never look like "no replicas"."""
        self._where = {}
        if not self.everyone:
            return []
        deadline = time.monotonic() + self.list_timeout
        answers: dict[Address, list[int]] = {}
        errors: dict[Address, str] = {}
        lock = threading.Lock()

        def ask(addr: Address) -> None:
            def refused(why: str) -> None:
                # Recorded at once, not when the retries end: a peer still refusing at the
                # deadline is named busy, not "no answer", however late this thread runs.
                with lock:
                    errors.setdefault(addr, why)
            try:
                got = self._list(addr, deadline, refused)
            except PeerError as exc:
                with lock:
                    busy = errors.get(addr)
                    errors[addr] = (str(exc) if busy is None or isinstance(exc, PeerBusy)
                                    else f"{busy}; then {exc}")
                return
            with lock:
                answers[addr] = got
        pool = ThreadPoolExecutor(min(_LIST_WORKERS, len(self.everyone)),
                                  thread_name_prefix="gpuwarden-peer-list")
        try:
            futures.wait([pool.submit(ask, a) for a in self.everyone],
                         timeout=max(0.0, deadline - time.monotonic()))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # stragglers end at the deadline
        with lock:
            answered, failed = dict(answers), [
                errors.get(a, f"peer {a}: no answer within {self.list_timeout:g} s")
                for a in self.everyone if a not in answers]
        for addr in self.everyone:  # in rank order: load() tries the nearest first
            for s in answered.get(addr, []):
                self._where.setdefault(s, []).append(addr)
        if failed and not answered:
            raise PeerError(f"{self.name}: rank {self.rank}: none of {len(failed)} peers "
                            f"listed its steps: {_summary(failed)}")
        if failed:
            log.error("%s: rank %d: %d of %d peers did not list their steps (not counted): %s",
                      self.name, self.rank, len(failed), len(self.everyone), _summary(failed))
        return sorted(self._where)

    def _list(self, addr: Address, deadline: float, refused: Callable[[str], None]
              ) -> list[int]:
        """One peer's steps of this rank; a busy peer is asked again until the deadline (each
        refusal told to ``refused``)."""
        resp, sock, mac = _unless_busy(
            lambda: _request(self.key, addr, {"op": "list", "rank": self.rank},
                             timeout=self.list_timeout, deadline=deadline), deadline, refused)
        _finish(addr, sock, mac, deadline)
        steps = resp.get("steps")
        if not resp.get("ok") or not isinstance(steps, list):
            raise PeerError(f"peer {addr}: {str(resp.get('error', 'no step list'))[:300]}")
        return [s for s in steps if isinstance(s, int) and not isinstance(s, bool)]

    def load(self, step: int) -> tuple[Manifest, dict[str, Buf]]:
        problems = []
        for addr in self._where.get(step, []):
            try:
                return self._get(addr, step)
            except (PeerError, CorruptStep) as exc:
                problems.append(str(exc))
        raise CorruptStep(f"{self.name} step {step}: no peer served a verified copy"
                          + (f" ({'; '.join(problems)})" if problems else ""))

    def _get(self, addr: Address, step: int) -> tuple[Manifest, dict[str, Buf]]:
        started = time.monotonic()
        resp, sock, mac = _unless_busy(
            lambda: _request(self.key, addr, {"op": "get", "rank": self.rank, "step": step},
                             (), self.timeout), started + self.timeout)
        try:
            if not resp.get("ok"):
                raise PeerError(f"peer {addr}: {str(resp.get('error'))[:1000]}")
            try:
                m = from_json(str(resp.get("manifest", "")), f"peer {addr}")
            except ManifestError as exc:
                raise PeerError(str(exc)) from None
            if (m.job, m.rank, m.step) != (self.job, self.rank, step):
                raise PeerError(f"peer {addr}: sent {m.job} rank {m.rank} step {m.step}")
            data: dict[str, Buf] = {}
            for shard in m.shards:
                buf = recv_exact(sock, shard.size)
                mac.update(buf)
                data[shard.name] = buf  # a bytearray: the restored array owns it, no copy
        except OSError as exc:
            sock.close()
            raise PeerError(f"peer {addr}: {exc}") from None
        except PeerError:
            sock.close()
            raise
        _finish(addr, sock, mac)
        for shard in m.shards:
            check_shard(f"peer {addr}", step, shard, data[shard.name])
        log.info("%s: step %d of rank %d from %s: %.1f MiB in %.2f s", self.name, step,
                 self.rank, addr, m.total_bytes / 2**20, time.monotonic() - started)
        return m, data

    def delete(self, step: int) -> None:
        """Replicas are retained by the peers that hold them."""
