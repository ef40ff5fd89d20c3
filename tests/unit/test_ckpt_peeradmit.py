"""Admission (`peeradmit`) for the peer server and the job's coordinator: what a stranger can
hold, counted by source, not by address string. Over real sockets on the loopback (Linux
routes all of 127/8 there, so one local user can connect from 16M source addresses), and
the budgets driven with source strings for the hosts a loopback test cannot have."""

from __future__ import annotations

import contextlib
import os
import select
import selectors
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuwarden.ckpt import peerauth
from gpuwarden.ckpt.coordnet import NetCoordinator
from gpuwarden.ckpt.coordsrv import CoordServer
from gpuwarden.ckpt.peer import Address, PeerServer, PeerTier
from gpuwarden.ckpt.peeradmit import (
    EVICT_AFTER_S,
    LOOPBACK,
    Admission,
    Ticket,
    allocation,
    source_of,
)
from gpuwarden.ckpt.peerwire import BUSY
from tests.unit.test_ckpt_peer import KEY, manifest

JOB = "job-7"


class Holders:
    """Connections from many loopback source addresses that read the server's hello and then
    send nothing: each holds its slot until the server drops it."""

    def __init__(self, port: int, sources: list[str], each: int) -> None:
        self.socks: list[socket.socket] = []
        self.hello: list[bytes] = []
        for src in sources:
            for _ in range(each):
                s = socket.socket()
                s.bind((src, 0))
                s.connect(("127.0.0.1", port))
                s.settimeout(5)
                self.socks.append(s)
                self.hello.append(s.recv(64))

    def busy(self) -> int:
        return sum(1 for h in self.hello if h.endswith(BUSY))

    def close(self) -> None:
        for s in self.socks:
            s.close()


@contextlib.contextmanager
def holding(port: int, sources: list[str], each: int) -> Iterator[Holders]:
    h = Holders(port, sources, each)
    try:
        yield h
    finally:
        h.close()


def loopbacks(n: int) -> list[str]:
    return [f"127.0.{i // 250}.{2 + i % 250}" for i in range(n)]


# ---- one local user, many loopback addresses --------------------------------------------------
def test_many_loopback_addresses_cannot_keep_a_rank_from_the_coordinator() -> None:
    """The hostile review's flood, scaled down: 16 addresses x 4 connections held all 64 slots
    for the whole handshake deadline (8 s), so a rank with the key was told BUSY until its own
    deadline (5 s). All of 127/8 is one source now: 4 of them get in, for the first frame's
    deadline only, and the rank is answered."""
    s = CoordServer(KEY, JOB, host="127.0.0.1", max_connections=64, per_source=4,
                    handshake_s=8.0)
    try:
        with holding(s.port, loopbacks(16), 4) as h:
            c = NetCoordinator(f"127.0.0.1:{s.port}", KEY, JOB, 0, 1, op_timeout_s=5.0)
            start = time.monotonic()
            assert c.ping() == 1
            assert time.monotonic() - start < 5.0
            assert h.busy() == 60
    finally:
        s.stop()


def test_many_loopback_addresses_cannot_keep_a_rank_from_its_peers(tmp_path: Path) -> None:
    srv = PeerServer(KEY, JOB, str(tmp_path / "nodeB"), host="127.0.0.1", handshake_s=8.0,
                     max_connections=64, per_source=4)
    a = Address("127.0.0.1", srv.port)
    try:
        PeerTier(KEY, JOB, 0, [a], []).commit(*manifest(5))
        with holding(srv.port, loopbacks(16), 4) as h:
            assert PeerTier(KEY, JOB, 0, [], [a], timeout=5).steps() == [5]
            assert h.busy() == 60
    finally:
        srv.stop()


def test_ipv4_mapped_forms_are_one_source_with_their_ipv4_address() -> None:
    for a in ("127.0.0.1", "127.3.2.1", "::1", "::ffff:127.0.0.5", "0:0:0:0:0:ffff:7f00:9"):
        assert source_of(a) == LOOPBACK, a
    assert source_of("::ffff:10.0.0.5") == source_of("10.0.0.5") == "10.0.0.5"
    assert source_of("fe80::1%eth0") == source_of("fe80::1") == "fe80::1"
    assert source_of("2001:db8:0:0::7") == "2001:db8::7"
    assert source_of("not-an-address") == "not-an-address"


# ---- the budgets, driven with source strings -------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_strangers_from_many_hosts_leave_the_jobs_hosts_their_share() -> None:
    """256 hosts outside the job, 16 handshakes each, would fill 4096 slots; together they get
    a quarter, and the job's nodes (resolved from the allocation) the rest."""
    adm = Admission(4096, 16, clock=Clock())
    adm.own(["10.0.0.1", "::ffff:10.0.0.2"])
    strangers = [adm.enter(f"192.168.{i}.7") for i in range(256) for _ in range(16)]
    assert sum(isinstance(t, Ticket) for t in strangers) == 1024
    assert "outside the job's hosts" in str(strangers[-1])
    ranks = [adm.enter(a) for a in ("10.0.0.1", "::ffff:10.0.0.1", "10.0.0.2", "127.0.0.1")
             for _ in range(4)]
    assert all(isinstance(t, Ticket) and not t.stranger for t in ranks)
    # A rank that showed the key no longer counts against its source.
    for t in ranks:
        assert isinstance(t, Ticket)
        adm.authenticated(t)
    assert all(isinstance(adm.enter("10.0.0.1"), Ticket) for _ in range(16))


def test_one_hosts_many_mapped_forms_are_one_source() -> None:
    adm = Admission(64, 4, clock=Clock())
    forms = ["10.1.2.3", "::ffff:10.1.2.3", "0:0:0:0:0:ffff:a01:203", "::ffff:10.1.2.3"]
    assert all(isinstance(adm.enter(a), Ticket) for a in forms)
    assert "4 connections from 10.1.2.3 already" in str(adm.enter("::ffff:10.1.2.3"))
    loop = ["127.0.0.1", "127.9.9.9", "::1", "::ffff:127.0.0.5"]
    assert all(isinstance(adm.enter(a), Ticket) for a in loop)
    assert "from this host's loopback already" in str(adm.enter("127.200.0.1"))


def test_a_stale_handshake_gives_its_sources_slot_to_a_new_connection() -> None:
    """What a holder on a rank's own host takes: the oldest handshake of the source, once it
    is EVICT_AFTER_S old, is hung up on for the next comer; a young one is not."""
    clock, hung = Clock(), []
    adm = Admission(64, 2, clock=clock)
    first = adm.enter("10.1.2.3", lambda: hung.append("first"))
    clock.t += EVICT_AFTER_S / 2
    assert isinstance(adm.enter("10.1.2.3", lambda: hung.append("second")), Ticket)
    assert isinstance(adm.enter("10.1.2.3"), str) and hung == []  # the oldest is young yet
    clock.t += EVICT_AFTER_S / 2
    rank = adm.enter("10.1.2.3", lambda: hung.append("rank"))
    assert isinstance(rank, Ticket) and hung == ["first"]
    assert isinstance(first, Ticket)
    adm.leave(first)  # its handler, woken: counted once, not twice
    assert isinstance(adm.enter("10.1.2.3"), str)  # the second and the rank: young
    adm.authenticated(rank)
    assert isinstance(adm.enter("10.1.2.3"), Ticket)  # the rank showed the key: not counted


def test_the_jobs_hosts_are_resolved_in_the_background() -> None:
    adm = Admission(8, 8, strangers=1, clock=Clock())
    t = adm.own_hosts(["c1", "c2"], resolve={"c1": ["10.0.0.1"], "c2": ["fd00::2"]}.__getitem__)
    assert t is not None
    t.join(5)
    got = [adm.enter(a) for a in ("10.0.0.1", "fd00:0::2", "10.9.9.9", "10.9.9.8")]
    assert [isinstance(g, Ticket) for g in got] == [True, True, True, False]
    assert allocation({"SLURM_JOB_NODELIST": "c[1-3],c2"}) == ["c1", "c2", "c3"]
    assert allocation({"SLURM_JOB_NODELIST": "c[1-"}) == [] and allocation({}) == []


# ---- a user sharing the rank's host, flooding at full speed ----------------------------------
FLOOD_UID = 1001  # what the fake owner says the flood's sockets are (another user's)


def _flood(port: int, sources: list[str], each: int, ready: int) -> None:
    """In the flooder's process: ``each`` connections from every one of ``sources`` that send
    nothing, each re-opened the moment the server refuses or drops it; one byte on ``ready``
    once the server has refused a hundred (the flood at full speed)."""
    sel = selectors.DefaultSelector()
    again: list[str] = []  # sources whose last connection could not be opened

    def open_one(src: str) -> None:
        s = socket.socket()
        s.setblocking(False)
        try:
            s.bind((src, 0))
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass  # connecting: selected once it ends
        except OSError:
            s.close()
            again.append(src)
            return
        sel.register(s, selectors.EVENT_READ, src)
    for src in sources:
        for _ in range(each):
            open_one(src)
    refused, end = 0, time.monotonic() + 55
    while time.monotonic() < end:
        for key, _ in sel.select(0.2):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if data and not data.endswith(BUSY):
                continue  # admitted: held until the server drops it
            sel.unregister(s)
            s.close()
            open_one(key.data)
            refused += 1
            if refused == 100:
                os.write(ready, b"!")
        todo, again[:] = again[:], []
        for src in todo:
            open_one(src)


@contextlib.contextmanager
def flooding(port: int, sources: list[str], each: int, uid: int | None = None
             ) -> Iterator[None]:
    """A flooder in a process of its own (a user of its own when ``uid`` is given: the real
    thing, as root), at full speed before this yields, killed after."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        try:
            os.close(r)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            _flood(port, sources, each, w)
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert select.select([r], [], [], 20)[0] and os.read(r, 1) == b"!", "no flood"
        yield
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)


def owners(rank_address: str) -> Callable[[str, int, str, int, int, float], int | None]:
    """A fake `peeruid.local_uid`: the rank's connections (from ``rank_address``) are the
    server's own user's, every other one another user's, all of them on this host."""
    def owner(client: str, cport: int, server: str, sport: int, family: int, timeout: float
              ) -> int | None:
        return os.geteuid() if client == rank_address else FLOOD_UID
    return owner


def pings_answered(port: int, n: int) -> list[float]:
    """``n`` pings from 127.0.0.1 by a rank holding the key, each within its 5 s."""
    out = []
    for _ in range(n):
        c = NetCoordinator(f"127.0.0.1:{port}", KEY, JOB, 0, 1, op_timeout_s=5.0)
        start = time.monotonic()
        assert c.ping() == 1
        out.append(time.monotonic() - start)
    return out


def test_a_user_flooding_from_the_ranks_own_host_cannot_keep_it_from_the_coordinator(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The flooder shares the rank's source address (loopback here, or the node's address)
    and re-opens every connection at once: on main it took every slot its source freed, and
    the rank was told BUSY until its deadline. Its sockets are another user's: its own
    source now, inside the strangers' budget, and the rank is answered."""
    monkeypatch.setattr(peerauth, "local_uid", owners("127.0.0.1"), raising=False)
    s = CoordServer(KEY, JOB, host="127.0.0.1", max_connections=64, per_source=4, hosts=[])
    try:
        with flooding(s.port, loopbacks(16), 4):
            assert len(pings_answered(s.port, 5)) == 5
    finally:
        s.stop()


def test_a_user_flooding_from_the_ranks_own_host_cannot_keep_it_from_its_peers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peerauth, "local_uid", owners("127.0.0.1"), raising=False)
    srv = PeerServer(KEY, JOB, str(tmp_path / "nodeB"), host="127.0.0.1", max_connections=64,
                     per_source=4, hosts=[])
    a = Address("127.0.0.1", srv.port)
    try:
        PeerTier(KEY, JOB, 0, [a], []).commit(*manifest(5))
        with flooding(srv.port, loopbacks(16), 4):
            for _ in range(3):
                assert PeerTier(KEY, JOB, 0, [], [a], timeout=5).steps() == [5]
    finally:
        srv.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the flooder becomes another user")
def test_another_user_flooding_from_the_same_host_for_real() -> None:
    """No fake: the flooder's process is user 65534's, and the kernel says so (`peeruid`)."""
    s = CoordServer(KEY, JOB, host="127.0.0.1", max_connections=64, per_source=4, hosts=[])
    try:
        with flooding(s.port, loopbacks(16), 4, uid=65534):
            assert len(pings_answered(s.port, 5)) == 5
    finally:
        s.stop()


def test_this_hosts_users_are_sources_of_their_own() -> None:
    """Another local user is a stranger with its own per-source limit, inside the strangers'
    budget; the server's own user is the job's; a remote client keeps its address's rules."""
    me = 1000
    adm = Admission(64, 4, strangers=6, clock=Clock(), uid=me)
    other = [adm.enter("127.0.0.1", uid=1001) for _ in range(5)]
    assert [isinstance(t, Ticket) and t.stranger for t in other] == [True] * 4 + [False]
    assert "from this host's user 1001 already" in str(other[-1])
    third = [adm.enter("10.0.0.9", uid=1002) for _ in range(3)]  # the node's address: the same
    assert [isinstance(t, Ticket) for t in third] == [True, True, False]
    assert "outside the job's hosts" in str(third[-1])
    own = [adm.enter(a, uid=me) for a in ("127.0.0.1", "10.0.0.9") for _ in range(2)]
    assert all(isinstance(t, Ticket) and not t.stranger for t in own)
    # Neither the other users' nor the job's own count against loopback, whose owner unknown.
    assert all(isinstance(adm.enter("127.0.0.1"), Ticket) for _ in range(4))
    assert isinstance(adm.enter("10.0.0.9"), str)  # a stranger's address: the budget is spent
