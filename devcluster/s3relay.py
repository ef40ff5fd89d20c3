"""A TCP relay that shapes what it carries like a remote link: run with the image's python3 in
the test cluster's s3 container, in front of SeaweedFS's S3 port (devcluster/s3shape.py starts
it and redirects the nodes' connections to it). Standard library only: it runs outside the
venv, from the bind-mounted source tree.

    python3 s3relay.py --listen 8334 --to 127.0.0.1:8333 --delay-ms 15 --rate 1gbit \\
        --pidfile /run/gpuwarden-s3relay.pid
    python3 s3relay.py --status --pidfile /run/gpuwarden-s3relay.pid   # its arguments, or exit 3
    python3 s3relay.py --stop --pidfile /run/gpuwarden-s3relay.pid     # idempotent

Why: the kernels it runs on have no `sch_netem` (nor prio, fq), so `tc` cannot delay packets.

What it models, per direction of each connection, on every chunk it reads:

* A link of ``rate`` bytes/s followed by ``delay`` of propagation: a chunk enters the link when
  it is read or when the link is free, whichever is later, takes len/rate to go through, and is
  written out ``delay`` after that. Downloads (S3 to the clients) share one link, one uplink for
  every node; uploads get one link per client address, each node's own egress.
* The TCP handshake's round trip: a connection's first bytes are held as if the handshake had
  crossed the delayed link (the client's sent no earlier than 2 x delay after the accept, the
  server's no earlier than 3 x delay), so a request on a new connection pays the extra round
  trip it pays on a real remote link.
* Half-close and close: an EOF is passed on, ``delay`` later, after everything read before it;
  a reset or error on either side aborts both.
* Flow control: at most WINDOW bytes (4 MiB, above a 15 ms x 1 Gbit/s link's bandwidth-delay
  product) are held per direction of a connection; past that it stops reading, and TCP slows
  the sender. Memory stays bounded whatever the sender does.

What it does not model: TCP over the delayed path. Each leg (client to relay, relay to S3) is a
LAN or loopback connection, so slow start, congestion windows and their ramp-up over a 30 ms
round trip, loss and retransmission are not reproduced: a new connection gets the full rate
at once (a real one would ramp up over a few round trips). Queueing is one FIFO per link with
no drops: many busy connections queue up to WINDOW each (bufferbloat, not a router's AQM).
docs/test-cluster.md, "A remote-shaped S3".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("s3relay")

CHUNK = 256 * 1024  # bytes per read: 2 ms at 1 Gbit/s
WINDOW = 4 * 1024 * 1024  # bytes held per direction of a connection (flow control)
CONNECT_S = 10.0  # deadline to reach the upstream
CLOSE_S = 10.0  # for a closed connection's last bytes to go out
STOP_S = 10.0  # --stop: how long SIGTERM gets before SIGKILL
NOT_RUNNING = 3  # --status's exit when none runs (LSB's "program is not running")
_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}  # tc's: SI, bits per second
_RATE_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)(kbit|mbit|gbit)")


def parse_rate(text: str) -> float:
    """tc's notation ("1gbit", "500mbit", "64kbit") as bytes per second."""
    m = _RATE_RE.fullmatch(text.strip())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"rate {text!r}: a positive number of kbit, mbit or gbit, e.g. 1gbit")
    return float(m.group(1)) * _UNITS[m.group(2)] / 8


def parse_address(text: str) -> tuple[str, int]:
    """"HOST:PORT" or "PORT" (all addresses)."""
    host, sep, port = text.rpartition(":")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"address {text!r}: [HOST:]PORT")
    return (host if sep else "0.0.0.0"), int(port)  # noqa: S104  # listening on the network is the point


@dataclass(frozen=True)
class Params:
    listen: tuple[str, int]
    to: tuple[str, int]
    delay: float  # seconds, one way
    rate: float  # bytes per second, each link
    window: int = WINDOW


class Link:
    """One serializer of ``rate`` bytes/s: when a chunk handed in at ``at`` is through."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.free = 0.0  # when the link has sent everything handed to it so far

    def send(self, at: float, size: int) -> float:
        self.free = max(at, self.free) + size / self.rate
        return self.free


class _Pipe:
    """One direction of one connection: reads, stamps each chunk with its release time, writes
    it out then."""

    def __init__(self, relay: Relay, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 link: Link, not_before: float) -> None:
        self.relay = relay
        self.reader = reader
        self.writer = writer
        self.link = link
        self.not_before = not_before
        self.queue: deque[tuple[float, bytes]] = deque()  # (release time, data); b"": EOF
        self.held = 0  # bytes read and not yet written
        self.last = 0.0  # the latest release time stamped: an EOF never overtakes data
        self.queued = asyncio.Event()
        self.room = asyncio.Event()

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._read())
            tg.create_task(self._write())

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while self.held >= self.relay.params.window:
                self.room.clear()
                await self.room.wait()
            data = await self.reader.read(CHUNK)
            at = max(loop.time(), self.not_before)
            through = self.link.send(at, len(data)) if data else at
            self.last = max(self.last, through + self.relay.params.delay)
            self.queue.append((self.last, data))
            self.held += len(data)
            self.relay.held_peak = max(self.relay.held_peak, self.held)
            self.queued.set()
            if not data:
                return

    async def _write(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self.queued.clear()
                await self.queued.wait()
            wait = self.queue[0][0] - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
                continue  # the head's time again: a timer may fire a hair early
            now = loop.time()
            batch: list[bytes] = []
            eof = False
            while self.queue and self.queue[0][0] <= now:
                _, data = self.queue.popleft()
                if not data:
                    eof = True
                    break
                batch.append(data)
            if batch:
                for data in batch:  # not writelines(): 3.12's and 3.13.0's never pause for drain()
                    self.writer.write(data)
                await self.writer.drain()
                self.held -= sum(map(len, batch))
                self.room.set()
            if eof:
                if self.writer.can_write_eof():
                    self.writer.write_eof()
                return


class Relay:
    """The listening relay; ``start`` binds, ``close`` ends every connection and waits for
    its tasks."""

    def __init__(self, params: Params) -> None:
        self.params = params
        self.down = Link(params.rate)  # one uplink, shared by every client
        self.up: dict[str, Link] = {}  # one per client address
        self.conns: set[asyncio.Task[None]] = set()
        self.held_peak = 0  # the most bytes one direction of a connection held (tests)
        self._server: asyncio.Server | None = None
        self._closing = False

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("relay not started")
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        host, port = self.params.listen
        self._server = await asyncio.start_server(self._accept, host, port, limit=2 * CHUNK)

    async def close(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        for task in list(self.conns):
            task.cancel()
        if self.conns:
            await asyncio.gather(*self.conns, return_exceptions=True)
        # After the connections: from Python 3.12 on this waits for every client to be gone.
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is None or self._closing:  # accepted as the relay closed
            c_writer.transport.abort()
            return
        self.conns.add(task)
        try:
            await self._serve(c_reader, c_writer)
        except asyncio.CancelledError:
            pass  # by close(); a cancelled connection task is logged as an error by 3.11's streams
        finally:
            self.conns.discard(task)

    async def _serve(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        accepted = asyncio.get_running_loop().time()
        peer = c_writer.get_extra_info("peername")
        client = str(peer[0]) if peer else "?"
        d = self.params.delay
        u_writer: asyncio.StreamWriter | None = None
        clean = False
        try:
            try:
                u_reader, upstream = await asyncio.wait_for(
                    asyncio.open_connection(*self.params.to, limit=2 * CHUNK), CONNECT_S)
            except (OSError, TimeoutError) as exc:
                log.warning("%s: cannot reach %s:%d: %s", client, *self.params.to, exc)
                return
            u_writer = upstream
            up = _Pipe(self, c_reader, upstream, self.up.setdefault(client, Link(self.params.rate)),
                       accepted + 2 * d)
            down = _Pipe(self, u_reader, c_writer, self.down, accepted + 3 * d)
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(up.run())
                    tg.create_task(down.run())
                clean = True
            except* (OSError, RuntimeError) as group:  # a reset, a write to a closed side
                log.info("%s: connection ended: %s", client, _first(group))
        finally:
            writers = [w for w in (c_writer, u_writer) if w is not None]
            for w in writers:
                if clean:
                    w.close()  # after what is left in its buffer
                else:
                    w.transport.abort()
            try:
                async with asyncio.timeout(CLOSE_S):
                    for w in writers:
                        with contextlib.suppress(OSError):
                            await w.wait_closed()
            except TimeoutError:  # a peer that does not read the rest: cut off
                for w in writers:
                    w.transport.abort()
            except asyncio.CancelledError:  # close()
                for w in writers:
                    w.transport.abort()
                raise


def _first(exc: BaseException) -> BaseException:
    """The first error in nested task groups' exception groups."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


# ---- the process ----------------------------------------------------------------------------
def _cmdline(pid: int) -> list[str] | None:
    """A live process's argv, or None (gone, or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    if stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X"):
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]]


def _pid_in(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def running(pidfile: Path) -> tuple[int, list[str]] | None:
    """The relay the pid file names, if it runs: its pid and the arguments after the script."""
    pid = _pid_in(pidfile)
    argv = None if pid is None else _cmdline(pid)
    if pid is None or argv is None:
        return None
    if argv is None:
        return None
    for i, arg in enumerate(argv):
        if Path(arg).name == "s3relay.py":  # not a process that took a dead relay's pid
            return pid, argv[i + 1:]
    return None


def stop(pidfile: Path, timeout: float = STOP_S) -> bool:
    """SIGTERM to the relay the pid file names (SIGKILL after ``timeout``), the pid file
    removed. False when none ran."""
    got = running(pidfile)
    if got is not None:
        pid = got[0]
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _cmdline(pid) is not None:
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.05)
    pidfile.unlink(missing_ok=True)
    return got is not None


async def serve(params: Params, pidfile: Path | None) -> None:
    relay = Relay(params)
    await relay.start()
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    if pidfile is not None:  # written once listening: it is what `--status` waits for
        tmp = pidfile.with_name(pidfile.name + ".tmp")
        tmp.write_text(f"{os.getpid()}\n")
        tmp.replace(pidfile)
    log.info("listening on %s:%d, to %s:%d, %g ms each way, %g Mbit/s", params.listen[0],
             relay.port, *params.to, params.delay * 1e3, params.rate * 8 / 1e6)
    try:
        await done.wait()
    finally:
        await relay.close()
        if pidfile is not None and _pid_in(pidfile) == os.getpid():
            pidfile.unlink(missing_ok=True)
        log.info("stopped")


def _args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="s3relay.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", default="8334", help="[HOST:]PORT to listen on (8334)")
    p.add_argument("--to", default="127.0.0.1:8333", help="HOST:PORT to relay to")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each way")
    p.add_argument("--rate", default="10gbit", help="each link's rate, tc's notation (1gbit)")
    p.add_argument("--pidfile", type=Path, help="written once listening")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--status", action="store_true",
                      help=f"print the running relay's arguments (JSON); exit {NOT_RUNNING} if "
                      "none runs")
    mode.add_argument("--stop", action="store_true", help="stop the running relay, if any")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _args(sys.argv[1:] if argv is None else argv)
    if args.status or args.stop:
        if args.pidfile is None:
            print("s3relay: --status and --stop need --pidfile", file=sys.stderr)
            return 2
        if args.stop:
            stop(args.pidfile)
            return 0
        got = running(args.pidfile)
        if got is None:
            print("s3relay: not running", file=sys.stderr)
            return NOT_RUNNING
        print(json.dumps(got[1]))
        return 0
    try:
        if args.delay_ms < 0:
            raise ValueError(f"delay {args.delay_ms:g} ms: not negative")
        params = Params(listen=parse_address(args.listen), to=parse_address(args.to),
                        delay=args.delay_ms / 1e3, rate=parse_rate(args.rate))
    except ValueError as exc:
        print(f"s3relay: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s s3relay: %(message)s")
    asyncio.run(serve(params, args.pidfile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
