"""Which local user owns the other end of an accepted TCP connection (Linux ``sock_diag``).

Before a client has shown the job's key the servers (`peer`, `coordsrv`) know only its address,
and every user of a host shares that host's addresses: a user flooding from a rank's own node
took every slot that node's source freed. The kernel knows better: the client's socket, when it
is on this host, is in this network namespace's TCP tables, and ``NETLINK_SOCK_DIAG`` finds it
by its exact 4-tuple (``SOCK_DIAG_BY_FAMILY``, no dump) and reports its owner's uid. Any user
may ask (``ss -e`` shows other users' uids without root); one lookup is one small request and
one reply.

`local_uid` never raises: None when the client's socket is not this host's (a remote client),
has no owner any more (closed: a time-wait or orphaned socket reports uid 0 and no inode), or
netlink cannot answer in time. The message building and parsing (`request`, `parse_reply`) are
pure.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import struct

log = logging.getLogger(__name__)

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLMSG_ERROR = 2
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
TCP_LISTEN = 10
ALL_STATES = 0xFFFFFFFF
TIMEOUT_S = 0.05  # a local kernel answers in microseconds; the accept loop must not wait long

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid (host order)
# inet_diag_req_v2: family, protocol, ext, pad, states; then inet_diag_sockid
_REQ = struct.Struct("=BBBxI")
# inet_diag_sockid: sport, dport (network order), src[16], dst[16], if, cookie[2]
_SOCKID = struct.Struct("!HH16s16s")
_SOCKID_TAIL = struct.Struct("=III")
# inet_diag_msg: family, state, timer, retrans; sockid; expires, rqueue, wqueue, uid, inode
_MSG_HEAD = struct.Struct("=BBBB")
_MSG_TAIL = struct.Struct("=IIIII")
_SOCKID_LEN = _SOCKID.size + _SOCKID_TAIL.size
_MSG_LEN = _MSG_HEAD.size + _SOCKID_LEN + _MSG_TAIL.size


def _packed(address: str, family: int) -> bytes:
    """``address`` as the 16 bytes of a sockid (an IPv4 one in the first 4)."""
    ip = ipaddress.ip_address(address.partition("%")[0])
    if family == socket.AF_INET:
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if not isinstance(ip, ipaddress.IPv4Address):
            raise ValueError(f"{address}: not an IPv4 address")
        return ip.packed.ljust(16, b"\0")
    if isinstance(ip, ipaddress.IPv4Address):  # an AF_INET6 socket's peer, v4-mapped
        ip = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + ip.packed)
    return ip.packed


def _same(a: bytes, b: bytes, fa: int, fb: int) -> bool:
    """Two sockid addresses (of families ``fa``/``fb``) the same host address, a v4-mapped
    one equal to its IPv4 form."""
    def norm(raw: bytes, fam: int) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        if fam == socket.AF_INET:
            return ipaddress.IPv4Address(raw[:4])
        ip6 = ipaddress.IPv6Address(raw)
        return ip6.ipv4_mapped or ip6
    return norm(a, fa) == norm(b, fb)


def request(client_addr: str, client_port: int, server_addr: str, server_port: int,
            family: int, seq: int) -> bytes:
    """The netlink message asking for the client's socket, the one whose local end is
    ``client_addr:client_port`` and remote end ``server_addr:server_port``. ValueError when
    an address is not one of ``family``'s."""
    sockid = (_SOCKID.pack(client_port, server_port, _packed(client_addr, family),
                           _packed(server_addr, family))
              + _SOCKID_TAIL.pack(0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE))
    body = _REQ.pack(family, socket.IPPROTO_TCP, 0, ALL_STATES) + sockid
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST,
                          seq, 0) + body


def parse_reply(data: bytes, asked: bytes) -> int | None:
    """The owner's uid from the kernel's reply ``data`` to the request ``asked``; None when the
    reply says there is no such socket with an owner (not found, a listener, closed), or is
    not the reply to ``asked``."""
    _, _, _, seq_asked, _ = _NLMSGHDR.unpack_from(asked)
    if len(data) < _NLMSGHDR.size:
        return None
    length, kind, _, seq, _ = _NLMSGHDR.unpack_from(data)
    if seq != seq_asked or length > len(data):
        return None
    if kind == NLMSG_ERROR or kind != SOCK_DIAG_BY_FAMILY or length < _NLMSGHDR.size + _MSG_LEN:
        return None  # ENOENT: not a socket of this host's (a remote client)
    at = _NLMSGHDR.size
    family, state, _, _ = _MSG_HEAD.unpack_from(data, at)
    sport, dport, src, dst = _SOCKID.unpack_from(data, at + _MSG_HEAD.size)
    *_, uid, inode = _MSG_TAIL.unpack_from(data, at + _MSG_HEAD.size + _SOCKID_LEN)
    a = _NLMSGHDR.size + _REQ.size
    a_family = asked[_NLMSGHDR.size]
    a_sport, a_dport, a_src, a_dst = _SOCKID.unpack_from(asked, a)
    # A lookup that misses the connection may find a listener on the client's address and
    # port instead: only the connection itself, with both ends as asked, says who made it.
    if (state == TCP_LISTEN or (sport, dport) != (a_sport, a_dport)
            or not _same(src, a_src, family, a_family) or not _same(dst, a_dst, family, a_family)):
        return None
    # No inode: a closed socket (time-wait, orphaned), whose uid is the kernel's 0, not its
    # maker's.
    return uid if inode else None


def local_uid(client_addr: str, client_port: int, server_addr: str, server_port: int,
              family: int, timeout: float = TIMEOUT_S) -> int | None:
    """The uid owning the client's socket of a connection accepted by a server socket of
    ``family``, when that socket is this host's (in this network namespace); None when it is
    not (a remote client), is closed, or netlink cannot say within ``timeout`` s. Never
    raises."""
    try:
        asked = request(client_addr, client_port, server_addr, server_port, family, 1)
    except (ValueError, struct.error):
        return None
    try:
        # A socket of its own per lookup: one request, one reply, nothing stale to read.
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(timeout)
            nl.sendto(asked, (0, 0))
            return parse_reply(nl.recv(8192), asked)
    except (OSError, struct.error) as exc:  # no netlink (not Linux, a sandbox), or too slow
        log.debug("sock_diag: %s", exc)
        return None


def server_uid() -> int:
    """The uid the servers count as the job's own: this process's."""
    return os.geteuid()
