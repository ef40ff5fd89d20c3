"""What the commands that read the accounting history share: the `--since/--from/--events`
options (declared once here), their parsers, and reading the history they name with progress
on stderr. `lemon scan`, `fleet mttf`, `report` and `ckpt interval` use them; a feature never
imports another feature's CLI for them."""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol, TypeVar

import click

from gpuwarden.accounting import stream as acctstream
from gpuwarden.config import Config
from gpuwarden.core.errors import ConfigError, GpuwardenError
from gpuwarden.core.extras import Needs
from gpuwarden.slurm import bindir
from gpuwarden.slurm.client import SlurmClient

# numpy (the joint attribution): `lemon list` and every --help work on the base install; the
# commands that read a history are marked with their own `Needs("lemon")`.
with Needs("lemon"):
    from gpuwarden.accounting import history

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_SINCE = "30d"
_SPAN = re.compile(r"^(\d+)([mhdw])$")
_UNITS = {"m": 60, "h": 3600, "d": 86_400, "w": 604_800}
_COST = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h)?$")

# The help the options give unless a command words its own.
SINCE_HELP = "how far back to read: 30d, 12h, or a time (UTC) [default: 30d]"
FROM_HELP = ("exported `sacct --json` output (a file, or a directory of *.json) instead "
             "of the cluster (repeatable)")
STORE_HELP = ("read the accounting store (`gpuwarden accounting ingest`/`sync`) instead of the "
              "cluster; with --since only the runs that ended since [default: [accounting] "
              "store]")
LIVE_HELP = "read slurmdbd (sacct) even where [accounting] store is set"


def since_option(help: str | None = SINCE_HELP, default: str | None = None,
                 show_default: bool | None = None) -> Callable[[F], F]:
    """`--since`, as `parse_since` reads it. ``default=None`` means `DEFAULT_SINCE`, unless
    --from gives the history (`load_history`)."""
    return click.option("--since", "since", default=default, show_default=show_default,
                        help=help)


def history_options(*, events_help: str, since_help: str = SINCE_HELP,
                    from_help: str = FROM_HELP) -> Callable[[F], F]:
    """`--since`, `--from`, `--events`, `--store` and `--live`: the command's parameters
    ``since``, ``from_files``, ``events_file``, ``store`` and ``live``, as `load_history`
    takes them. ``events_help`` says what the command
    reads the events for."""
    # In the order --help lists them; applied last first, as stacked decorators are.
    added = [
        since_option(since_help),
        click.option("--from", "from_files", multiple=True, type=click.Path(exists=True),
                     help=from_help),
        click.option("--events", "events_file", type=click.Path(dir_okay=False), default=None,
                     help=events_help),
        click.option("--store", "store", type=click.Path(file_okay=False), default=None,
                     help=STORE_HELP),
        click.option("--live", is_flag=True, help=LIVE_HELP),
    ]

    def add(fn: F) -> F:
        for option in reversed(added):
            fn = option(fn)
        return fn
    return add


def parse_span(text: str) -> timedelta:
    m = _SPAN.match(text.strip())
    if not m or int(m.group(1)) == 0:
        raise click.BadParameter(f"{text!r}: expected a span like 90m, 12h, 30d or 2w")
    return timedelta(seconds=int(m.group(1)) * _UNITS[m.group(2)])


def parse_since(text: str, now: datetime) -> timedelta:
    """A span back from now (30d), or a point in time (2026-11-29T12:00:00, UTC unless it says
    otherwise), for example the moment a repair was finished."""
    if _SPAN.match(text.strip()):
        return parse_span(text)
    try:
        at = datetime.fromisoformat(text.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected a span like 90m, 12h, 30d or 2w, or a "
                                 "time like 2026-11-29T12:00:00") from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    if at >= now:
        raise click.BadParameter(f"{text!r} is not in the past")
    return now - at


def parse_cost(text: str) -> float:
    """A duration in seconds: 30s, 2m, 0.5h, or a bare number of seconds."""
    m = _COST.match(text.strip())
    if not m:
        raise click.BadParameter(f"{text!r}: expected a duration like 30s, 2m or 0.5h")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]


PLAIN_EVERY_S = 30.0


def progress(label: str, tty: bool | None = None,
             clock: Callable[[], float] = time.monotonic) -> Callable[[int, int], None]:
    """Progress on stderr for long reads: a terminal sees one line updated in place; a log
    (stderr not a terminal) gets a plain line at most every 30 s, and nothing for short reads."""
    tty = sys.stderr.isatty() if tty is None else tty
    last = [clock()]

    def show(done: int, total: int) -> None:
        if total < 3:
            return
        if tty:
            click.echo(f"\r{label} {done}/{total}", err=True, nl=done == total)
        elif clock() - last[0] >= PLAIN_EVERY_S:
            last[0] = clock()
            click.echo(f"{label} {done}/{total}", err=True)
    return show


def expand_paths(items: tuple[str, ...]) -> list[str]:
    """Files as given; a directory stands for the `*.json` files in it."""
    out: list[str] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(str(x) for x in p.glob("*.json"))
            if not found:
                raise click.ClickException(f"{item}: a directory without *.json files")
            out.extend(found)
        else:
            out.append(item)
    return out


class HistoryContext(Protocol):
    """What reading the history needs of the command's context object
    (`gpuwarden.config.context.Context`); a Protocol, so tests pass a small stand-in."""

    @property
    def client_factory(self) -> Callable[[Config], SlurmClient] | None: ...

    def config(self) -> Config: ...

    def client(self) -> SlurmClient: ...


def store_of(obj: HistoryContext, store: str | None, from_files: tuple[str, ...],
             live: bool = False) -> str | None:
    """The store to read: --store, else [accounting] store unless --from or --live; None
    for none."""
    given = sum(bool(x) for x in (store, from_files, live))
    if given > 1:
        raise click.UsageError("--store, --from and --live each name the history: give one")
    if from_files or live:
        return None
    if store:
        return store
    try:
        return obj.config().accounting.store or None
    except ConfigError as exc:
        click.echo(f"gpuwarden: {exc}", err=True)
        sys.exit(2)


def load_history(obj: HistoryContext, since: str | None, from_files: tuple[str, ...],
                 events_file: str | None, grace_s: float,
                 collector: history.CollectorFactory | None = None,
                 store: str | None = None, live: bool = False,
                 mttf_only: bool = False) -> history.History:
    """The history from files, the accounting store or the live cluster; errors exit with
    what to do. ``collector``: more tallies filled in the same pass (`gpuwarden report`);
    ``mttf_only``: from a store, only what `fleet mttf` reads (`history.from_store`)."""
    now = datetime.now(UTC)
    if from_files and since:
        raise click.UsageError("--since reads the live cluster; with --from the files are the "
                               "history (export the window you want)")
    where = store_of(obj, store, from_files, live)
    if where is not None:
        if events_file:
            raise click.UsageError("--events goes with --from (a store keeps the events "
                                   "ingested with it)")
        at = None if since is None else (now - parse_since(since, now)).timestamp()
        try:
            return history.from_store(where, grace_s=grace_s, collector=collector, since=at,
                                      mttf_only=mttf_only)
        except (GpuwardenError, OSError) as exc:
            raise click.ClickException(str(exc)) from None
    span = parse_since(since or DEFAULT_SINCE, now)
    try:
        if from_files:
            paths = expand_paths(from_files)
            events = history.read_events(events_file)
            return history.from_files(paths, events, grace_s,
                                      progress=progress("reading file"), collector=collector)
        if events_file:
            raise click.UsageError("--events goes with --from (the cluster has its own)")
        return history.from_cluster(obj.client(), span, grace_s, now=now,
                                    progress=progress("reading accounting, day"),
                                    reader=acct_reader(obj), collector=collector)
    except ConfigError as exc:
        click.echo(f"gpuwarden: {exc}", err=True)
        sys.exit(2)
    except (GpuwardenError, OSError) as exc:
        raise click.ClickException(str(exc)) from None


def acct_reader(obj: HistoryContext) -> acctstream.SacctStream | None:
    """sacct streamed under the configured deadline; None when tests swapped in a fake
    client (its own acct_jobs is read then)."""
    if obj.client_factory is not None:
        return None
    cfg = obj.config()
    return acctstream.SacctStream(
        lambda: os.path.join(bindir.locate(cfg.slurm.bin_dir, use_path=True).path, "sacct"),
        cfg.slurm.command_timeout_s)
