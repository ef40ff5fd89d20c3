"""The optional extras, and the one line a command prints when it needs one that is missing.

The base install (click and jinja2) must list and explain every command, so a CLI module
imports what needs an extra inside ``with Needs("ckpt") as CKPT:``: without the extra the
module still loads (--help works), and each command marked ``@CKPT.required`` stops with
`gpuwarden ckpt ls needs xxhash: pip install 'gpuwarden[ckpt]'` (exit 2), never a traceback.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import TracebackType
from typing import IO, Any, TypeVar, cast

import click

EXIT_MISSING = 2

# Import names of what each extra in pyproject.toml's [project.optional-dependencies] brings
# (botocore comes with boto3); tests/unit/test_base_install_cli.py keeps the two in step.
EXTRAS: dict[str, tuple[str, ...]] = {
    "ckpt": ("numpy", "xxhash"),
    "lemon": ("numpy", "msgspec"),
    "nvml": ("pynvml",),
    "report": ("matplotlib",),
    "s3": ("boto3", "botocore"),
    "store": ("polars",),
}

F = TypeVar("F", bound=Callable[..., Any])


def extra_for(module: str, preferred: str | None = None) -> str | None:
    """The extra that brings ``module``'s package: ``preferred`` when it does (numpy is in two),
    else the first that does; None for anything no extra brings."""
    top = module.partition(".")[0]
    if preferred is not None and top in EXTRAS.get(preferred, ()):
        return preferred
    return next((name for name, mods in EXTRAS.items() if top in mods), None)


def missing_line(command: str, exc: ModuleNotFoundError, preferred: str | None) -> str | None:
    """What to print for ``exc`` raised while ``command`` ran; None when the missing module is
    not one an extra brings (a broken install or a bug: that keeps its traceback)."""
    module = (exc.name or "").partition(".")[0]
    extra = extra_for(module, preferred) if module else None
    if extra is None:
        return None
    return f"{command} needs {module}: pip install 'gpuwarden[{extra}]'"


class MissingExtra(click.ClickException):
    """Shown as the bare line (no click "Error:" prefix); exit 2 like other set-up errors."""

    exit_code = EXIT_MISSING

    def show(self, file: IO[Any] | None = None) -> None:
        click.echo(self.format_message(), err=True)


def command_path(ctx: click.Context | None) -> str:
    """`gpuwarden ckpt ls` whatever the program was started as (python -m, a test runner)."""
    names: list[str] = []
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name or "")
        ctx = ctx.parent
    return " ".join(["gpuwarden", *reversed(names)])


class Needs:
    """Imports that need ``extra``: a missing package of an extra is kept, not raised, until a
    command marked ``required`` runs; anything else missing is raised at once."""

    def __init__(self, extra: str) -> None:
        if extra not in EXTRAS:
            raise ValueError(f"unknown extra {extra!r}")
        self.extra = extra
        self.error: ModuleNotFoundError | None = None

    def __enter__(self) -> Needs:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if isinstance(exc, ModuleNotFoundError) and extra_for(exc.name or "") is not None:
            self.error = exc
            return True
        return False

    def required(self, fn: F) -> F:
        """Mark a command's callback (under its `@group.command`): it runs only with the
        extra installed; a package of any extra found missing while it runs (boto3 for an S3
        tier) is reported the same way."""
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                if self.error is not None:
                    raise self.error
                return fn(*args, **kwargs)
            except ModuleNotFoundError as exc:
                line = missing_line(command_path(click.get_current_context(silent=True)), exc,
                                    self.extra)
                if line is None:
                    raise
                raise MissingExtra(line) from None
        return cast(F, run)
