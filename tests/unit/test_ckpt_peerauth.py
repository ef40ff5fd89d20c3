"""The authenticated channel shared by the peer tier and the job's coordinator (`peerauth`):
each protocol has its own magic and MAC labels, so a message made for one kind of server is
refused by the other even under the job's own key."""

from __future__ import annotations

import json
import logging
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.ckpt import peerauth
from gpuwarden.ckpt.peer import Address, PeerServer, PeerTier
from gpuwarden.ckpt.peerauth import COORD, PEER, Wire
from gpuwarden.ckpt.peerwire import PeerError, hmac_over, recv_frame, send_frame
from tests.unit.test_ckpt_peer import KEY


def forged(port: int, macs: Wire, req: dict[str, object], key: bytes = KEY) -> bytes:
    """A client that takes whatever hello the server sends and authenticates its header with
    ``macs``' labels; returns what the server sent back after the header (b"" when it hung
    up without proving the key)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        hello = recv_frame(sock, 64)
        nonce_s, nonce_c = hello[8:], secrets.token_bytes(32)
        header = json.dumps(req).encode()
        send_frame(sock, nonce_c)
        send_frame(sock, header)
        send_frame(sock, hmac_over(key, macs.hdr, nonce_s, nonce_c, header).digest())
        try:
            return recv_frame(sock, 64)
        except (PeerError, OSError):
            return b""


@pytest.fixture
def peer_server(tmp_path: Path) -> Iterator[PeerServer]:
    srv = PeerServer(KEY, "job-7", str(tmp_path / "nodeB"), host="127.0.0.1")
    yield srv
    srv.stop()


def test_the_protocols_share_no_magic_and_no_label() -> None:
    assert PEER.magic != COORD.magic and len(PEER.magic) == len(COORD.magic) == 8
    peer_labels = {PEER.hdr, PEER.ready, PEER.rhdr, PEER.body, PEER.resp}
    assert not peer_labels & {COORD.hdr, COORD.ready, COORD.rhdr}


def test_a_coordinator_message_is_refused_by_a_peer_server(
        peer_server: PeerServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    req = {"v": 1, "op": "exchange", "job": "job-7", "rank": 0, "world": 1,
           "round": "agree-r0-s0", "value": [], "wait_s": 1}
    assert forged(peer_server.port, COORD, req) == b""  # no proof of the key: nothing more
    assert any("refused a request without this job's key" in r.getMessage()
               for r in caplog.records)
    # The same request under the peer's own labels is answered: the labels made the difference.
    assert forged(peer_server.port, PEER, {"op": "list", "rank": 0}) != b""


def test_a_coordinator_client_gets_no_answer_from_a_peer_server(peer_server: PeerServer) -> None:
    with pytest.raises(PeerError, match=rf"coordinator 127\.0\.0\.1:{peer_server.port}: not a "
                                        "gpuwarden coordinator"):
        peerauth.client_request(KEY, Address("127.0.0.1", peer_server.port), COORD,
                                {"op": "ping"}, timeout=10)


def test_a_peer_that_refuses_our_key_is_named(peer_server: PeerServer) -> None:
    with pytest.raises(PeerError, match="it refused ours"):
        PeerTier(b"x" * 32, "job-7", 0, [], [Address("127.0.0.1", peer_server.port)],
                 timeout=10).steps()


def test_the_key_is_not_in_a_sessions_repr() -> None:
    s = peerauth.Session(KEY, PEER, b"s" * 32, b"c" * 32)
    assert "kkkk" not in repr(s) and "sss" not in repr(s)
