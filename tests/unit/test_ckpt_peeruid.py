"""`peeruid`: who owns the client's end of an accepted connection, asked of the kernel
(``NETLINK_SOCK_DIAG``). The messages built and parsed as byte strings written out by hand
(the kernel's ``inet_diag`` layouts, host byte order but for ports and addresses), and the
real lookup over loopback."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Iterator

import pytest

from gpuwarden.ckpt import peeruid
from gpuwarden.ckpt.peeruid import local_uid, parse_reply, request

ASKED = request("127.0.0.2", 40000, "127.0.0.1", 5000, socket.AF_INET, 7)


def test_the_request_asks_for_the_clients_socket_by_its_exact_four_tuple() -> None:
    want = (
        struct.pack("=IHHII", 72, 20, 1, 7, 0)  # nlmsghdr: SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST
        + bytes([socket.AF_INET, socket.IPPROTO_TCP, 0, 0]) + b"\xff\xff\xff\xff"  # all states
        + b"\x9c\x40" + b"\x13\x88"  # its port (the client's), the remote one (the server's)
        + bytes([127, 0, 0, 2]) + bytes(12) + bytes([127, 0, 0, 1]) + bytes(12)
        + bytes(4) + b"\xff" * 8  # any interface, INET_DIAG_NOCOOKIE
    )
    assert want == ASKED
    six = request("::ffff:10.0.0.2", 1, "fd00::1", 2, socket.AF_INET6, 1)
    assert six[28:44] == bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 2])
    assert six[44:60] == bytes.fromhex("fd000000000000000000000000000001")
    # An AF_INET server's peer written v4-mapped is its IPv4 address.
    assert request("::ffff:127.0.0.2", 40000, "127.0.0.1", 5000, socket.AF_INET, 7) == ASKED
    with pytest.raises(ValueError):
        request("fd00::1", 1, "127.0.0.1", 2, socket.AF_INET, 1)


def reply(uid: int, inode: int = 4242, state: int = 1, seq: int = 7, sport: int = 40000,
          dport: int = 5000, src: bytes = bytes([127, 0, 0, 2]),
          dst: bytes = bytes([127, 0, 0, 1]), family: int = socket.AF_INET) -> bytes:
    """The kernel's answer: nlmsghdr + inet_diag_msg (state 1: ESTABLISHED)."""
    body = (bytes([family, state, 0, 0]) + struct.pack("!HH", sport, dport)
            + src.ljust(16, b"\0") + dst.ljust(16, b"\0")
            + struct.pack("=III", 0, 0x12345678, 0x9abcdef0)  # if, cookie
            + struct.pack("=IIIII", 0, 0, 0, uid, inode))  # expires, queues, uid, inode
    return struct.pack("=IHHII", 16 + len(body), 20, 0, seq, 1234) + body


def test_the_reply_gives_the_sockets_owner() -> None:
    assert parse_reply(reply(1001), ASKED) == 1001
    assert parse_reply(reply(0), ASKED) == 0


def test_a_reply_that_names_no_owned_socket_of_that_four_tuple_gives_none() -> None:
    enoent = struct.pack("=IHHII", 36, 2, 0, 7, 1234) + struct.pack("=i", -2) + ASKED[:16]
    assert parse_reply(enoent, ASKED) is None  # not this host's socket: a remote client
    assert parse_reply(reply(1001, inode=0), ASKED) is None  # closed (time-wait): uid 0 lies
    assert parse_reply(reply(1001, state=10), ASKED) is None  # a listener on the client's port
    assert parse_reply(reply(1001, sport=40001), ASKED) is None
    assert parse_reply(reply(1001, dport=0), ASKED) is None
    assert parse_reply(reply(1001, src=bytes([127, 0, 0, 3])), ASKED) is None
    assert parse_reply(reply(1001, seq=8), ASKED) is None  # another request's
    assert parse_reply(reply(1001)[:60], ASKED) is None  # cut short
    assert parse_reply(b"", ASKED) is None
    # An AF_INET6 socket's v4-mapped address is its IPv4 one.
    def mapped(last: int) -> bytes:
        return bytes(10) + b"\xff\xff" + bytes([127, 0, 0, last])
    assert parse_reply(reply(5, src=mapped(2), dst=mapped(1), family=socket.AF_INET6),
                       ASKED) == 5
    assert parse_reply(reply(5, src=mapped(2), dst=mapped(3), family=socket.AF_INET6),
                       ASKED) is None
    asked6 = request("::ffff:127.0.0.2", 40000, "::ffff:127.0.0.1", 5000, socket.AF_INET6, 7)
    assert parse_reply(reply(5), asked6) == 5  # the kernel answers with the AF_INET socket


@contextlib.contextmanager
def connected(family: int, host: str) -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.socket(family) as srv:
        srv.bind((host, 0))
        srv.listen()
        with socket.socket(family) as client:
            client.connect(srv.getsockname()[:2])
            accepted, _ = srv.accept()
            with accepted:
                yield client, accepted


@pytest.mark.parametrize(("family", "host"), [(socket.AF_INET, "127.0.0.1"),
                                              (socket.AF_INET6, "::1")])
def test_the_kernel_names_the_owner_of_a_connection_over_loopback(family: int, host: str
                                                                 ) -> None:
    with connected(family, host) as (_client, accepted):
        peer, here = accepted.getpeername(), accepted.getsockname()
        assert local_uid(peer[0], peer[1], here[0], here[1], family) == os.getuid()
        # Not a socket of this host (as a remote client's is not): none.
        other = "127.0.0.9" if family == socket.AF_INET else "::2"
        assert local_uid(other, peer[1], here[0], here[1], family) is None


def test_a_client_that_has_closed_its_end_has_no_owner() -> None:
    with connected(socket.AF_INET, "127.0.0.1") as (client, accepted):
        peer, here = accepted.getpeername(), accepted.getsockname()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # reset: gone from the tables
        assert local_uid(peer[0], peer[1], here[0], here[1], socket.AF_INET) is None


def test_no_netlink_is_no_owner_never_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: object) -> socket.socket:
        raise PermissionError("netlink forbidden here")
    monkeypatch.setattr(peeruid.socket, "socket", refused)
    assert local_uid("127.0.0.2", 1, "127.0.0.1", 2, socket.AF_INET) is None
    assert local_uid("not an address", 1, "127.0.0.1", 2, socket.AF_INET) is None
