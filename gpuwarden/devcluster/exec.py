"""Run a command in a container with a hard deadline (docker's exec API has none of its own)."""

from __future__ import annotations

import io
import tarfile
import threading
import uuid
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
# goes missing with exit 0 (an `sbatch --parsable` that printed no job id), or the frames lose
# their alignment ("100 is not a valid stream"). So the command's output goes to files in the
# container, read back through the archive API (a plain HTTP body, read in full), and the
# exec's own stream carries nothing.
_WRAP = (
    'd=$1; shift; mkdir -m 700 "$d" || exit 125\n'
    # Leftovers of earlier calls (their output was read long ago), this user's only.
    "find \"${d%/*}\" -maxdepth 1 -name '.gwexec-*' -user \"$(id -u)\" -mmin +10 "
    "-exec rm -rf {} + 2>/dev/null\n"
    'if [ -n "${GPUWARDEN_STDIN+x}" ]; then printf %s "$GPUWARDEN_STDIN" | "$@" >"$d/out" '
    '2>"$d/err"; else "$@" >"$d/out" 2>"$d/err"; fi'
)


# Where in the container (every user may write there).
OUTPUT_DIR = "/tmp"  # noqa: S108 - inside the container


class ExecOutputLost(RuntimeError):
    pass


def _read_back(container: Any, path: str) -> tuple[bytes, bytes]:
    chunks, _stat = container.get_archive(path)
    with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as tar:
        found: dict[str, bytes] = {}
        for member in tar.getmembers():
            name = member.name.rsplit("/", 1)[-1]
            f = tar.extractfile(member) if member.isfile() else None
            if f is not None and name in ("out", "err"):
                found[name] = f.read()
    if set(found) != {"out", "err"}:
        raise ExecOutputLost(f"{path} in {container.name} holds {sorted(found)}, not out and err")
    return found["out"], found["err"]


def run_in(container: Any, argv: list[str], timeout: float = 60.0, user: str = "",
           environment: dict[str, str] | None = None, stdin_text: str | None = None) -> ExecResult:
    """coreutils `timeout` inside the container enforces the deadline; exit 124 means it passed."""
    if stdin_text is not None:
        # exec_run cannot feed stdin: hand the text over as an environment variable instead.
        environment = {**(environment or {}), "GPUWARDEN_STDIN": stdin_text}
    where = f"{OUTPUT_DIR}/.gwexec-{uuid.uuid4().hex}"
    cmd = ["sh", "-c", _WRAP, "sh", where, "timeout", "-k", "5", f"{timeout:g}", *argv]
    res = _bounded(lambda: container.exec_run(cmd, demux=True, user=user or "root",
                                              environment=environment),
                   timeout + GRACE_S, argv)
    rc = res.exit_code if res.exit_code is not None else -1
    try:
        out, err = _bounded(lambda: _read_back(container, where), GRACE_S, argv)
    except ExecStalled:
        raise
    except Exception as exc:  # docker's NotFound and kin: the output is gone, say so
        raise ExecOutputLost(f"`{' '.join(argv)[:200]}` in {container.name} exited {rc}, but "
                             f"its output in {where} cannot be read: {exc}") from None
    return ExecResult(rc=rc, out=out.decode(errors="replace"), err=err.decode(errors="replace"))
