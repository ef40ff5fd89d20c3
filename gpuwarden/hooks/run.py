"""What the shipped Slurm hooks run (prolog/gpuwarden-hook.sh starts it).

The exit status is a small protocol with the shell wrapper, which alone talks to Slurm:
0 all well; EXIT_FAIL_JOB the prolog drained the node and the job must fail (the wrapper exits
1, Slurm requeues the job elsewhere); anything else is gpuwarden failing to run, which the
wrapper logs to syslog and answers with 0 (fail open: an install mistake or a gpuwarden bug
must never take nodes out of service).
"""

from __future__ import annotations

import os
import sys

EXIT_FAIL_JOB = 86
EXIT_CANNOT_IMPORT = 87  # set by the wrapper's bootstrap when this module cannot be imported
EXIT_USAGE = 64

COMMANDS = {"prolog": "prolog", "epilog": "epilog", "healthcheck": "periodic"}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in COMMANDS:
        sys.stderr.write(f"gpuwarden hook: expected one of {', '.join(COMMANDS)}, got {argv}\n")
        return EXIT_USAGE
    hook = argv[0]
    if hook == "prolog":
        from gpuwarden.health import fastgate  # noqa: PLC0415

        if not fastgate.check(os.environ):
            return 0
        problem = fastgate.remember(os.environ)
        if problem:
            sys.stderr.write(f"gpuwarden prolog: fast path stays off: {problem}\n")
    return full(hook)


def full(hook: str) -> int:
    """``gpuwarden health <command>``, with its status mapped onto the protocol above."""
    from gpuwarden.cli import main as cli_main  # noqa: PLC0415

    sys.argv = ["gpuwarden", "health", COMMANDS[hook]]
    try:
        code: object = cli_main()
    except SystemExit as exc:
        code = exc.code
    if code is None:
        code = 0
    if not isinstance(code, int):
        sys.stderr.write(f"{code}\n")
        code = 1
    # The prolog's only deliberate non-zero status: it drained the node itself.
    return EXIT_FAIL_JOB if hook == "prolog" and code == 1 else code
