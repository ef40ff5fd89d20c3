"""The peer protocol's framing: length-prefixed frames, HMAC-SHA256 helpers, deadlines, and
the JSON headers' decoding.

A frame is a 4-byte big-endian length and that many bytes. Every blocking call can be held to
one absolute ``deadline`` (monotonic seconds): a per-call socket timeout alone lets a peer
trickle one byte per timeout for ever.
"""

from __future__ import annotations

import hmac
import socket
import struct
import time
from typing import Any

from gpuwarden.ckpt.tier import TierError
from gpuwarden.core import safejson

MAGIC = b"GPWPEER1"
BUSY = b"GPWBUSY1"  # sent instead of MAGIC + nonce to a connection over the limits, then closed
NONCE = 32
MAX_HEADER = 1 << 20


class PeerError(TierError):
    """A peer that cannot be reached, refuses us, or sends something unauthenticated."""


class PeerBusy(PeerError):
    """A peer that refused the connection because it is at its connection limits."""


def _left(deadline: float | None, sock: socket.socket) -> None:
    """Before each blocking call: what is left of an absolute deadline becomes the socket's
    timeout (a per-call timeout alone lets a peer trickle a byte at a time for ever)."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerError("deadline passed mid-message")
        sock.settimeout(left)


def send_frame(sock: socket.socket, data: bytes, deadline: float | None = None) -> None:
    _left(deadline, sock)
    sock.sendall(struct.pack(">I", len(data)) + data)


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    while view:
        _left(deadline, sock)
        got = sock.recv_into(view)
        if not got:
            raise PeerError("connection closed mid-message")
        view = view[got:]
    return buf


def recv_frame(sock: socket.socket, limit: int = MAX_HEADER,
                deadline: float | None = None) -> bytes:
    (n,) = struct.unpack(">I", recv_exact(sock, 4, deadline))
    if n > limit:
        raise PeerError(f"a {n}-byte frame, more than {limit}")
    return bytes(recv_exact(sock, n, deadline))


def hmac_over(key: bytes, label: bytes, *parts: bytes | bytearray | memoryview) -> Any:
    m = hmac.new(key, label, "sha256")
    for p in parts:
        m.update(p)
    return m


def decode_message(data: bytes, what: str, max_bytes: int = MAX_HEADER) -> dict[str, Any]:
    """A request's or response's header: a JSON object, or PeerError naming what is wrong
    (`safejson`). Authenticated is not well-formed: any of the job's ranks can send it."""
    try:
        doc = safejson.loads(data, max_bytes=max_bytes)
    except safejson.JsonError as exc:
        raise PeerError(f"{what}: {exc}") from None
    if not isinstance(doc, dict):
        raise PeerError(f"{what}: not a JSON object")
    return doc
