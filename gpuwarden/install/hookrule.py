"""The hooks' rule on an interpreter, applied as the hooks apply it: prolog/gpuwarden-hook.sh's
check of what runs before Python can check anything (gw_check_python), then
``PYTHON -I -S gpuwarden_pystart.py --check`` for everything it imports (see that file for
the rule). `install-files` and `gpuwarden health selftest` use this, so all three agree."""

from __future__ import annotations

import os
import subprocess

from gpuwarden.sitefiles.prolog.gpuwarden_pystart import EXIT_UNTRUSTED

_LIMIT_S = 120.0
_SH = "/bin/sh"


def _files(sitefiles: str) -> tuple[str, str]:
    prolog = os.path.join(os.path.abspath(sitefiles), "prolog")
    return os.path.join(prolog, "gpuwarden-hook.sh"), os.path.join(prolog, "gpuwarden_pystart.py")


def hooks_python(defaults_file: str, sitefiles: str) -> str:
    """The interpreter the hooks would start, read from ``defaults_file`` as they read it."""
    lib, _ = _files(sitefiles)
    res = subprocess.run([_SH, "-c", '. "$1"; gw_python "$2" ""; printf "%s" "$_gw_py"', "sh",
                          lib, defaults_file], env={}, capture_output=True, text=True,
                         timeout=_LIMIT_S, check=False)
    return res.stdout


def problems(python: str, sitefiles: str, owner: int = 0) -> list[str]:
    """Why the hooks would refuse to run ``python`` as root (empty: they would not); ``owner``
    is also allowed in what Python imports (an install made by that uid)."""
    lib, start = _files(sitefiles)
    if owner == 0:
        # The wrapper's own check comes first: nothing of an interpreter it refuses is run.
        res = subprocess.run([_SH, "-c", '. "$1"; gw_check_python "$2"; printf "%s" "$_gw_why"',
                              "sh", lib, python], env={}, capture_output=True, text=True,
                             timeout=_LIMIT_S, check=False)
        if res.returncode != 0 or res.stdout:
            return [res.stdout or f"cannot check {python}: {res.stderr.strip()[-300:]}"]
    try:
        res = subprocess.run([python, "-I", "-S", start, "--check", "--owner", str(owner)],
                             env={}, capture_output=True, text=True, timeout=_LIMIT_S,
                             check=False, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"cannot run {python} -I -S {start} --check: {exc}"]
    found = [line for line in res.stdout.splitlines() if line]
    if res.returncode == 0 and not found:
        return []
    if res.returncode == EXIT_UNTRUSTED and found:
        return found
    tail = res.stderr.strip().splitlines()[-1:] or ["no error output"]
    return [f"cannot check {python}: exit status {res.returncode} ({tail[0]})"]
