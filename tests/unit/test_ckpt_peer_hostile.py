"""The peer server and PeerTier under hostile or slow conditions, over real sockets: slowloris
handshakes, connection floods from one host, peers that never answer, and replica directories
that another user planted or linked."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.ckpt import peer
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.peer import Address, PeerError, PeerServer, PeerTier
from gpuwarden.ckpt.peerwire import BUSY, PeerBusy
from gpuwarden.ckpt.tier import CorruptStep
from tests.unit.test_ckpt_peer import KEY, manifest

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: it chowns files")
ATTACKER = "127.0.0.2"  # another source address on the loopback (Linux routes 127/8 there)
# What a slowloris trickles: a well-formed nonce frame, then a header frame that never ends.
TRICKLE = b"\0\0\0\x20" + b"n" * 32 + b"\0\0\xff\xff" + b"{" * 4000


class Slowloris:
    """``n`` connections from ``source`` that send one byte each ``every`` seconds and never
    finish the handshake; records when the server hung up on each."""

    def __init__(self, port: int, n: int, source: str, every: float = 0.1) -> None:
        self.socks: list[socket.socket] = []
        self.hello: list[bytes] = []
        for _ in range(n):
            s = socket.socket()
            s.bind((source, 0))
            s.connect(("127.0.0.1", port))
            s.settimeout(5)
            self.hello.append(s.recv(64))
            s.setblocking(False)
            self.socks.append(s)
        self.closed_at: dict[int, float] = {}
        self.start = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        pos = 0
        while not self._stop.wait(every) and pos < len(TRICKLE):
            for i, s in enumerate(self.socks):
                if i in self.closed_at:
                    continue
                try:
                    if s.recv(4096) == b"":
                        self.closed_at[i] = time.monotonic() - self.start
                        continue
                except BlockingIOError:
                    pass
                except OSError:
                    self.closed_at[i] = time.monotonic() - self.start
                    continue
                with contextlib.suppress(OSError):
                    s.send(TRICKLE[pos:pos + 1])
            pos += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in self.socks:
            s.close()

    def busy(self) -> int:
        return sum(1 for h in self.hello if h.endswith(BUSY))


@contextlib.contextmanager
def attack(port: int, n: int, source: str = ATTACKER) -> Iterator[Slowloris]:
    lor = Slowloris(port, n, source)
    try:
        yield lor
    finally:
        lor.stop()


@pytest.fixture
def node_b(tmp_path: Path) -> Iterator[tuple[PeerServer, Address, Path]]:
    """A peer server holding rank 0's step 5. Its handshake deadline is generous: the ranks'
    own handshakes must never run into it on a loaded machine, and a slowloris holds its slot
    for as long as a test needs it held."""
    srv = PeerServer(KEY, "job-7", str(tmp_path / "nodeB"), host="127.0.0.1", handshake_s=30)
    a = Address("127.0.0.1", srv.port)
    PeerTier(KEY, "job-7", 0, [a], []).commit(*manifest(5))
    yield srv, a, tmp_path / "nodeB"
    srv.stop()


def wait_until(cond: object, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


# ---- slowloris and floods ----------------------------------------------------------------------
def test_a_trickling_handshake_is_cut_at_one_deadline_not_per_byte(tmp_path: Path) -> None:
    """The handshake deadline is absolute: a byte every 0.1 s does not keep a 0.5 s one open.
    (Per byte, the trickle of TRICKLE would hold it for 400 s.)"""
    srv = PeerServer(KEY, "job-7", str(tmp_path / "nodeB"), host="127.0.0.1", handshake_s=0.5)
    try:
        with attack(srv.port, 1) as lor:
            assert wait_until(lambda: 0 in lor.closed_at, 15.0), "the server kept the slowloris"
            assert lor.closed_at[0] < 10.0
    finally:
        srv.stop()


def test_a_slowloris_host_cannot_take_every_slot_from_the_jobs_ranks(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """64 keyless connections from one host held all 64 slots, and PeerTier.steps() then
    returned [] as if the peer had nothing. Now one host gets PER_SOURCE handshakes at once."""
    srv = PeerServer(KEY, "job-7", str(tmp_path / "nodeB"), host="127.0.0.1", handshake_s=30,
                     per_source=8)
    a = Address("127.0.0.1", srv.port)
    try:
        PeerTier(KEY, "job-7", 0, [a], []).commit(*manifest(5))
        with attack(a.port, 64) as lor:
            assert lor.busy() == 56  # told why, at once
            assert PeerTier(KEY, "job-7", 0, [], [a], timeout=30).steps() == [5]
        refusals = [r for r in caplog.records if "refused a connection" in r.getMessage()]
        assert len(refusals) == 1 and ATTACKER in refusals[0].getMessage()  # not 56 lines
    finally:
        srv.stop()


def test_a_rank_refused_at_the_limits_gets_an_error_naming_the_peer_not_an_empty_list(
        node_b: tuple[PeerServer, Address, Path]) -> None:
    srv, a, _ = node_b
    srv._admission.total = 4  # a small server: 4 connections at once
    # The slowloris holds all 4 for the fixture's 30 s handshake deadline, so the rank is
    # refused until its own deadline; that one is long enough for the first refusal to come
    # back on a loaded machine.
    with attack(a.port, 4, source="127.0.0.1"):
        start = time.monotonic()
        with pytest.raises(PeerError, match=rf"127\.0\.0\.1:{a.port}: busy"):
            PeerTier(KEY, "job-7", 0, [], [a], timeout=2).steps()
        assert time.monotonic() - start < 10.0  # at its deadline, not when a slot frees


def test_a_peer_still_refusing_at_the_deadline_is_named_busy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen on a loaded machine: the thread asking a busy peer gave up just before the
    deadline but ran again only after it, and the rank was told "no answer" instead."""
    asked: list[Address] = []
    late = threading.Event()

    def busy_then_late(key: bytes, addr: Address, *_: object, **__: object) -> object:
        asked.append(addr)
        if len(asked) == 1:
            raise PeerBusy(f"peer {addr}: busy: it refused the connection")
        late.wait(30)  # this thread does not run again before the deadline
        raise PeerError(f"peer {addr}: no time left to ask it")

    monkeypatch.setattr(peer, "_request", busy_then_late)
    a = Address("127.0.0.1", 9)
    try:
        with pytest.raises(PeerError, match=r"127\.0\.0\.1:9: busy"):
            PeerTier(KEY, "job-7", 0, [], [a], timeout=0.5).steps()
    finally:
        late.set()


# ---- asking every peer at once ----------------------------------------------------------------
def test_steps_asks_every_peer_at_once_within_one_deadline(
        node_b: tuple[PeerServer, Address, Path], caplog: pytest.LogCaptureFixture) -> None:
    """Five peers that accept and never answer cost one deadline, not five; each is named."""
    _, a, _ = node_b
    # The deadline fires for the five; the live peer must answer within it on a loaded machine.
    timeout = 3.0
    holes = []
    for _ in range(5):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(8)  # the kernel completes the connection; nobody ever answers on it
        holes.append(s)
    try:
        dead = [Address("127.0.0.1", s.getsockname()[1]) for s in holes]
        tier = PeerTier(KEY, "job-7", 0, [], [*dead, a], timeout=timeout)
        start = time.monotonic()
        assert tier.steps() == [5]
        assert time.monotonic() - start < 2 * timeout  # one deadline: five would be 5 x
        errors = " ".join(r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR)
        assert "5 of 6 peers" in errors and all(str(d) in errors for d in dead)
        assert tier.load(5)[0].step == 5
    finally:
        for s in holes:
            s.close()


# ---- planted and linked replica directories -----------------------------------------------------
def planted(tmp_path: Path, step: int = 9, rank: int = 0) -> Path:
    """A genuine-looking replica committed elsewhere: what someone could link or move in."""
    tier = FsTier("x", str(tmp_path / "elsewhere"), "job-7.peer", rank)
    tier.commit(*manifest(step, rank))
    return Path(tier.dir)


def test_a_linked_replica_directory_is_refused_and_named(
        node_b: tuple[PeerServer, Address, Path], tmp_path: Path) -> None:
    _, a, mem = node_b
    shutil.rmtree(mem / "job-7.peer")
    (mem / "job-7.peer").symlink_to(planted(tmp_path).parent)
    with pytest.raises(PeerError, match=r"job-7\.peer is not a directory \(a link\?\): refusing it"):
        PeerTier(KEY, "job-7", 0, [], [a]).steps()


def test_a_linked_rank_directory_is_refused_though_its_parent_is_real(
        node_b: tuple[PeerServer, Address, Path], tmp_path: Path) -> None:
    _, a, mem = node_b
    shutil.rmtree(mem / "job-7.peer" / "rank-00000")
    (mem / "job-7.peer" / "rank-00000").symlink_to(planted(tmp_path))
    with pytest.raises(PeerError, match=r"rank-00000 is not a directory \(a link\?\): refusing it"):
        PeerTier(KEY, "job-7", 0, [], [a]).steps()


def test_a_fifo_planted_as_a_shard_is_refused_at_once(
        node_b: tuple[PeerServer, Address, Path]) -> None:
    _, a, mem = node_b
    shard = mem / "job-7.peer" / "rank-00000" / "step-000000000005" / "w"
    shard.unlink()
    os.mkfifo(shard)
    tier = PeerTier(KEY, "job-7", 0, [], [a], timeout=30)
    assert tier.steps() == [5]
    start = time.monotonic()
    with pytest.raises(CorruptStep, match="w: not a regular file"):
        tier.load(5)
    assert time.monotonic() - start < 10.0  # not waiting out the 30 s timeout on the FIFO


def test_a_step_copied_under_another_rank_is_not_served_as_that_rank(
        node_b: tuple[PeerServer, Address, Path], tmp_path: Path) -> None:
    _, a, mem = node_b
    src = planted(tmp_path, step=5, rank=1) / "step-000000000005"
    dst = mem / "job-7.peer" / "rank-00000" / "step-000000000005"
    shutil.rmtree(dst)
    shutil.copytree(src, dst)
    tier = PeerTier(KEY, "job-7", 0, [], [a])
    assert tier.steps() == [5]
    with pytest.raises(CorruptStep, match="the manifest is of job-7 rank 1 step 5, found where job-7 rank 0"):
        tier.load(5)


@as_root
@pytest.mark.parametrize("namespace", ["job-7", "job-7.peer"])
def test_steps_another_user_planted_are_refused_on_read(tmp_path: Path, namespace: str) -> None:
    """Mallory creates job-7 (tier 0) or job-7.peer before alice's job starts and saves step
    999 there, readable by all: alice's ranks must never be served it."""
    mem = tmp_path / "nodeB"
    mem.mkdir(mode=0o1777)
    tier = FsTier("x", str(mem), namespace, 0)
    m, data = manifest(999)
    tier.commit(m, data)
    for dirpath, _, files in os.walk(mem / namespace):
        for p in [dirpath, *(os.path.join(dirpath, f) for f in files)]:
            os.chown(p, NOBODY, NOBODY)
            os.chmod(p, 0o755 if os.path.isdir(p) else 0o644)
    srv = PeerServer(KEY, "job-7", str(mem), host="127.0.0.1")
    try:
        refused = rf"{namespace} belongs to uid {NOBODY}, not to the job's user \(uid 0\)"
        with pytest.raises(PeerError, match=refused):
            PeerTier(KEY, "job-7", 0, [], [Address("127.0.0.1", srv.port)]).steps()
    finally:
        srv.stop()
