"""A rank's coordinator calls while a local user floods the coordinator's admission.

The coordinator at its real limits (`coordsrv`: 4096 connections, 16 handshakes per source,
5 s handshake); a flooder process holds connections from many loopback addresses (default
256 x 16, the hostile review's flood), opening a new one the moment one ends, as fast as it
can. A rank (this process) pings the coordinator over and over; its latency, p50 and max, is
printed quiet and under the flood, with the ratio, for a rank

* on another host (its source is this host's address given as ``--rank-from``, one of the
  allocation's; the flood's is loopback; its socket is hidden from the servers' owner lookup,
  as a remote client's is not in this host's tables), and
* on the flooder's own host (its source is loopback too: what a user sharing the node gets).

The flooder is a child process forked from this one; with ``--flood-uid N`` (as root) it
becomes user N first, as another user sharing the node would be (the servers tell this host's
users apart by their sockets' owner, `peeruid`); without, it is this process's user, the job's
own, whose connections count with the rank's.

    python benchmarks/coord_flood.py --rank-from 192.0.2.2 [--flood-uid 65534]
        [--addresses 256] [--each 16]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import selectors
import signal
import socket
import statistics
import sys
import time

from gpuwarden.ckpt.coordnet import CoordIOError, NetCoordinator
from gpuwarden.ckpt.coordsrv import CoordServer
from gpuwarden.ckpt.peerauth import Owner
from gpuwarden.ckpt.peeruid import local_uid

KEY, JOB = b"k" * 32, "job-1"


def flood(port: int, addresses: int, each: int, seconds: float) -> None:
    """The flooder: ``addresses`` x ``each`` connections that send nothing, each replaced
    as soon as the server drops or refuses it."""
    sel = selectors.DefaultSelector()
    sources = [f"127.{1 + i // 62500}.{i // 250 % 250}.{2 + i % 250}" for i in range(addresses)]

    def open_one(src: str) -> None:
        s = socket.socket()
        s.setblocking(False)
        s.bind((src, 0))
        with contextlib.suppress(BlockingIOError):  # connecting: selected once it ends
            s.connect(("127.0.0.1", port))
        sel.register(s, selectors.EVENT_READ, src)
    for src in sources:
        for _ in range(each):
            open_one(src)
    opened, end = addresses * each, time.monotonic() + seconds
    while time.monotonic() < end:
        for key, _ in sel.select(0.5):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            try:
                gone = s.recv(4096) == b""
            except OSError:
                gone = True
            if gone:
                sel.unregister(s)
                s.close()
                open_one(key.data)
                opened += 1
    print(f"flooder: {opened} connections opened", file=sys.stderr)


def fork_flooder(port: int, addresses: int, each: int, uid: int | None) -> int:
    """The flooder's pid: a child of this process, user ``uid``'s when given."""
    pid = os.fork()
    if pid == 0:
        try:
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            flood(port, addresses, each, 600.0)
        finally:
            os._exit(0)
    return pid


def hiding(address: str, owner: Owner) -> Owner:
    """``owner``, but a connection from ``address`` is a remote client's: the "other host"
    rank is this host's too, and its socket must not be found."""
    def hidden(ca: str, cp: int, sa: str, sp: int, family: int, timeout: float) -> int | None:
        return None if ca == address else owner(ca, cp, sa, sp, family, timeout)
    return hidden


def latencies(addr: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        c = NetCoordinator(addr, KEY, JOB, 0, 1, op_timeout_s=10.0)  # coordnet.OP_S
        t = time.monotonic()
        try:
            c.ping()
            out.append(time.monotonic() - t)
        except CoordIOError:
            out.append(float("inf"))
        time.sleep(0.05)
    return out


def show(name: str, quiet: list[float], busy: list[float]) -> None:
    q, b = statistics.median(quiet), statistics.median(busy)
    print(f"{name}: quiet p50 {q * 1e3:.1f} ms max {max(quiet) * 1e3:.1f} ms; flood p50 "
          f"{b * 1e3:.1f} ms max {max(busy) * 1e3:.1f} ms; p50 ratio {b / q:.1f}x, max ratio "
          f"{max(busy) / max(quiet):.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank-from", required=True, help="a non-loopback address of this host")
    ap.add_argument("--addresses", type=int, default=256)
    ap.add_argument("--each", type=int, default=16)
    ap.add_argument("--pings", type=int, default=20)
    ap.add_argument("--flood-uid", type=int, default=None,
                    help="the flooder's user (needs root): another user sharing the node")
    a = ap.parse_args()
    if a.flood_uid is not None and os.geteuid() != 0:
        ap.error("--flood-uid needs root (the flooder's process becomes that user)")
    srv = CoordServer(KEY, JOB, hosts=[a.rank_from])
    srv._srv.owner = hiding(a.rank_from, local_uid)  # before any connection comes
    other, same = f"{a.rank_from}:{srv.port}", f"127.0.0.1:{srv.port}"
    try:
        quiet = {k: latencies(addr, a.pings) for k, addr in (("other", other), ("same", same))}
        pid = fork_flooder(srv.port, a.addresses, a.each, a.flood_uid)
        try:
            time.sleep(10.0)  # the flood at its height: every handshake slot it can get taken
            busy = {k: latencies(addr, a.pings) for k, addr in (("other", other), ("same", same))}
        finally:
            os.kill(pid, signal.SIGTERM)
            os.waitpid(pid, 0)
    finally:
        srv.stop()
    who = "the job's own user" if a.flood_uid is None else f"user {a.flood_uid}"
    print(f"flood: {a.addresses} loopback addresses x {a.each} connections, as {who}")
    show("rank on another host", quiet["other"], busy["other"])
    show("rank on the flooder's host", quiet["same"], busy["same"])


if __name__ == "__main__":
    main()
