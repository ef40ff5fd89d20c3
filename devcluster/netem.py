"""The test cluster's S3 link shaped like a remote object store's (`tc netem`), from inside the
containers (they have NET_ADMIN: `Cluster._run`), never on the host.

Downloads (S3 to the nodes) share one uplink: the s3 container's egress is delayed and capped.
Uploads get the same on each node, for traffic to the s3 address only: peers, the job's
coordinator and Slurm between nodes are not shaped. SeaweedFS's own hops stay on the s3
container's loopback. The device is the one the route to the peer leaves by (`ip route get`),
not assumed. docs/test-cluster.md, "A remote-shaped S3".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# netem's default queue (1000 packets) is below a 15 ms x 1 Gbit/s link's bandwidth-delay
# product (1.9 MB, ~1250 full packets): it would drop. 20000 leaves room.
QUEUE = 20_000
_DELAY_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)ms")
_RATE_RE = re.compile(r"[0-9]+(?:\.[0-9]+)?(?:kbit|mbit|gbit)")
_DEV_RE = re.compile(r"\bdev (\S+)")


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
        if not _RATE_RE.fullmatch(self.rate):
            raise ShapeError(f"rate {self.rate!r}: e.g. 1gbit, 500mbit")

    @classmethod
    def parse(cls, text: str) -> Shape:
        """"15ms,1gbit" (a benchmark's --shape)."""
        delay, _, rate = text.partition(",")
        return cls(delay.strip(), rate.strip())

    def netem(self) -> list[str]:
        return ["netem", "delay", self.delay, "rate", self.rate, "limit", str(QUEUE)]


def device(route: str) -> str:
    """The device of `ip -o route get ADDR`'s answer."""
    m = _DEV_RE.search(route)
    if not m:
        raise ShapeError(f"no device in the route {route.strip()!r}")
    return m.group(1)


def s3_commands(dev: str, shape: Shape) -> list[list[str]]:
    """In the s3 container: everything it sends (downloads, shared by every node)."""
    return [["tc", "qdisc", "replace", "dev", dev, "root", *shape.netem()]]


def node_commands(dev: str, s3_addr: str, shape: Shape) -> list[list[str]]:
    """On a node: only what it sends to ``s3_addr`` (uploads); the rest in an unshaped band."""
    return [
        ["tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "prio", "bands", "3",
         "priomap", *["1"] * 16],
        ["tc", "qdisc", "replace", "dev", dev, "parent", "1:3", "handle", "30:", *shape.netem()],
        ["tc", "filter", "replace", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
         "u32", "match", "ip", "dst", f"{s3_addr}/32", "flowid", "1:3"],
    ]


def clear_command(dev: str) -> list[str]:
    return ["tc", "qdisc", "del", "dev", dev, "root"]


Run = Callable[[str, list[str]], tuple[int, str]]  # (host, argv) -> (rc, output)


def _dev(run: Run, host: str, peer: str) -> str:
    rc, out = run(host, ["ip", "-o", "route", "get", peer])
    if rc != 0:
        raise ShapeError(f"{host}: ip route get {peer}: {out.strip()}")
    return device(out)


def _do(run: Run, host: str, argv: list[str]) -> None:
    rc, out = run(host, argv)
    if rc != 0:
        hint = (" (modprobe sch_netem on the docker host)" if "netem" in argv
                and ("No such file" in out or "Unknown qdisc" in out) else "")
        raise ShapeError(f"{host}: {' '.join(argv)}: {out.strip()}{hint}")


def shape(run: Run, s3_addr: str, nodes: Sequence[tuple[str, str]], how: Shape) -> None:
    """Shape the s3 container's egress and each node's egress to ``s3_addr``; ``nodes``:
    (host, address) pairs."""
    if not nodes:
        raise ShapeError("no nodes to shape")
    s3_dev = _dev(run, "s3", nodes[0][1])
    for argv in s3_commands(s3_dev, how):
        _do(run, "s3", argv)
    for host, _ in nodes:
        dev = _dev(run, host, s3_addr)
        for argv in node_commands(dev, s3_addr, how):
            _do(run, host, argv)


def unshape(run: Run, s3_addr: str, nodes: Sequence[tuple[str, str]]) -> None:
    """Every shaping removed (a device without any is left as it is)."""
    targets = [("s3", nodes[0][1])] if nodes else []
    targets += [(host, s3_addr) for host, _ in nodes]
    for host, peer in targets:
        dev = _dev(run, host, peer)
        rc, out = run(host, clear_command(dev))
        if rc != 0 and "No such file" not in out and "Cannot delete qdisc with handle of zero" \
                not in out:
            raise ShapeError(f"{host}: {' '.join(clear_command(dev))}: {out.strip()}")
