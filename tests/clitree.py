"""Walk the `gpuwarden` command tree as the interpreter running this file sees it.

Run as a script in another interpreter, so that what is imported is that interpreter's
gpuwarden: a fresh venv with only the base install (tests/install), or the dev venv with the
extras' packages refused (tests/unit/test_base_install_cli.py):

    python -I clitree.py [--refuse numpy,xxhash,...] [--help-all] [RUN_JSON ...]

Prints one JSON object: "paths" (every command and subcommand, as argument lists), "runs" (for
each RUN_JSON argument list, and for `PATH --help` of every path with --help-all: its exit
code, output and any exception other than SystemExit) and "loaded" (refused or optional
modules found in sys.modules at the end).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import sys
from collections.abc import Iterator, Sequence
from typing import Any

OPTIONAL = ("numpy", "msgspec", "xxhash", "boto3", "botocore", "pynvml", "docker")


class Refuse(importlib.abc.MetaPathFinder):
    """Imports of these packages fail as if they were not installed."""

    def __init__(self, tops: set[str]) -> None:
        self.tops = tops

    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name.partition(".")[0] in self.tops:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def paths(cli: Any) -> Iterator[list[str]]:
    import click  # only once the refusals are in place

    def walk(cmd: click.Command, path: list[str], ctx: click.Context) -> Iterator[list[str]]:
        yield path
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                sub = cmd.get_command(ctx, name)
                assert sub is not None, f"{[*path, name]}: listed but not found"
                yield from walk(sub, [*path, name], click.Context(sub, info_name=name, parent=ctx))

    yield from walk(cli, [], click.Context(cli, info_name="gpuwarden"))


def run(cli: Any, context: Any, args: list[str]) -> dict[str, Any]:
    from click.testing import CliRunner

    result = CliRunner().invoke(cli, args, obj=context(), prog_name="gpuwarden")
    exc = result.exception
    return {"args": args, "code": result.exit_code, "output": result.output,
            "exception": None if exc is None or isinstance(exc, SystemExit) else repr(exc)}


def main(argv: list[str]) -> None:
    refuse: set[str] = set()
    if argv[:1] == ["--refuse"]:
        refuse = set(argv[1].split(","))
        argv = argv[2:]
        sys.meta_path.insert(0, Refuse(refuse))
    help_all = argv[:1] == ["--help-all"]
    argv = argv[1:] if help_all else argv
    from gpuwarden.cli import cli  # after the refusals
    from gpuwarden.config.context import Context

    found = list(paths(cli))
    asked = [json.loads(a) for a in argv]
    if help_all:
        asked = [[*p, "--help"] for p in found] + asked
    runs = [run(cli, Context, args) for args in asked]
    loaded = sorted({m.partition(".")[0] for m in sys.modules} & set(OPTIONAL))
    json.dump({"paths": found, "runs": runs, "loaded": loaded}, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
