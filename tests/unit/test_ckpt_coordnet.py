"""The job's coordinator (`coordsrv`) and its client (`coordnet.NetCoordinator`) over real
sockets on the loopback, ranks as threads: agreement without a shared filesystem, and what a
stranger or a confused rank can and cannot do to it."""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gpuwarden.ckpt import coordsrv
from gpuwarden.ckpt.coord import CoordError, agree
from gpuwarden.ckpt.coordnet import CoordIOError, NetCoordinator, parse_address
from gpuwarden.ckpt.coordsrv import CoordServer, run_of
from gpuwarden.ckpt.peer import Address, PeerError, PeerTier
from gpuwarden.ckpt.peerauth import COORD, PEER
from gpuwarden.ckpt.peerwire import hmac_over, recv_frame, send_frame
from tests.unit.test_ckpt_peer import KEY
from tests.unit.test_ckpt_peer_hostile import ATTACKER, attack, wait_until

JOB = "job-7"


@pytest.fixture
def srv() -> Iterator[CoordServer]:
    s = CoordServer(KEY, JOB, host="127.0.0.1")
    yield s
    s.stop()


def client(s: CoordServer, rank: int, world: int, key: bytes = KEY, job: str = JOB,
           **kw: Any) -> NetCoordinator:
    return NetCoordinator(f"127.0.0.1:{s.port}", key, job, rank, world, **kw)


def as_ranks(world: int, body: Callable[[int], Any], timeout: float = 60) -> dict[int, Any]:
    """``body(rank)`` in one thread per rank; what each returned or raised."""
    out: dict[int, Any] = {}

    def run(r: int) -> None:
        try:
            out[r] = body(r)
        except Exception as exc:
            out[r] = exc
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in reversed(threads):  # the last rank first: order of arrival must not matter
        t.start()
    for t in threads:
        t.join(timeout)
    return out


# ---- agreement ------------------------------------------------------------------------------
def test_exchange_returns_every_ranks_value_in_rank_order(srv: CoordServer) -> None:
    out = as_ranks(4, lambda r: client(srv, r, 4).exchange("peers-r0-s0", {"rank": r}, 30))
    assert out == {r: [{"rank": 0}, {"rank": 1}, {"rank": 2}, {"rank": 3}] for r in range(4)}


def test_ranks_agree_on_the_newest_step_all_of_them_hold(srv: CoordServer) -> None:
    held = {0: [5, 10, 15], 1: [5, 10], 2: [10, 15, 20]}
    out = as_ranks(3, lambda r: agree(client(srv, r, 3), "agree-r1-s0", held[r], 30))
    assert out == {0: 10, 1: 10, 2: 10}


def test_a_rank_that_never_reports_is_named_at_the_timeout(srv: CoordServer) -> None:
    start = time.monotonic()
    with pytest.raises(CoordError, match=r"agree-r0-s0: ranks 1,2 did not report within 0 s "
                                         rf"\(at the coordinator 127\.0\.0\.1:{srv.port}\)"):
        client(srv, 0, 3).exchange("agree-r0-s0", [1], timeout=0.3)
    assert time.monotonic() - start < coordsrv.SEND_S  # its wait, not the grace after it


def test_a_retried_exchange_is_the_same_exchange(srv: CoordServer) -> None:
    """A response lost on the way back: the rank asks again with the same value."""
    first = threading.Event()

    def rank0() -> list[Any]:
        with pytest.raises(CoordError, match="ranks 1 did not report"):
            client(srv, 0, 2).exchange("agree-r0-s0", [5], timeout=0.2)
        first.set()
        return client(srv, 0, 2).exchange("agree-r0-s0", [5], timeout=30)  # the retry

    def rank1() -> list[Any]:
        assert first.wait(30)
        return client(srv, 1, 2).exchange("agree-r0-s0", [5, 6], timeout=30)
    out = as_ranks(2, lambda r: rank1() if r else rank0())
    assert out == {0: [[5], [5, 6]], 1: [[5], [5, 6]]}
    # After the round is complete, a retry still gets its answer at once.
    assert client(srv, 1, 2).exchange("agree-r0-s0", [5, 6], timeout=0) == [[5], [5, 6]]


def test_a_rank_sending_another_value_in_the_same_round_is_refused(srv: CoordServer) -> None:
    with pytest.raises(CoordError, match="ranks 1 did not report"):
        client(srv, 0, 2).exchange("agree-r0-s0", [5], timeout=0.1)
    with pytest.raises(CoordError, match="rank 0 sent two values for round agree-r0-s0"):
        client(srv, 0, 2).exchange("agree-r0-s0", [9], timeout=1)
    with pytest.raises(CoordError, match="round agree-r0-s0 is of 2 ranks; rank 0 says 3"):
        client(srv, 0, 3).exchange("agree-r0-s0", [5], timeout=1)


def test_the_first_of_32_concurrent_proposals_wins_for_everyone(srv: CoordServer) -> None:
    go = threading.Barrier(32)

    def propose(r: int) -> int:
        c = client(srv, r, 32)
        go.wait(30)
        return c.propose("stop-r0-s0", 100 + r)
    out = as_ranks(32, propose)
    assert len(set(out.values())) == 1 and out[0] in range(100, 132)
    assert client(srv, 5, 32).propose("stop-r0-s0", 7) == out[0]


def test_the_floor_is_none_until_every_rank_published_then_the_oldest(srv: CoordServer) -> None:
    ranks = [client(srv, r, 3) for r in range(3)]
    ranks[0].publish_durable("s3", 20)
    ranks[1].publish_durable("s3", 10)
    assert ranks[0].durable_floor("s3") is None
    ranks[2].publish_durable("s3", -1)  # restored nothing there: holds nothing yet
    assert ranks[0].durable_floor("s3") == -1
    ranks[2].publish_durable("s3", 30)
    assert ranks[1].durable_floor("s3") == 10
    assert ranks[1].durable_floor("shared") is None  # per tier
    ranks[1].publish_durable("s3", 25)
    assert ranks[1].durable_floor("s3") == 10  # cached for floor_ttl_s: deletes less
    assert ranks[1].durable_floor("s3", fresh=True) == 20


def test_rounds_of_runs_older_than_the_two_newest_are_dropped(srv: CoordServer) -> None:
    """A spare relaunch is a new run (new step id): a straggler of an old run can neither
    complete nor wait on its rounds once two newer runs started, and they are freed."""
    answered: list[BaseException] = []
    waiting = threading.Event()

    def straggler() -> None:
        c = client(srv, 0, 2)
        waiting.set()
        try:
            c.exchange("finish-r0-s0", 0, timeout=60)
        except CoordError as exc:
            answered.append(exc)
    t = threading.Thread(target=straggler)
    t.start()
    assert waiting.wait(10) and wait_until(lambda: "finish-r0-s0" in srv._rounds, 10)
    solo = client(srv, 0, 1)
    assert solo.exchange("peers-r0-s1", "a", 5) == ["a"]
    assert "finish-r0-s0" in srv._rounds  # two runs: both kept
    assert solo.exchange("peers-r0-s2", "b", 5) == ["b"]
    t.join(30)
    assert answered and "run r0-s0 was replaced by a newer one" in str(answered[0])
    assert "finish-r0-s0" not in srv._rounds and srv._held == len('"b"') + len('"a"')
    with pytest.raises(CoordError, match="older than the runs this coordinator serves"):
        client(srv, 1, 2).exchange("finish-r0-s0", 1, timeout=1)
    assert run_of("fresh-r12-s3-2") == (12, 3) and run_of("bad") is None


def test_the_coordinator_holds_a_bounded_number_of_rounds(srv: CoordServer) -> None:
    srv.max_rounds = 3
    solo = client(srv, 0, 1)
    for i in range(3):
        solo.exchange(f"fresh-r0-s0-{i}", i, 1)
    with pytest.raises(CoordError, match="3 rounds and proposals held already"):
        solo.propose("stop-r0-s0", 5)


def test_a_value_larger_than_the_coordinator_takes_is_refused_before_sending(
        srv: CoordServer) -> None:
    with pytest.raises(CoordError, match="more than the coordinator takes"):
        client(srv, 0, 1).exchange("agree-r0-s0", "x" * (coordsrv.MAX_VALUE + 1), 1)


# ---- strangers and other jobs ---------------------------------------------------------------
def raw(port: int, key: bytes, labels: Any, header: bytes) -> bytes:
    """A client speaking the wire by hand; what the server sent after the header."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        hello = recv_frame(sock, 64)
        nonce_s, nonce_c = hello[8:], secrets.token_bytes(32)
        send_frame(sock, nonce_c)
        send_frame(sock, header)
        send_frame(sock, hmac_over(key, labels.hdr, nonce_s, nonce_c, header).digest())
        try:
            return recv_frame(sock, 64)
        except (PeerError, OSError):
            return b""


def test_a_request_without_the_key_is_refused_before_its_header_is_decoded(
        srv: CoordServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    assert raw(srv.port, b"x" * 32, COORD, b"{not json") == b""
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "refused a request without this job's key" in logged and "JSON" not in logged
    # With the key, the same bytes are decoded and answered with the error.
    assert raw(srv.port, KEY, COORD, b"{not json") != b""


def test_a_peer_message_is_refused_by_the_coordinator(srv: CoordServer) -> None:
    header = json.dumps({"v": 1, "op": "ping", "job": JOB, "rank": 0, "world": 1}).encode()
    assert raw(srv.port, KEY, PEER, header) == b""
    assert raw(srv.port, KEY, COORD, header) != b""
    with pytest.raises(PeerError, match="not a gpuwarden peer"):
        PeerTier(KEY, JOB, 0, [], [Address("127.0.0.1", srv.port)], timeout=10).steps()


def test_another_jobs_key_or_name_is_refused(srv: CoordServer) -> None:
    start = time.monotonic()
    with pytest.raises(CoordError, match="it refused ours") as err:
        client(srv, 0, 1, key=b"o" * 32).exchange("peers-r0-s0", "x", 30)
    assert not isinstance(err.value, CoordIOError)  # not retried until the deadline
    assert time.monotonic() - start < 30
    with pytest.raises(CoordError, match="a request of 'job-8' sent to job-7's coordinator"):
        client(srv, 0, 1, job="job-8").propose("stop-r0-s0", 3)
    assert srv._rounds == {} and srv._proposals == {}


def test_a_trickling_handshake_is_cut_at_one_deadline() -> None:
    s = CoordServer(KEY, JOB, host="127.0.0.1", handshake_s=0.5)
    try:
        with attack(s.port, 1) as lor:
            assert wait_until(lambda: 0 in lor.closed_at, 15.0), "the server kept the slowloris"
            assert lor.closed_at[0] < 10.0
    finally:
        s.stop()


def test_a_slowloris_host_cannot_keep_the_ranks_from_agreeing(
        caplog: pytest.LogCaptureFixture) -> None:
    s = CoordServer(KEY, JOB, host="127.0.0.1", handshake_s=30, per_source=8)
    try:
        with attack(s.port, 64) as lor:
            assert lor.busy() == 56
            out = as_ranks(3, lambda r: client(s, r, 3).exchange("agree-r0-s0", [r], 30))
            assert out == {r: [[0], [1], [2]] for r in range(3)}
        refusals = [r for r in caplog.records if "refused a connection" in r.getMessage()]
        assert len(refusals) == 1 and ATTACKER in refusals[0].getMessage()
    finally:
        s.stop()


def test_an_oversized_frame_is_cut_without_being_read(srv: CoordServer) -> None:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        recv_frame(sock, 64)
        send_frame(sock, b"n" * 32)
        sock.sendall(b"\x40\0\0\0")  # a 1 GiB header announced
        assert sock.recv(16) == b""  # hung up at once, nothing allocated
    assert client(srv, 0, 1).ping() == 1


def test_a_busy_coordinator_is_asked_again_until_it_answers() -> None:
    """Every slot held by keyless connections from the rank's own address: refused (BUSY)
    until the handshake deadline frees them, then answered within the rank's deadline."""
    s = CoordServer(KEY, JOB, host="127.0.0.1", handshake_s=1.0, max_connections=2)
    pauses: list[float] = []

    def sleep(t: float) -> None:
        pauses.append(t)
        time.sleep(t)
    try:
        with attack(s.port, 2, source="127.0.0.1") as lor:
            c = client(s, 0, 1, op_timeout_s=30, sleep=sleep)
            assert c.propose("stop-r0-s0", 4) == 4
            assert lor.busy() == 0
        assert pauses and max(pauses) <= 1.0
    finally:
        s.stop()


def test_no_coordinator_is_an_oserror_naming_it_at_the_deadline() -> None:
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        port = hole.getsockname()[1]  # bound, not listening: connections refused
        c = NetCoordinator(f"127.0.0.1:{port}", KEY, JOB, 0, 2, op_timeout_s=0.5, grace_s=0.3)
        with pytest.raises(OSError, match=rf"coordinator 127\.0\.0\.1:{port}: cannot connect"):
            c.durable_floor("s3")
        with pytest.raises(CoordIOError, match="asked [0-9]+ times"):
            c.exchange("agree-r0-s0", [], timeout=0.2)


def test_addresses_and_the_key_in_messages() -> None:
    assert parse_address("c1:4000") == Address("c1", 4000)
    assert parse_address("[::1]:4000") == Address("::1", 4000)
    for bad in ("c1", "c1:", ":4000", "c1:99999", "c1:x"):
        with pytest.raises(CoordError, match="expected host:port"):
            parse_address(bad)
    c = NetCoordinator("c1:4000", KEY, JOB, 0, 1)
    assert "kkkk" not in repr(c) and "kkkk" not in repr(CoordServer(KEY, JOB, host="127.0.0.1"))


def test_the_key_never_reaches_the_logs(srv: CoordServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    raw(srv.port, b"x" * 32, COORD, b"{}")
    with pytest.raises(CoordError):
        client(srv, 0, 2).exchange("agree-r0-s0", [1], timeout=0.1)
    with pytest.raises(CoordError):
        client(srv, 0, 2).exchange("agree-r0-s0", [2], timeout=0.1)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert text and KEY.decode() not in text and KEY.hex() not in text


def test_the_writers_calls_fail_as_oserrors_even_at_another_jobs_coordinator(
        srv: CoordServer) -> None:
    """Our coordinator gone and its port taken by another job's: retention must see "floor
    unknown" (OSError: delete nothing), never an error that stops the writer."""
    c = client(srv, 0, 1, key=b"o" * 32)
    with pytest.raises(OSError, match="it refused ours"):
        c.durable_floor("s3")
    with pytest.raises(OSError, match="it refused ours"):
        c.publish_durable("s3", 5)
