"""`coord.Coordinator` over the network: a rank's side of the job's coordinator (`coordsrv`),
for sites without a shared filesystem. It behaves as `coord.FileCoordinator` does, so the
checkpointer cannot tell them apart: ``exchange`` returns every rank's value in rank order or
raises CoordError naming the ranks missing at the timeout; ``propose``'s first value wins;
``durable_floor`` is None while a rank has published nothing, cached ``floor_ttl_s``.

Every call has a deadline. A refused connection or a coordinator at its limits (BUSY) is
asked again with jittered backoff until then; so is one that dropped the connection (a retried
exchange is idempotent at the server). A coordinator that does not hold the job's key is never
asked again. Failures to reach it are `CoordIOError`, an OSError too: the writer's retention
treats them as it treats an unreadable shared tier (it deletes nothing).
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from typing import Any

from gpuwarden.ckpt.coord import CoordError
from gpuwarden.ckpt.coordsrv import MAX_VALUE
from gpuwarden.ckpt.names import check_name
from gpuwarden.ckpt.peer import Address
from gpuwarden.ckpt.peerauth import COORD, KeyRefused, client_request
from gpuwarden.ckpt.peerwire import PeerError

log = logging.getLogger(__name__)

# The coordinator's host:port, which the wrapper (`gpuwarden ckpt coord`) gives the ranks.
ENV_COORD = "GPUWARDEN_CKPT_COORD"
GRACE_S = 10.0  # beyond an exchange's wait: for the answer to come back
OP_S = 10.0  # a call that waits on no other rank (propose, durable, floor, ping)
_FIRST_PAUSE, _MOST_PAUSE = 0.02, 1.0


class CoordIOError(CoordError, OSError):
    """The coordinator could not be reached, or answered nothing usable, by the deadline."""


def parse_address(text: str) -> Address:
    """``host:port`` or ``[v6]:port`` (``GPUWARDEN_CKPT_COORD``), or CoordError naming it."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CoordError(f"coordinator address {text[:80]!r}: expected host:port")
    return Address(host, int(port))


class NetCoordinator:
    """One rank's client of the job's coordinator at ``addr``."""

    def __init__(self, addr: str | Address, key: bytes, job: str, rank: int, world_size: int,
                 op_timeout_s: float = OP_S, grace_s: float = GRACE_S,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not 0 <= rank < world_size:
            raise CoordError(f"rank {rank} is outside a world of {world_size}")
        self.addr = parse_address(addr) if isinstance(addr, str) else addr
        self._key = key
        self.job = check_name(job, "job")
        self.rank, self.world_size = rank, world_size
        self.op_timeout_s, self.grace_s = op_timeout_s, grace_s
        self._sleep = sleep
        self.floor_ttl_s = 10.0
        self._floors: dict[str, tuple[float, int]] = {}

    def __repr__(self) -> str:  # never the key
        return f"NetCoordinator({self.job} rank {self.rank}/{self.world_size} at {self.addr})"

    # ---- the Coordinator protocol -------------------------------------------------------------
    def exchange(self, round_name: str, value: Any, timeout: float) -> list[Any]:
        """Send this rank's value for the round; every rank's, in rank order, once all sent
        theirs; CoordError naming the missing ranks at ``timeout``."""
        check_name(round_name, "round")
        size = len(json.dumps(value, sort_keys=True, separators=(",", ":")))
        if size > MAX_VALUE:
            raise CoordError(f"{round_name}: a value of {size} bytes, more than the "
                             f"coordinator takes ({MAX_VALUE})")
        wait_end = time.monotonic() + timeout
        resp = self._call({"op": "exchange", "round": round_name, "value": value},
                          wait_end + self.grace_s, wait_end=wait_end)
        values = resp.get("values")
        if resp.get("ok") and isinstance(values, list) and len(values) == self.world_size:
            return values
        missing = resp.get("missing")
        if isinstance(missing, list) and missing and all(
                isinstance(r, int) and not isinstance(r, bool) for r in missing):
            raise CoordError(f"{round_name}: ranks {_ranges(missing)} did not report within "
                             f"{timeout:.0f} s (at the coordinator {self.addr}); are they "
                             "running?")
        raise CoordError(f"{round_name}: the coordinator {self.addr}: "
                         f"{str(resp.get('error', 'no values in its answer'))[:300]}")

    def propose(self, name: str, value: int) -> int:
        """The first proposal for ``name`` wins; returns it (ours or an earlier rank's)."""
        check_name(name, "proposal")
        resp = self._call({"op": "propose", "name": name, "value": value},
                          time.monotonic() + self.op_timeout_s)
        won = resp.get("value")
        if not resp.get("ok") or isinstance(won, bool) or not isinstance(won, int):
            raise CoordError(f"{name}: the coordinator {self.addr}: "
                             f"{str(resp.get('error', f'{won!r} is not a step'))[:300]}")
        return won

    def publish_durable(self, tier: str, step: int) -> None:
        check_name(tier, "tier")
        resp = self._io_call({"op": "durable", "tier": tier, "step": step})
        if not resp.get("ok"):
            raise CoordIOError(f"the coordinator {self.addr} did not record step {step} on "
                               f"{tier}: {str(resp.get('error'))[:300]}")

    def durable_floor(self, tier: str, fresh: bool = False) -> int | None:
        """The oldest of the ranks' newest steps on ``tier``; None while some rank has none.
        Asked at most every ``floor_ttl_s`` (unless ``fresh``): floors only rise within a
        run, so a cached one deletes less, never more."""
        check_name(tier, "tier")
        now = time.monotonic()
        cached = self._floors.get(tier)
        if not fresh and cached is not None and now - cached[0] < self.floor_ttl_s:
            return cached[1]
        resp = self._io_call({"op": "floor", "tier": tier})
        floor = resp.get("floor")
        if not resp.get("ok") or isinstance(floor, bool) or not isinstance(floor, (int, type(None))):
            raise CoordIOError(f"the coordinator {self.addr} gave no floor for {tier}: "
                               f"{str(resp.get('error'))[:300]}")
        if floor is not None:
            self._floors[tier] = (now, floor)
        return floor

    def ping(self) -> int:
        """How many ranks the coordinator has heard from (the wrapper's readiness check)."""
        resp = self._call({"op": "ping"}, time.monotonic() + self.op_timeout_s)
        seen = resp.get("ranks_seen")
        if not resp.get("ok") or isinstance(seen, bool) or not isinstance(seen, int):
            raise CoordError(f"the coordinator {self.addr}: {str(resp.get('error'))[:300]}")
        return seen

    # ---- one request, asked again until its deadline ------------------------------------------
    def _io_call(self, req: dict[str, Any]) -> dict[str, Any]:
        """For the writer's calls: every failure an OSError (CoordIOError), which retention
        takes as "floor unknown: delete nothing", never one that stops the writer; also a
        coordinator that no longer holds the key (its port taken by another job's)."""
        try:
            return self._call(req, time.monotonic() + self.op_timeout_s)
        except CoordIOError:
            raise
        except CoordError as exc:
            raise CoordIOError(str(exc)) from None

    def _call(self, req: dict[str, Any], deadline: float,
              wait_end: float | None = None) -> dict[str, Any]:
        base = {"v": 1, "job": self.job, "rank": self.rank, "world": self.world_size}
        pause, tries, last = _FIRST_PAUSE, 0, ""
        started = time.monotonic()
        while True:
            tries += 1
            now = time.monotonic()
            msg = {**base, **req}
            if wait_end is not None:
                msg["wait_s"] = round(max(0.0, wait_end - now), 3)
            try:
                resp, sock, _ = client_request(self._key, self.addr, COORD, msg,
                                               timeout=max(0.001, deadline - now),
                                               deadline=deadline)
                sock.close()
                return resp
            except KeyRefused as exc:
                raise CoordError(str(exc)) from None
            except PeerError as exc:  # refused, busy, dropped: the server is idempotent
                last = str(exc)
            left = deadline - time.monotonic()
            if left <= pause:
                raise CoordIOError(f"{last} (asked {tries} times in "
                                   f"{time.monotonic() - started:.1f} s)")
            self._sleep(pause * random.uniform(0.5, 1.0))  # noqa: S311 - jitter, not a secret
            pause = min(pause * 2, _MOST_PAUSE)


def _ranges(ranks: list[int]) -> str:
    shown = ",".join(str(r) for r in ranks[:16])
    return shown + (f",... ({len(ranks)} in all)" if len(ranks) > 16 else "")
