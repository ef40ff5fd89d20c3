"""Per-job authenticated request/response over TCP, shared by the peer tier (`peer`) and the
job's coordinator (`coordsrv`, `coordnet`).

One request per connection. The server sends its magic and a fresh nonce; the client sends
its own nonce, the JSON request header and ``HMAC(key, hdr | nonce_s | nonce_c | header)``.
The server checks that MAC before it decodes anything (a stranger's header is never parsed),
then proves the key itself (``HMAC(key, ready | nonces)``) before the client sends any data
or waits on anything. The peer tier then sends a request body and a whole-response MAC; the
response header always carries its own. Every MAC covers both nonces, so nothing replays.

Each protocol has its own magic and labels (`Wire`): a message valid at one kind of server is
never valid at the other, even under the same key.

The key is never part of a message, a repr or a log line.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import json
import logging
import secrets
import socket
import socketserver
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpuwarden.ckpt.peeradmit import Ticket
from gpuwarden.ckpt.peeruid import local_uid
from gpuwarden.ckpt.peerwire import (
    BUSY,
    MAGIC,
    MAX_HEADER,
    NONCE,
    PeerBusy,
    PeerError,
    decode_message,
    hmac_over,
    recv_frame,
    send_frame,
)

log = logging.getLogger(__name__)

HEADER_LIMIT = 64 << 10  # a request header, read before its MAC is checked: kept small
OWNER_S = 0.05  # the most the accept loop waits to learn a local client's owner

# (client address, client port, server address, server port, family, timeout) -> the uid
# owning the client's socket when it is this host's, else None; never raises
Owner = Callable[[str, int, str, int, int, float], "int | None"]


@dataclass(frozen=True)
class Wire:
    """One protocol's magic and MAC labels. ``body``/``resp`` empty: no request body, no
    whole-response MAC after the response header."""

    name: str  # in messages: "peer 10.0.0.5:4000: ..."
    magic: bytes
    hdr: bytes
    ready: bytes
    rhdr: bytes
    body: bytes = b""
    resp: bytes = b""
    max_response: int = MAX_HEADER  # a response header the client reads (after the key's proof)


PEER = Wire("peer", MAGIC, b"hdr", b"ready", b"rhdr", b"body", b"resp")
# An exchange's answer holds every rank's value: tens of bytes each, times up to 10^5 ranks.
COORD = Wire("coordinator", b"GPWCORD1", b"chdr", b"cready", b"crsp", max_response=64 << 20)


class Endpoint(Protocol):
    """Where a server listens (`peer.Address`); its str() names it in messages."""

    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...


class KeyRefused(PeerError):
    """The other side does not hold this job's key (or refused ours)."""


@dataclass(frozen=True)
class Session:
    """One authenticated connection's key and nonces: every MAC of the connection."""

    key: bytes = field(repr=False)
    wire: Wire
    nonce_s: bytes = field(repr=False)
    nonce_c: bytes = field(repr=False)

    def mac(self, label: bytes, *parts: bytes | bytearray | memoryview) -> Any:
        return hmac_over(self.key, label, self.nonce_s, self.nonce_c, *parts)


# ---- the server's side ----------------------------------------------------------------------
class Gate(Protocol):
    """Admission limits (gpuwarden.ckpt.peeradmit.Admission)."""

    def enter(self, address: str, hang_up: Callable[[], None], uid: int | None = None
              ) -> Ticket | str: ...
    def should_log(self, address: str) -> bool: ...
    def leave(self, ticket: Ticket) -> None: ...


class GatedServer(socketserver.ThreadingTCPServer):
    """A threading TCP server that admits each connection (`admitted`) in its accept loop,
    before a thread is started for it: a stranger turned away costs no thread, and a flood of
    them slows the accept loop less. ``serve(sock, address, ticket)`` runs in the connection's
    thread and must ``gate.leave(ticket)`` when done. ``owner`` (`peeruid.local_uid`: tens of
    microseconds, in the accept loop) tells this host's users apart."""

    allow_reuse_address = True
    daemon_threads = True

    def __init__(self, where: tuple[str, int], gate: Gate, who: str,
                 serve: Callable[[socket.socket, str, Ticket], None], backlog: int = 128,
                 owner: Owner | None = None) -> None:
        self.gate, self.who, self.serve = gate, who, serve
        self.owner: Owner = local_uid if owner is None else owner
        self.request_queue_size = backlog
        self._tickets: dict[socket.socket, Ticket] = {}
        super().__init__(where, socketserver.BaseRequestHandler)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        ticket = admitted(self.gate, request, str(client_address[0]), self.who,
                          uid=self._uid_of(request, client_address))
        if ticket is None:
            return False
        self._tickets[request] = ticket
        return True

    def _uid_of(self, request: socket.socket, client_address: Any) -> int | None:
        """Who owns the client's socket, when it is this host's; None otherwise or when that
        cannot be learnt (the address's rules then)."""
        try:
            here = request.getsockname()
            return self.owner(str(client_address[0]), int(client_address[1]), str(here[0]),
                              int(here[1]), self.address_family, OWNER_S)
        except Exception:  # the accept loop must go on; the address's rules apply
            log.debug("%s: no owner for %s", self.who, client_address, exc_info=True)
            return None

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started (out of threads): its slot freed here
            ticket = self._tickets.pop(request, None)
            if ticket is not None:
                self.gate.leave(ticket)
            raise

    def finish_request(self, request: Any, client_address: Any) -> None:
        self.serve(request, str(client_address[0]), self._tickets.pop(request))


def admitted(gate: Gate, sock: socket.socket, address: str, who: str, uid: int | None = None
             ) -> Ticket | None:
    """Let the connection from ``address`` in (its ticket), or turn it away (BUSY) over the
    limits, logging it at most now and then (``who``: "peer", "coordinator"). ``uid``: the
    owner of the client's socket when it is this host's."""
    got = gate.enter(address, functools.partial(_hang_up, sock), uid)
    if isinstance(got, Ticket):
        return got
    if gate.should_log(address):
        log.warning("%s %s: refused a connection: %s", who, address, got)
    turn_away(sock)
    return None


def _hang_up(sock: socket.socket) -> None:
    """Ends a connection another thread serves: its blocked recv returns at once."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def turn_away(sock: socket.socket) -> None:
    """A connection over the admission limits: told BUSY (the client says why), closed."""
    with contextlib.suppress(OSError, PeerError):
        send_frame(sock, BUSY, time.monotonic() + 1.0)
    with contextlib.suppress(OSError):
        sock.close()


def serve_handshake(sock: socket.socket, key: bytes, wire: Wire, deadline: float,
                    header_limit: int = HEADER_LIMIT, first: float | None = None
                    ) -> tuple[Session, bytes]:
    """Hello, the client's nonce, header and MAC, all within ``deadline`` and in small frames
    (a stranger can neither hold the connection nor make us allocate); the nonce by ``first``
    when given (a rank sends it as soon as it reads the hello: a connection still silent then
    is a stranger's, holding a slot). KeyRefused when the MAC is not this job's: the header has
    not been decoded then."""
    nonce_s = secrets.token_bytes(NONCE)
    send_frame(sock, wire.magic + nonce_s, deadline)
    nonce_c = recv_frame(sock, NONCE, deadline if first is None else min(first, deadline))
    header = recv_frame(sock, header_limit, deadline)
    mac = recv_frame(sock, 64, deadline)
    s = Session(key, wire, nonce_s, nonce_c)
    if len(nonce_c) != NONCE or not hmac.compare_digest(mac, s.mac(wire.hdr, header).digest()):
        raise KeyRefused("a request without this job's key")
    return s, header


def prove(sock: socket.socket, s: Session, deadline: float | None = None) -> None:
    """Our proof of the key: the client sends no data and waits on nothing before it."""
    send_frame(sock, s.mac(s.wire.ready).digest(), deadline)


def send_response(sock: socket.socket, s: Session, resp: dict[str, Any] | bytes,
                  deadline: float | None = None) -> bytes:
    """The response header (a document, or one encoded already) and its MAC; returns the
    header's bytes (the peer tier's whole-response MAC starts from them)."""
    text = resp if isinstance(resp, bytes) else json.dumps(resp).encode()
    send_frame(sock, text, deadline)
    send_frame(sock, s.mac(s.wire.rhdr, text).digest(), deadline)
    return text


# ---- the client's side ----------------------------------------------------------------------
def client_request(key: bytes, addr: Endpoint, wire: Wire, req: dict[str, Any],
                   body: Iterable[Any] | None = None, timeout: float = 30.0,
                   deadline: float | None = None
                   ) -> tuple[dict[str, Any], socket.socket, Any]:
    """Send an authenticated request (and ``body``, for a wire that has one); returns the
    response header, the socket (positioned after the response header) and the running
    whole-response MAC (None for a wire without one). ``timeout`` bounds each socket call;
    ``deadline`` (monotonic), when given, the whole exchange. Errors are PeerError naming
    the server: PeerBusy when it turned us away, KeyRefused when it does not hold the key."""
    where = f"{wire.name} {addr}"
    connect_s = timeout if deadline is None else min(timeout, deadline - time.monotonic())
    if connect_s <= 0:
        raise PeerError(f"{where}: no time left to ask it")
    try:
        sock = socket.create_connection((addr.host, addr.port), timeout=connect_s)
        sock.settimeout(timeout)
    except OSError as exc:
        raise PeerError(f"{where}: cannot connect ({exc})") from None
    try:
        hello = recv_frame(sock, len(wire.magic) + NONCE, deadline)
        if hello == BUSY:
            raise PeerBusy(f"{where}: busy: it refused the connection at its connection "
                           "limits (too many at once, or from this address)")
        if not hello.startswith(wire.magic) or len(hello) != len(wire.magic) + NONCE:
            raise PeerError(f"{where}: not a gpuwarden {wire.name}")
        s = Session(key, wire, hello[len(wire.magic):], secrets.token_bytes(NONCE))
        header = json.dumps(req).encode()
        send_frame(sock, s.nonce_c, deadline)
        send_frame(sock, header, deadline)
        send_frame(sock, s.mac(wire.hdr, header).digest(), deadline)
        try:
            ready = recv_frame(sock, 64, deadline)
        except PeerError as exc:
            raise KeyRefused(f"{where}: {exc}, instead of proving it holds this job's key "
                             "(it refused ours)") from None
        if not hmac.compare_digest(ready, s.mac(wire.ready).digest()):
            raise KeyRefused(f"{where}: does not hold this job's key: sending it nothing")
        if body is not None and wire.body:
            mac = s.mac(wire.body)
            for part in body:
                mac.update(part)
                sock.sendall(part)
            send_frame(sock, mac.digest())
        text = recv_frame(sock, wire.max_response, deadline)
        if not hmac.compare_digest(recv_frame(sock, 64, deadline),
                                   s.mac(wire.rhdr, text).digest()):
            raise PeerError(f"{where}: a response without this job's key: ignored")
        resp = decode_message(text, "response", wire.max_response)
        return resp, sock, (s.mac(wire.resp, text) if wire.resp else None)
    except (OSError, ValueError) as exc:
        sock.close()
        raise PeerError(f"{where}: {exc}") from None
    except PeerError as exc:
        sock.close()
        if str(addr) in str(exc):
            raise
        raise type(exc)(f"{where}: {exc}") from None
