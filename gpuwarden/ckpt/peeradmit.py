"""The peer server's and the coordinator's connection limits: no stranger may hold every slot.

Until a connection has shown the job's key it is a stranger's, counted against its *source*.
A connection from this host counts against the user owning its client socket (`peeruid`, the
kernel's word): the server's own user's are the job's, any other user's a stranger's, each
user one source. Every other connection counts against its address: all of loopback (127/8,
``::1`` and their IPv4-mapped forms) is one source, since a local user can bind to any of 16M
loopback addresses; an IPv4-mapped IPv6 address is its IPv4 address.

* ``total`` connections at once, in the handshake or not;
* ``per_source`` from one source still in the handshake;
* ``strangers`` at once in the handshake from sources outside the job's own hosts (the
  allocation's nodes, resolved, and this host's loopback): well below ``total``, so that
  strangers from elsewhere can never take the slots the job's ranks need.

A connection that has shown the key no longer counts against its source or the strangers'
budget. A source at ``per_source`` whose oldest handshake is ``EVICT_AFTER_S`` old gives that
slot up to its next connection (a rank's handshake takes milliseconds). A user sharing a
node with a rank and opening connections as fast as it can takes only its own source's slots,
not the rank's: its socket's owner is another. Only where the owner cannot be learnt (no
netlink, or a client gone before it was asked) do a host's users share its address's source
again, as every user of another host does (docs/design/object-store-sites.md, the progress
note). Where the job's hosts are not known
(no ``SLURM_JOB_NODELIST``, or not resolved yet) its ranks share the strangers' budget, still
``per_source`` each.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from gpuwarden.slurm import hostlist, jobenv

log = logging.getLogger(__name__)

REFUSAL_LOG_S = 10.0  # at most one refusal line per source this often: attacks flood logs
_MAX_LOGGED = 4096  # sources remembered for that; forgotten all at once beyond
LOOPBACK = "loopback"  # the one source all of this host's loopback addresses count as
_USER = "local uid "  # a source of this host's, by its socket's owner: never an address
STRANGERS_SHARE = 4  # strangers' handshakes: at most a quarter of all connections
FIRST_SHARE = 4  # the first frame within a quarter of the handshake deadline
EVICT_AFTER_S = 1.0  # a handshake this old gives its source's slot up to a new connection
_MAX_HOSTS = 1 << 17  # allocation names resolved at most

Resolve = Callable[[str], Iterable[str]]


def source_of(address: str) -> str:
    """What a connection from ``address`` counts against: ``LOOPBACK`` for any loopback
    address, the IPv4 address for an IPv4-mapped one, else the address in its canonical form
    (a scope ``%eth0`` dropped). A string that is no address is its own source. Pure."""
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return LOOPBACK if ip.is_loopback else str(ip)


def local_source(uid: int) -> str:
    """The source of the connections from this host whose client sockets ``uid`` owns."""
    return f"{_USER}{uid}"


def addresses_of(name: str) -> list[str]:
    """The addresses ``name`` resolves to (getaddrinfo), none when it does not."""
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    return [str(info[4][0]) for info in infos]


def allocation(environ: Mapping[str, str]) -> list[str]:
    """The job's nodes (``SLURM_JOB_NODELIST``, expanded); none outside a job or when it does
    not parse."""
    try:
        return list(dict.fromkeys(hostlist.expand(jobenv.job_nodelist(environ))))[:_MAX_HOSTS]
    except hostlist.HostlistError as exc:
        log.warning("the job's node list is not a hostlist (%s): its nodes get no reserved "
                    "admission", exc)
        return []


@dataclass(frozen=True, eq=False)
class Ticket:
    """One admitted connection: its source, whether it counts as a stranger's (decided when it
    came in: the job's hosts may be learnt meanwhile), when it came in, and how to hang up on
    it (the next connection from its source may take its place)."""

    source: str
    address: str
    stranger: bool
    since: float
    hang_up: Callable[[], None] = field(repr=False)


class Admission:
    """Connection limits (the module's docstring): ``enter`` a connection, ``authenticated``
    once it showed the key, ``leave`` when it ends.

    A source at ``per_source`` whose oldest handshake has lasted ``evict_after`` s gives that
    one up to a new connection: a rank's whole handshake takes milliseconds, so what a
    stranger holds of its own source's share goes to the next comer, a rank on the same host
    included, instead of turning everyone from that source away until the deadline."""

    def __init__(self, total: int, per_source: int, strangers: int | None = None,
                 evict_after: float = EVICT_AFTER_S,
                 clock: Callable[[], float] = time.monotonic, uid: int | None = None) -> None:
        """``uid``: the user whose local connections are the job's (None: this process's)."""
        self.total, self.per_source, self.evict_after = total, per_source, evict_after
        self.uid = os.geteuid() if uid is None else uid
        self.strangers = max(1, total // STRANGERS_SHARE) if strangers is None else strangers
        self._clock = clock
        self._lock = threading.Lock()
        self._active = 0
        self._strangers_in = 0
        self._pending: dict[str, dict[Ticket, None]] = {}  # in the handshake, oldest first
        # This host is always one of the job's; its own user's sockets are the job's.
        self._own: set[str] = {LOOPBACK, local_source(self.uid)}
        self._logged: dict[str, float] = {}

    def own(self, addresses: Iterable[str]) -> None:
        """Count connections from ``addresses`` (the job's hosts) as the job's, not
        strangers': they keep the share of slots strangers cannot take."""
        srcs = {source_of(a) for a in addresses}
        with self._lock:
            self._own |= srcs

    def own_hosts(self, names: Iterable[str], resolve: Resolve = addresses_of
                  ) -> threading.Thread | None:
        """`own` the addresses of the host ``names``, resolved in the background: a server
        starts at once, and its ranks count as strangers only until their host is resolved."""
        todo = list(names)
        if not todo:
            return None

        def run() -> None:
            for name in todo:
                self.own(resolve(name))
            log.debug("admission: %d hosts of the job resolved", len(todo))
        t = threading.Thread(target=run, name="gpuwarden-admit-hosts", daemon=True)
        t.start()
        return t

    def enter(self, address: str, hang_up: Callable[[], None] = lambda: None,
              uid: int | None = None) -> Ticket | str:
        """A ticket when admitted (in the handshake); else why not. ``hang_up`` ends the
        connection, should a later one from its source take its place. ``uid``: the owner of
        the client's socket when it is on this host (`peeruid.local_uid`), else None."""
        src = source_of(address) if uid is None else local_source(uid)
        now = self._clock()
        with self._lock:
            stranger = src not in self._own
            if self._active >= self.total:
                return f"{self._active} connections already, the most at once"
            bucket = self._pending.get(src, {})
            old = next(iter(bucket)) if len(bucket) >= self.per_source else None
            if old is not None and now - old.since < self.evict_after:
                return f"{self.per_source} connections from {_named(src)} already in the handshake"
            freed = int(old is not None and old.stranger)
            if stranger and self._strangers_in - freed >= self.strangers:
                return (f"{self.strangers} connections from outside the job's hosts already in "
                        "the handshake")
            if old is not None:
                self._drop(old)
            ticket = Ticket(src, address, stranger, now, hang_up)
            self._active += 1
            self._pending.setdefault(src, {})[ticket] = None
            self._strangers_in += int(stranger)
        if old is not None:
            old.hang_up()  # its handler sees the connection end, and leaves
        return ticket

    def authenticated(self, ticket: Ticket) -> None:
        with self._lock:
            self._drop(ticket)

    def leave(self, ticket: Ticket) -> None:
        with self._lock:
            self._active -= 1
            self._drop(ticket)

    def should_log(self, address: str) -> bool:
        """Whether to log a refusal of (or a failure from) ``address`` now: once per source
        every REFUSAL_LOG_S."""
        src = source_of(address)
        now = time.monotonic()
        with self._lock:
            if len(self._logged) > _MAX_LOGGED:
                self._logged.clear()
            if now - self._logged.get(src, -REFUSAL_LOG_S) < REFUSAL_LOG_S:
                return False
            self._logged[src] = now
            return True

    def _drop(self, ticket: Ticket) -> None:
        """Out of its source's handshakes (once: shown the key, ended or replaced)."""
        bucket = self._pending.get(ticket.source)
        if bucket is None or ticket not in bucket:
            return
        del bucket[ticket]
        if not bucket:
            del self._pending[ticket.source]
        self._strangers_in -= int(ticket.stranger)


def _named(src: str) -> str:
    if src.startswith(_USER):
        return f"this host's user {src[len(_USER):]}"
    return "this host's loopback" if src == LOOPBACK else src
