"""The test cluster's S3 link shaped like a remote object store's: a user-space relay in the s3
container (devcluster/s3relay.py) with an nftables redirect in front of SeaweedFS's S3 port.

Why not `tc netem`: the kernels the cluster runs on (the development host's, CI's) are built
without `sch_netem` (nor prio, fq), so no qdisc can delay packets. nftables' NAT is there.

``shape`` starts the relay in the s3 container (detached, its pid in PIDFILE), waits until it
listens, then redirects new TCP connections that arrive from the network to port 8333 to the
relay's port; the relay's own connection to 127.0.0.1:8333 is local and not redirected.
Downloads share one uplink (the relay's one download link); uploads are capped per client
address (each node's own egress); node-to-node traffic never goes near it. ``unshape`` removes
the redirect, then stops the relay (connections it carried end; boto3 reconnects). Both are
idempotent; ``shape`` with other parameters replaces the relay, with the same ones leaves the
running relay (and its connections) alone. Nothing runs on the nodes or the host: only the s3
container needs NET_ADMIN (for nft). docs/test-cluster.md, "A remote-shaped S3".
"""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass

from devcluster.cluster import SRC
from devcluster.s3relay import NOT_RUNNING, parse_rate

HOST = "s3"  # the container the relay runs in
S3_PORT = 8333
RELAY_PORT = 8334
RELAY = f"{SRC}/devcluster/s3relay.py"
PYTHON = "python3"  # the image's: the relay needs nothing else
PIDFILE = "/run/gpuwarden-s3relay.pid"
LOG = "/var/log/gpuwarden-s3relay.log"
TABLE = "gpuwarden_s3relay"  # the nft table: the redirect and nothing else
START_S = 15.0  # deadline for the relay to listen
_DELAY_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)ms")


class ShapeError(Exception):
    pass


@dataclass(frozen=True)
class Shape:
    """One way's delay and rate ("15ms", "1gbit")."""

    delay: str
    rate: str

    def __post_init__(self) -> None:
        if not _DELAY_RE.fullmatch(self.delay):
            raise ShapeError(f"delay {self.delay!r}: milliseconds, e.g. 15ms")
        try:
            parse_rate(self.rate)
        except ValueError:
            raise ShapeError(f"rate {self.rate!r}: e.g. 1gbit, 500mbit") from None

    @classmethod
    def parse(cls, text: str) -> Shape:
        """"15ms,1gbit" (a benchmark's --shape)."""
        delay, _, rate = text.partition(",")
        return cls(delay.strip(), rate.strip())

    @property
    def delay_ms(self) -> str:
        return self.delay.removesuffix("ms")


def relay_args(how: Shape) -> list[str]:
    """The relay's arguments, as `s3relay.py --status` prints them back."""
    return ["--listen", str(RELAY_PORT), "--to", f"127.0.0.1:{S3_PORT}",
            "--delay-ms", how.delay_ms, "--rate", how.rate, "--pidfile", PIDFILE]


def start_command(how: Shape) -> list[str]:
    """Detached from the exec (its own session, no tie to the exec's output), logging to LOG."""
    relay = shlex.join([PYTHON, RELAY, *relay_args(how)])
    return ["bash", "-c", f"setsid {relay} </dev/null >>{LOG} 2>&1 &"]


def status_command() -> list[str]:
    return [PYTHON, RELAY, "--status", "--pidfile", PIDFILE]


def stop_command() -> list[str]:
    return [PYTHON, RELAY, "--stop", "--pidfile", PIDFILE]


# One nft transaction each: "add table" first makes the delete succeed when there is none, so
# both are idempotent and the rule is replaced atomically.
def redirect_command() -> list[str]:
    return ["nft", f"add table ip {TABLE}; delete table ip {TABLE}; add table ip {TABLE}; "
            f"add chain ip {TABLE} prerouting {{ type nat hook prerouting priority dstnat; "
            f"policy accept; }}; add rule ip {TABLE} prerouting iifname != \"lo\" "
            f"tcp dport {S3_PORT} redirect to :{RELAY_PORT}"]


def unredirect_command() -> list[str]:
    return ["nft", f"add table ip {TABLE}; delete table ip {TABLE}"]


Run = Callable[[str, list[str]], tuple[int, str]]  # (host, argv) -> (rc, output)


def _do(run: Run, argv: list[str]) -> str:
    rc, out = run(HOST, argv)
    if rc != 0:
        raise ShapeError(f"container {HOST}: `{shlex.join(argv)}` failed (exit {rc}): "
                         f"{out.strip()}")
    return out


def running(run: Run) -> list[str] | None:
    """The running relay's arguments, or None."""
    rc, out = run(HOST, status_command())
    if rc == NOT_RUNNING:
        return None
    lines = out.strip().splitlines()
    try:
        if rc != 0:
            raise ValueError(f"exit {rc}")
        got = json.loads(lines[-1])
    except (ValueError, IndexError) as exc:
        raise ShapeError(f"container {HOST}: `{shlex.join(status_command())}`: {exc}: "
                         f"{out.strip()}") from None
    return [str(a) for a in got]


def shape(run: Run, how: Shape, *, deadline_s: float = START_S, poll_s: float = 0.2,
          clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> None:
    """The relay running with ``how`` and new connections to the S3 port redirected to it."""
    want = relay_args(how)
    if running(run) != want:
        _do(run, stop_command())
        _do(run, start_command(how))
        deadline = clock() + deadline_s
        while running(run) != want:
            if clock() > deadline:
                _, tail = run(HOST, ["tail", "-n", "15", LOG])
                raise ShapeError(f"container {HOST}: the S3 relay did not listen on port "
                                 f"{RELAY_PORT} within {deadline_s:g} s of "
                                 f"`{shlex.join(start_command(how))}`; {LOG}:\n{tail.strip()}")
            sleep(poll_s)
    _do(run, redirect_command())


def unshape(run: Run) -> None:
    """No redirect, no relay (either or both already gone is fine)."""
    _do(run, unredirect_command())
    _do(run, stop_command())
