"""`gpuwarden accounting ingest|sync`: the accounting store (docs/report.md, "The accounting
store") filled from exports or from slurmdbd."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import click

from gpuwarden.accounting.options import acct_reader, expand_paths, parse_span, progress
from gpuwarden.config.context import Context
from gpuwarden.core.errors import ConfigError, GpuwardenError, SlurmError
from gpuwarden.core.extras import Needs
from gpuwarden.slurm.models import AcctJob

# numpy and msgspec (the `lemon` extra), polars (`store`): --help works on the base install.
with Needs("lemon") as LEMON:
    from gpuwarden.accounting.history import read_events
with Needs("store") as STORE:
    from gpuwarden.accounting.store.ingest import ingest as ingest_exports
    from gpuwarden.accounting.store.sync import sync as sync_store

STORE_HELP = "the store's directory [default: [accounting] store]"


def _store(obj: Context, store: str | None) -> str:
    where = store or obj.config_or_exit().accounting.store
    if not where:
        raise click.UsageError("no store: give --store DIR or set [accounting] store")
    return where


@click.group("accounting")
def accounting() -> None:
    """The accounting store: Slurm accounting ingested once, read by lemon scan, fleet mttf
    and report in seconds."""


@accounting.command("ingest")
@LEMON.required
@STORE.required
@click.option("--from", "from_files", multiple=True, required=True,
              type=click.Path(exists=True),
              help="exported `sacct --json` output (a file, or a directory of *.json; "
                   "repeatable)")
@click.option("--events", "events_file", type=click.Path(dir_okay=False, exists=True),
              default=None, help="exported `sacctmgr -P -n show events format=Cluster,"
                                 "NodeName,TimeStart,TimeEnd,State,Reason,User`, merged into "
                                 "the store's")
@click.option("--store", default=None, type=click.Path(file_okay=False), help=STORE_HELP)
@click.pass_obj
def ingest(obj: Context, from_files: tuple[str, ...], events_file: str | None,
           store: str | None) -> None:
    """Ingest exports into the store: each read once; an unchanged export is skipped, a
    changed one replaced, overlapping windows refused."""
    where = _store(obj, store)
    try:
        events = read_events(events_file) if events_file else None
        got = ingest_exports(where, expand_paths(from_files), events,
                             progress=progress("ingesting file"))
    except (GpuwardenError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"{where}: {len(got.added)} export(s) added, {len(got.replaced)} replaced, "
               f"{len(got.unchanged)} unchanged; {got.rows} rows written, "
               f"{sum(e.rows for e in got.store.exports)} in the store"
               + (f", {got.events} node events" if events_file else ""))


@accounting.command("sync")
@LEMON.required
@STORE.required
@click.option("--store", default=None, type=click.Path(file_okay=False), help=STORE_HELP)
@click.option("--since", default=None,
              help="a first sync reads this far back [default: [accounting] sync_since]")
@click.pass_obj
def sync(obj: Context, store: str | None, since: str | None) -> None:
    """Pull what slurmdbd recorded since the last sync, up to [accounting] sync_settle_s ago
    (sacct --json, a day per call), and the node events into the store (run by
    gpuwarden-accounting-sync.timer)."""
    where = _store(obj, store)
    cfg = obj.config_or_exit()
    span = parse_span(since or cfg.accounting.sync_since)
    try:
        got = sync_store(where, obj.client(), acct_reader(obj) or _ClientReader(obj),
                         span, datetime.now(UTC), progress("syncing day"),
                         settle=timedelta(seconds=cfg.accounting.sync_settle_s))
    except ConfigError as exc:
        click.echo(f"gpuwarden: {exc}", err=True)
        sys.exit(2)
    except (GpuwardenError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    if not got.windows:
        click.echo(f"{where}: already synced to {got.end:%Y-%m-%dT%H:%M:%S}Z")
        return
    click.echo(f"{where}: synced {got.start:%Y-%m-%dT%H:%M:%S}Z..{got.end:%Y-%m-%dT%H:%M:%S}Z"
               f" ({got.windows} sacct call(s)): {got.rows} rows, {got.events} node events")


class _ClientReader:
    """A fake client's own acct_jobs (tests), as the store's reader."""

    def __init__(self, obj: Context) -> None:
        self._obj = obj

    def window(self, start: str, end: str) -> Iterator[AcctJob | SlurmError]:
        return self._obj.client().acct_jobs(start, end)
