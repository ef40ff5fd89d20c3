"""Whether a ``kernel_log`` can be trusted: what ``gpuwarden config check`` and ``gpuwarden health
selftest`` say before the hooks run on it.

Only /dev/kmsg and ``journalctl -k -o json`` keep a user's text from posing as a kernel record
(kernlog.TRUSTED). In every other rendering a user can write a line that reads as the kernel's:
``logger -t kernel`` in syslog and journal short renderings, a newline in a file name where the
kernel's syslog interface (dmesg -S, busybox dmesg, rsyslog imklog) repeats the record's
``<pri>[time]`` prefix after it. Such a file is refused, as is one where no line is a record.
"""

from __future__ import annotations

import time

from gpuwarden.core.deadline import run_all
from gpuwarden.health import kernlog

KMSG = "/dev/kmsg"
_FIX = "set [health] kernel_log to /dev/kmsg, or to a file written by `journalctl -k -o json`"


def problem(path: str, text: str) -> str:
    """"" when ``text`` (read from ``path``) is a rendering gpuwarden can trust, else why not."""
    if path == KMSG or not text.strip():
        return ""  # an empty file (just rotated) says nothing yet; callers say it is empty
    recs = kernlog.parse(text, 0.0, time.time())
    if not recs.records:
        why = recs.malformed[0] if recs.malformed else "every line is too long to be one"
        return f"kernel_log {path}: no line is a kernel log record gpuwarden reads ({why}); {_FIX}"
    if recs.forgeable:
        return (f"kernel_log {path}: in its rendering ({', '.join(sorted(recs.forgeable))}) any "
                f"user can forge a kernel line (logger -t kernel, a newline in a file name); "
                f"{_FIX}")
    if recs.malformed:
        return (f"kernel_log {path}: {len(recs.malformed)} line(s) gpuwarden cannot read "
                f"({recs.malformed[0]}); {_FIX}")
    return ""


def check_file(path: str, timeout_s: float) -> tuple[bool, str]:
    """(readable, problem) for the configured ``kernel_log``, read within ``timeout_s``."""
    if path == KMSG:
        return True, ""
    from gpuwarden.health.gather import read_kernel_log  # noqa: PLC0415 - NVML-free, but heavy

    out = run_all({"kernel log": lambda: read_kernel_log(path)}, timeout_s)["kernel log"]
    if out.timed_out:
        return False, f"kernel_log {path}: not read within {timeout_s:g} s"
    if out.error:
        return False, f"kernel_log {path}: {out.error}"
    text, _booted = out.value
    return True, problem(path, text)
