"""Run a command in a container with a hard deadline (docker's exec API has none of its own)."""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ExecResult:
    rc: int
    out: str
    err: str

    def check(self, what: str) -> ExecResult:
        if self.rc != 0:
            raise RuntimeError(f"{what} failed (exit {self.rc}): {self.err.strip() or self.out.strip()}")
        return self


# How long past its own deadline an exec may take to come back: `timeout` inside ends the
# command, but a process that escaped its group (dpkg runs in a pty of its own) can hold the
# exec's output open, and dockerd under load can stall a stream; the caller must not wait on.
GRACE_S = 30.0


class ExecStalled(RuntimeError):
    pass


def _bounded(call: Callable[[], Any], limit: float, argv: list[str]) -> Any:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["res"] = call()
        except BaseException as exc:  # handed to the caller as it is
            box["exc"] = exc
    t = threading.Thread(target=run, daemon=True, name="docker-exec")
    t.start()
    t.join(limit)
    if t.is_alive():
        raise ExecStalled(f"`{' '.join(argv)[:200]}` did not come back within {limit:g} s "
                          "(its own deadline and a grace): the container or dockerd is stuck")
    if "exc" in box:
        raise box["exc"]
    return box["res"]


# docker-py reads an exec's output from the socket under http.client's buffered reader
# (APIClient._get_raw_response_socket: response.raw._fp.fp.raw), so output that arrived with
# the response headers sits in that buffer and is never read: under load the whole output
# went missing with exit 0 (an `sbatch --parsable` that printed no job id), or the frames
# lost their alignment ("100 is not a valid stream"). The frames are read here from that
# buffered reader itself, which hands out what it read ahead first.
_FRAME = struct.Struct(">BxxxL")  # stream (1 stdout, 2 stderr), then the payload's length


class ExecOutputLost(RuntimeError):
    pass


def _exec(container: Any, cmd: list[str], user: str,
          environment: dict[str, str] | None) -> tuple[int, bytes, bytes]:
    api = container.client.api
    exec_id = api.exec_create(container.id, cmd, stdout=True, stderr=True, user=user,
                              environment=environment)["Id"]
    res = api._post_json(api._url("/exec/{0}/start", exec_id),
                         headers={"Connection": "Upgrade", "Upgrade": "tcp"},
                         data={"Tty": False, "Detach": False}, stream=True)
    try:
        api._raise_for_status(res)
        reader = res.raw._fp.fp  # http.client's buffered reader over the upgraded socket
        streams: dict[int, bytearray] = {1: bytearray(), 2: bytearray()}
        while True:
            head = reader.read(_FRAME.size)
            if not head:
                break
            if len(head) < _FRAME.size:
                raise ExecOutputLost(f"`{' '.join(cmd)[:200]}`: the stream ended inside a frame")
            stream, size = _FRAME.unpack(head)
            data = reader.read(size)
            if stream not in streams or len(data) < size:
                raise ExecOutputLost(f"`{' '.join(cmd)[:200]}`: a damaged frame (stream "
                                     f"{stream}, {len(data)} of {size} bytes)")
            streams[stream] += data
    finally:
        res.close()
    rc = api.exec_inspect(exec_id).get("ExitCode")
    return (rc if rc is not None else -1), bytes(streams[1]), bytes(streams[2])


def run_in(container: Any, argv: list[str], timeout: float = 60.0, user: str = "",
           environment: dict[str, str] | None = None, stdin_text: str | None = None) -> ExecResult:
    """coreutils `timeout` inside the container enforces the deadline; exit 124 means it passed."""
    cmd = ["timeout", "-k", "5", f"{timeout:g}", *argv]
    if stdin_text is not None:
        # exec_run cannot feed stdin: hand the text over as an environment variable instead.
        environment = {**(environment or {}), "GPUWARDEN_STDIN": stdin_text}
        cmd = ["timeout", "-k", "5", f"{timeout:g}", "sh", "-c",
               'printf %s "$GPUWARDEN_STDIN" | "$@"', "sh", *argv]
    rc, out, err = _bounded(lambda: _exec(container, cmd, user or "root", environment),
                            timeout + GRACE_S, argv)
    return ExecResult(rc=rc, out=out.decode(errors="replace"), err=err.decode(errors="replace"))
