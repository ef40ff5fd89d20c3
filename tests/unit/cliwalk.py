"""Runs `gpuwarden` command lines through its real entry point (`gpuwarden.cli.main`) in one
process, as a shell would, and prints one JSON object per line: the command line, the exit
status, what it printed, and the traceback of anything that escaped `main` (never expected).

Usage: python tests/unit/cliwalk.py < CASES   (CASES: JSON lines {"argv": [...], "env": {...}})
As a script, not with -m: click then names the program "gpuwarden" in its usage lines.
The hooks' watchdogs use SIGALRM, so this runs apart from pytest (whose timeout uses it too).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback


def run(argv: list[str], env: dict[str, str]) -> dict[str, object]:
    from gpuwarden import cli
    from gpuwarden.core import logsetup

    logsetup.add_syslog = lambda *a, **k: None  # no syslog in tests
    saved = dict(os.environ)
    os.environ.update(env)
    out = io.StringIO()
    code: object = None
    escaped = ""
    sys.argv = ["gpuwarden", *argv]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = cli.main()
            except SystemExit as exc:
                code = exc.code
    except BaseException:  # what a user would see as a traceback
        escaped = traceback.format_exc()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if isinstance(code, str):  # sys.exit("why"): Python prints it to stderr, status 1
        out.write(code + "\n")
    return {"argv": argv, "code": code if isinstance(code, int) else 0 if code is None else 1,
            "output": out.getvalue(), "escaped": escaped}


def main() -> None:
    for line in sys.stdin:
        case = json.loads(line)
        print(json.dumps(run(case["argv"], case.get("env", {}))), flush=True)


if __name__ == "__main__":
    main()
