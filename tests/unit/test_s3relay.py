"""devcluster/s3relay.py, the test cluster's shaping S3 relay, on localhost against servers of
the test's own: the delay each way and the handshake's round trip, the download link shared by
every connection, the upload link per client address, half-close and errors passed on, bounded
memory against a fast sender, a clean shutdown; and its command line (pid file, --status,
--stop) as devcluster/s3shape.py drives it in the s3 container.

Timing: the lower bounds are the shape's physics (the relay must never be faster than the link
it models) and are tight; the upper bounds only say it is not much slower, loosely, for a
loaded 2-core host."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from devcluster import s3relay
from devcluster.s3relay import CHUNK, Link, Params, Relay, parse_rate

RELAY = Path(s3relay.__file__)
MIB = 1 << 20
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _until(what: str, cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        await asyncio.sleep(0.01)


def _run(coro: Coroutine[Any, Any, None]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(50):  # no task of its own (wait_for's would be one)
            await coro
    asyncio.run(bounded())


@contextlib.asynccontextmanager
async def _relayed(handler: Handler, delay_ms: float = 0.0, rate: str = "10gbit",
                   window: int = s3relay.WINDOW) -> AsyncIterator[Relay]:
    """A relay in front of a server running ``handler``; on the way out, everything is shut
    and checked: no task of either is left, no socket is left open."""
    fds = _fds()
    served: set[asyncio.Task[None]] = set()

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        served.add(task)
        try:
            await handler(r, w)
        except (OSError, asyncio.IncompleteReadError):
            pass  # the relay reset the connection: some tests are about that
        finally:
            w.transport.abort()
            served.discard(task)
    upstream = await asyncio.start_server(serve, "127.0.0.1", 0)
    relay = Relay(Params(listen=("127.0.0.1", 0),
                         to=("127.0.0.1", upstream.sockets[0].getsockname()[1]),
                         delay=delay_ms / 1e3, rate=parse_rate(rate), window=window))
    await relay.start()
    try:
        yield relay
    finally:
        await relay.close()
        # The relay closed its side of every connection: the servers' handlers end.
        await _until("the upstream handlers ended", lambda: not served)
        upstream.close()
        await upstream.wait_closed()
        me = asyncio.current_task()
        await _until("no task but the test's", lambda: asyncio.all_tasks() == {me})
        await _until(f"the sockets closed ({_fds()} fds, {fds} before)", lambda: _fds() == fds)
    assert not relay.conns


async def _echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    while data := await r.read(65536):
        w.write(data)
        await w.drain()


def _bulk(size: int) -> Handler:
    """Sends ``size`` bytes once it gets a byte, then closes."""
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readexactly(1)
        block = b"x" * MIB
        for off in range(0, size, MIB):
            w.write(block[:min(MIB, size - off)])
            await w.drain()
        w.close()
    return handler


async def _count(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """Reads to EOF, answers how many bytes it got, closes."""
    n = 0
    while data := await r.read(MIB):
        n += len(data)
    w.write(f"{n}\n".encode())
    await w.drain()
    w.close()


async def _connect(relay: Relay, local: str = "127.0.0.1") -> tuple[asyncio.StreamReader,
                                                                    asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", relay.port, local_addr=(local, 0),
                                         limit=2 * MIB)


async def _download(relay: Relay) -> tuple[int, float]:
    t0 = time.monotonic()
    r, w = await _connect(relay)
    w.write(b"g")
    n = 0
    while data := await r.read(MIB):
        n += len(data)
    took = time.monotonic() - t0
    w.close()
    await w.wait_closed()
    return n, took


async def _upload(relay: Relay, size: int, local: str = "127.0.0.1") -> float:
    t0 = time.monotonic()
    r, w = await _connect(relay, local)
    block = b"u" * MIB
    for off in range(0, size, MIB):
        w.write(block[:min(MIB, size - off)])
        await w.drain()
    w.write_eof()
    assert int(await r.readline()) == size
    took = time.monotonic() - t0
    w.close()
    await w.wait_closed()
    return took


# ---- the model -------------------------------------------------------------------------------------
def test_a_link_sends_at_its_rate_from_when_a_chunk_comes_or_it_is_free() -> None:
    link = Link(rate=1000.0)  # bytes/s
    assert link.send(at=10.0, size=500) == 10.5
    assert link.send(at=10.1, size=500) == 11.0  # queued behind the first
    assert link.send(at=20.0, size=100) == 20.1  # idle meanwhile: no credit saved up


def test_rates_are_tcs_notation_in_bytes_per_second() -> None:
    assert parse_rate("1gbit") == 125e6
    assert parse_rate("100mbit") == 12.5e6
    assert parse_rate("64kbit") == 8e3
    for bad in ("1gb", "fast", "0mbit", "-1gbit", ""):
        with pytest.raises(ValueError, match="rate"):
            parse_rate(bad)


# ---- delay ---------------------------------------------------------------------------------------
def test_a_round_trip_pays_the_delay_each_way_and_a_new_connection_its_handshake() -> None:
    d = 0.015

    async def main() -> None:
        async with _relayed(_echo, delay_ms=d * 1e3) as relay:
            firsts: list[float] = []
            rtts: list[float] = []
            for _ in range(3):
                t0 = time.monotonic()
                r, w = await _connect(relay)
                w.write(b"ping")
                assert await r.readexactly(4) == b"ping"
                firsts.append(time.monotonic() - t0)
                for _ in range(4):
                    t = time.monotonic()
                    w.write(b"ping")
                    assert await r.readexactly(4) == b"ping"
                    rtts.append(time.monotonic() - t)
                w.close()
                await w.wait_closed()
        # The handshake's round trip, then the request's: 4 x the one-way delay.
        assert min(firsts) >= 4 * d, firsts
        assert min(rtts) >= 2 * d, rtts
        # Not delayed twice (loose: the least of several, on a loaded host).
        assert min(firsts) < 6 * d, firsts
        assert min(rtts) < 4 * d, rtts
    _run(main())


# ---- rate ----------------------------------------------------------------------------------------
def test_a_download_takes_at_least_size_over_rate() -> None:
    size, rate, d = 8 * MIB, 100e6 / 8, 0.015

    async def main() -> None:
        async with _relayed(_bulk(size), delay_ms=d * 1e3, rate="100mbit") as relay:
            n, took = await _download(relay)
        assert n == size
        least = 4 * d + size / rate  # handshake, request, and the bytes through the link
        assert least <= took < 1.5 * least, (took, least)
    _run(main())


def test_downloads_share_one_uplink() -> None:
    size, rate = 4 * MIB, 100e6 / 8

    async def main() -> None:
        async with _relayed(_bulk(size), rate="100mbit") as relay:
            t0 = time.monotonic()
            got = await asyncio.gather(_download(relay), _download(relay))
            took = time.monotonic() - t0
        assert [n for n, _ in got] == [size, size]
        assert took >= 2 * size / rate, took  # one link for both
        assert took < 1.5 * 2 * size / rate, took
    _run(main())


def test_uploads_are_capped_per_client_address() -> None:
    size, rate = 8 * MIB, 100e6 / 8
    one = size / rate

    async def main() -> None:
        async with _relayed(_count, rate="100mbit") as relay:
            assert await _upload(relay, size) >= one
            t0 = time.monotonic()
            await asyncio.gather(_upload(relay, size), _upload(relay, size))
            same = time.monotonic() - t0
            t0 = time.monotonic()
            await asyncio.gather(_upload(relay, size), _upload(relay, size, "127.0.0.2"))
            two = time.monotonic() - t0
        assert same >= 2 * one, same  # one node's uploads share its egress
        assert one <= two < 1.5 * one, two  # two nodes' do not share
    _run(main())


# ---- the connection ------------------------------------------------------------------------------
def test_half_closes_pass_both_ways_after_the_data() -> None:
    async def server(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"hello")
        w.write_eof()  # done sending; still reading
        got = await r.read()  # to the client's EOF
        assert got == b"request"
        await asyncio.sleep(0)

    async def main() -> None:
        async with _relayed(server, delay_ms=5) as relay:
            r, w = await _connect(relay)
            assert await r.read() == b"hello"  # and EOF: the server's half-close came through
            w.write(b"request")
            w.write_eof()
            await _until("the relay closed the connection", lambda: not relay.conns)
            w.close()
            await w.wait_closed()
    _run(main())


def test_a_request_half_closed_by_the_client_is_answered() -> None:
    async def main() -> None:
        async with _relayed(_count, delay_ms=5) as relay:
            r, w = await _connect(relay)
            w.write(b"x" * 1000)
            w.write_eof()
            assert await r.read() == b"1000\n"  # then the server's close, as an EOF
            w.close()
            await w.wait_closed()
            await _until("the relay closed the connection", lambda: not relay.conns)
    _run(main())


def test_a_client_that_resets_resets_the_server() -> None:
    ended = asyncio.Event()

    async def server(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:  # streams until the relay's side goes
                w.write(b"y" * 65536)
                await w.drain()
        finally:
            ended.set()

    async def main() -> None:
        async with _relayed(server) as relay:
            r, w = await _connect(relay)
            await r.readexactly(MIB)
            w.transport.abort()  # RST
            await asyncio.wait_for(ended.wait(), 10)
            await _until("the relay closed the connection", lambda: not relay.conns)
    _run(main())


def test_an_upstream_that_is_not_there_closes_the_client() -> None:
    async def main() -> None:
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        relay = Relay(Params(("127.0.0.1", 0), ("127.0.0.1", port), 0.0, parse_rate("1gbit")))
        await relay.start()
        try:
            r, w = await _connect(relay)
            w.write(b"GET")
            with contextlib.suppress(ConnectionResetError):
                assert await asyncio.wait_for(r.read(), 10) == b""
            w.close()
        finally:
            await relay.close()
        assert not relay.conns
    _run(main())


# ---- memory --------------------------------------------------------------------------------------
def test_a_fast_sender_to_a_client_that_does_not_read_is_held_back() -> None:
    window = MIB
    sent = [0]

    async def server(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readexactly(1)
        block = b"z" * 65536
        while sent[0] < 1 << 30:
            w.write(block)
            await w.drain()
            sent[0] += len(block)

    async def main() -> None:
        async with _relayed(server, window=window) as relay:
            _, w = await _connect(relay)
            w.write(b"g")
            # Until the server is stalled: flow control reached it through the relay.
            last = [-1, time.monotonic()]

            def stalled() -> bool:
                if sent[0] != last[0]:
                    last[:] = [sent[0], time.monotonic()]
                return time.monotonic() - last[1] > 0.5
            await _until("the server stalled", stalled, timeout=20)
            assert relay.held_peak <= window + CHUNK
            # The rest is socket buffers, bounded by the kernel: far below what it would send.
            assert sent[0] < 128 * MIB, sent[0]
            w.close()
            await w.wait_closed()
    _run(main())


# ---- shutdown ------------------------------------------------------------------------------------
def test_closing_the_relay_ends_its_connections_and_leaves_nothing() -> None:
    async def main() -> None:
        async with _relayed(_echo, delay_ms=15) as relay:
            r, w = await _connect(relay)
            w.write(b"ping")
            assert await r.readexactly(4) == b"ping"
            idle = await _connect(relay)
            await _until("both connections relayed", lambda: len(relay.conns) == 2)
            await relay.close()
            with contextlib.suppress(ConnectionResetError):
                assert await asyncio.wait_for(r.read(), 10) == b""
            for writer in (w, idle[1]):
                writer.close()
                with contextlib.suppress(ConnectionResetError):
                    await writer.wait_closed()
        # (_relayed checked that no task and no socket is left)
    _run(main())


# ---- the command line ----------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(RELAY), *args], capture_output=True, text=True,
                          timeout=30, check=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_command_line_writes_its_pid_once_listening_and_stops(tmp_path: Path) -> None:
    pidfile = tmp_path / "relay.pid"
    with socket.create_server(("127.0.0.1", 0)) as upstream:
        args = ["--listen", f"127.0.0.1:{_free_port()}",
                "--to", f"127.0.0.1:{upstream.getsockname()[1]}",
                "--delay-ms", "1", "--rate", "1gbit", "--pidfile", str(pidfile)]
        assert _cli("--status", "--pidfile", str(pidfile)).returncode == 3
        proc = subprocess.Popen([sys.executable, str(RELAY), *args], stderr=subprocess.PIPE,
                                text=True)
        try:
            deadline = time.monotonic() + 20
            while (got := _cli("--status", "--pidfile", str(pidfile))).returncode != 0:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.monotonic() < deadline, "the relay did not listen within 20 s"
                time.sleep(0.05)
            assert json.loads(got.stdout) == args
            assert int(pidfile.read_text()) == proc.pid
            # It relays.
            with socket.create_connection(("127.0.0.1", int(args[1].split(":")[1])), 10) as c:
                conn, _ = upstream.accept()
                with conn:
                    c.sendall(b"hi")
                    conn.settimeout(10)
                    assert conn.recv(2) == b"hi"
            assert _cli("--stop", "--pidfile", str(pidfile)).returncode == 0
            assert proc.wait(10) == 0  # SIGTERM: a clean exit
            assert not pidfile.exists()
            assert _cli("--status", "--pidfile", str(pidfile)).returncode == 3
            assert _cli("--stop", "--pidfile", str(pidfile)).returncode == 0  # idempotent
        finally:
            proc.kill()
            proc.wait()
            if proc.stderr:
                proc.stderr.close()


def test_a_pid_file_naming_another_process_is_not_a_relay(tmp_path: Path) -> None:
    pidfile = tmp_path / "relay.pid"
    pidfile.write_text(f"{os.getpid()}\n")  # this pytest: alive, not a relay
    assert _cli("--status", "--pidfile", str(pidfile)).returncode == 3
    assert _cli("--stop", "--pidfile", str(pidfile)).returncode == 0  # and it is not killed
    assert not pidfile.exists()


@pytest.mark.parametrize(("args", "says"), [
    (["--rate", "fast"], "rate 'fast'"),
    (["--to", "s3"], "address 's3'"),
    (["--delay-ms", "-1"], "not negative"),
    (["--status"], "--pidfile"),
])
def test_bad_arguments_are_refused_with_what_is_wrong(args: list[str], says: str) -> None:
    got = _cli(*args)
    assert got.returncode == 2
    assert says in got.stderr
