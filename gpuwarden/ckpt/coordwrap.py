"""`gpuwarden ckpt coord -- COMMAND`: the job's coordinator (`coordsrv`) beside the command that
starts its ranks (``srun ...``, ``gpuwarden launch ...``), for sites without a shared filesystem
(docs/design/object-store-sites.md, 2.3).

On the batch host, the one node whose loss always ends the job: a `CoordServer` on a port the
kernel picks, keyed with the job's key; COMMAND runs as a child with the address in its
environment (``GPUWARDEN_CKPT_COORD=host:port``), which srun passes to every rank (where the job
asked srun to pass nothing, ``SLURM_EXPORT_ENV`` is made to name it). The signals a batch
script relays (SIGTERM, SIGINT, SIGUSR1, SIGUSR2) go on to COMMAND; COMMAND's exit status is
the wrapper's (128 + N when a signal ended it, as a shell says it); the coordinator stops with
it. The server is asked once (`NetCoordinator.ping`, under the job's key, at the very address
the ranks get) before COMMAND starts: a host name the nodes cannot reach it by is said at
once, not as every rank's timeout minutes later.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

from gpuwarden.ckpt.coord import CoordError
from gpuwarden.ckpt.coordnet import ENV_COORD, NetCoordinator
from gpuwarden.ckpt.coordsrv import CoordServer
from gpuwarden.ckpt.peeradmit import allocation
from gpuwarden.core.errors import GpuwardenError

log = logging.getLogger(__name__)

EXPORT_ENV = "SLURM_EXPORT_ENV"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
READY_S = 10.0  # for the wrapper's own first answer from its coordinator


class WrapError(GpuwardenError):
    """The coordinator could not be started or reached (the message says which)."""


def with_export(value: str | None, name: str) -> str | None:
    """``SLURM_EXPORT_ENV`` (srun's ``--export``) amended so that srun passes ``name`` to the
    ranks; None: leave it unset. ``ALL`` (and unset) pass everything already; ``NONE``/``NIL``
    cannot name variables (srun's man page), so they become the list ``name`` alone (srun then
    passes the SLURM_* variables and ``name``: what NONE passes, and ours); a list gains
    ``name``. Pure."""
    if not value:
        return None
    words = value.split(",")
    if words[0].strip().upper() == "ALL":
        return value
    if words[0].strip().upper() in ("NONE", "NIL"):
        return name
    if name in (w.partition("=")[0].strip() for w in words):
        return value
    return f"{value},{name}"


def child_env(environ: Mapping[str, str], addr: str) -> dict[str, str]:
    """COMMAND's environment: ``environ`` with the coordinator's address, which srun passes
    on whatever the job's ``--export``. Pure."""
    env = {**environ, ENV_COORD: addr}
    export = with_export(environ.get(EXPORT_ENV), ENV_COORD)
    if export is not None:
        env[EXPORT_ENV] = export
    return env


def address(host: str, port: int) -> str:
    """``host:port`` as `coordnet.parse_address` reads it (an IPv6 literal bracketed). Pure."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def forwarded(foreground: bool) -> tuple[signal.Signals, ...]:
    """The signals passed on to COMMAND. In a terminal's foreground (``salloc`` then the
    wrapper by hand) the terminal's Ctrl-C reaches COMMAND itself: passing it on too would be a
    second SIGINT, which srun takes as "cancel the step". Pure."""
    return tuple(s for s in FORWARDED if not (foreground and s == signal.SIGINT))


def in_foreground() -> bool:
    """Whether this process runs in its terminal's foreground process group."""
    try:
        return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


def run(argv: Sequence[str], env: Mapping[str, str],
        signals: Sequence[signal.Signals] | None = None) -> int:
    """Run ``argv`` to its end, passing it ``signals`` (None: `forwarded`; those ignored here
    are left so: a shell's background job ignores SIGINT, and so must its command); its exit
    status, 128 + N when signal N ended it. FileNotFoundError/PermissionError when it cannot
    be started."""
    proc: list[subprocess.Popen[bytes]] = []
    early: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        if not proc:
            early.append(signum)  # before the child exists: passed on once it does
            return
        with contextlib.suppress(ProcessLookupError):
            proc[0].send_signal(signum)

    before: dict[signal.Signals, Callable[[int, FrameType | None], Any] | int | None] = {}
    for sig in forwarded(in_foreground()) if signals is None else signals:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            before[sig] = signal.signal(sig, forward)
    try:
        proc.append(subprocess.Popen(list(argv), env=dict(env)))
        for signum in early:
            forward(signum, None)
        code = proc[0].wait()  # a forwarded signal interrupts it; the wait goes on (PEP 475)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def serve(argv: Sequence[str], key: bytes, job: str, host: str, environ: Mapping[str, str],
          port: int = 0, say: Callable[[str], None] = log.info) -> int:
    """Start the job's coordinator, check it answers at ``host``, run ``argv`` beside it (see
    `run`), stop it; ``argv``'s exit status. WrapError when the coordinator cannot listen or
    does not answer at ``host``."""
    try:
        server = CoordServer(key, job, port=port, hosts=allocation(environ))
    except OSError as exc:  # PeerError is one too
        raise WrapError(str(exc)) from None
    try:
        addr = address(host, server.port)
        try:
            NetCoordinator(addr, key, job, 0, 1, op_timeout_s=READY_S).ping()
        except CoordError as exc:
            raise WrapError(f"the coordinator does not answer at {addr} ({exc}): is {host!r} "
                            "this host's name as the other nodes reach it? (--host)") from None
        say(f"gpuwarden: {job}'s checkpoint coordinator at {addr}")
        return run(argv, child_env(environ, addr))
    finally:
        server.stop()
