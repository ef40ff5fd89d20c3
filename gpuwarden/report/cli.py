"""`gpuwarden report`: the fleet reliability report, one HTML file (and its JSON)."""

from __future__ import annotations

import logging
import pwd
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import click

from gpuwarden.accounting.options import (
    DEFAULT_SINCE,
    history_options,
    load_history,
    parse_cost,
    parse_since,
    store_of,
)
from gpuwarden.ckpt import jobkey, restorelog, restorelog_s3
from gpuwarden.config import Config
from gpuwarden.config.context import Context
from gpuwarden.core.errors import ConfigError, GpuwardenError
from gpuwarden.core.extras import Needs
from gpuwarden.core.safefs import Refused
from gpuwarden.health.gatingstate import of_node
from gpuwarden.report.output import Content, OutputError, check_distinct, write_all
from gpuwarden.slurm.models import NodeEvent
from gpuwarden.slurm.topology import parse as parse_topology

# numpy (the attribution and lemon scoring), then matplotlib (the charts): the base install
# still lists and explains the command.
with Needs("lemon") as LEMON:
    from gpuwarden.accounting.history import read_events, store_events
    from gpuwarden.lemon.scoring import ScoreConfig
    from gpuwarden.report.build import (
        GATING,
        Gating,
        Options,
        as_json_bytes,
        begin,
        gating_of,
        scored,
    )
    from gpuwarden.report.collect import Blamable, RunTally
    from gpuwarden.report.tradeoffs import RestoreTimes
with Needs("report") as REPORT:
    from gpuwarden.report.render import page

log = logging.getLogger(__name__)


def _leaves(path: str | None) -> dict[str, str] | None:
    if path is None:
        return None
    try:
        return parse_topology(Path(path).read_text(encoding="utf-8"), path).leaf_of()
    except OSError as exc:
        raise click.ClickException(f"{path}: cannot read ({exc.strerror})") from None
    except GpuwardenError as exc:
        raise click.ClickException(str(exc)) from None


def _seconds(text: str, option: str, positive: bool = False) -> float:
    """A duration option in seconds, exact; checked after conversion (0.1s is more than 0)."""
    v = parse_cost(text)
    if v < 0 or (positive and v <= 0):
        raise click.BadParameter(f"{text!r} is {v:g} s: must be "
                                 f"{'more than' if positive else 'at least'} 0 s",
                                 param_hint=option)
    return v


def _events_first(obj: Context, since: str | None, from_files: tuple[str, ...],
                  events_file: str | None) -> list[NodeEvent]:
    """The node events, read before the records so that the tally keeps only the failed runs
    an event can get blamed (`collect.Blamable`). The history reads them again itself."""
    if (from_files and since) or (events_file and not from_files):
        return []  # load_history says what is wrong
    try:
        if from_files:
            return read_events(events_file)
        now = datetime.now(UTC)
        span = parse_since(since or DEFAULT_SINCE, now)
        fmt = "%Y-%m-%dT%H:%M:%S"  # Slurm's, in UTC (the client runs it with TZ=UTC)
        # A day wider on each side than the history's own read: a superset only keeps more.
        events: list[NodeEvent] = obj.client().events(
            (now - span - timedelta(days=1)).strftime(fmt),
            (now + timedelta(days=1)).strftime(fmt))
        return events
    except ConfigError as exc:
        click.echo(f"gpuwarden: {exc}", err=True)
        sys.exit(2)
    except (GpuwardenError, OSError) as exc:
        raise click.ClickException(str(exc)) from None


def _store_events(store: str) -> list[NodeEvent]:
    """The node events a store keeps (as `_events_first` reads them for files)."""
    try:
        return store_events(store)
    except (GpuwardenError, OSError) as exc:
        raise click.ClickException(str(exc)) from None


def _gating(obj: Context) -> Gating:
    """The nodes' health markers, as `gpuwarden nodes` reads them (the live cluster only)."""
    now = datetime.now(UTC)
    try:
        nodes = obj.client().nodes()
    except (GpuwardenError, OSError) as exc:
        return Gating(False, f"could not read the nodes' health markers from Slurm: {exc}")
    return gating_of((of_node(n.name, n.extra, now.timestamp()) for n in nodes), now)


def _uid(user: str) -> int | None:
    """The uid of an accounting user name on this host (the admin host shares the cluster's
    users); None where it has no such user."""
    try:
        return pwd.getpwnam(user).pw_uid
    except (KeyError, ValueError):
        return None


# root, records, how many records were unreadable or malformed, whether a cap left some out
Read = tuple[str, list[restorelog.RestoreRecord], int, bool]


def _read_restores(given: str | None, configured: str) -> Read | None:
    """Every job's restore records under the shared tier, read before the history (whose
    pass then keeps those jobs' runs); None when there is no shared tier here (configured but
    not mounted where the report runs: said on the page). A root given on the command line
    that cannot be read is an error."""
    root = given or configured
    if not root:
        return None
    try:
        records, skipped = restorelog.read_records(root)
    except FileNotFoundError:
        if given:
            raise click.UsageError(f"--ckpt-root {given}: no such directory") from None
        log.warning("[ckpt] shared_root %s is not here: no restore times on the page", root)
        return None
    except (OSError, Refused) as exc:
        if given:
            raise click.UsageError(f"--ckpt-root {given}: {exc}") from None
        log.warning("[ckpt] shared_root %s: %s: no restore times on the page", root, exc)
        return None
    for s in skipped:
        log.warning("restore record %s left out: %s", s.where, s.why)
    return (root, records, sum(s.records for s in skipped if not s.capped),
            any(s.capped for s in skipped))


@dataclass(frozen=True)
class S3Site:
    """A site's restore records in S3 (no shared tier: `restorelog.S3RecordSink`), with what
    verifies them, and the jobs listed there before the history (whose pass then learns their
    users: `RunTally.watched_users`)."""

    place: restorelog_s3.Place
    site: list[tuple[str, bytes]] = field(repr=False)  # the site secret's keys
    cluster: str
    s3: Any = field(repr=False)
    jobs: list[str] = field(default_factory=list)
    skipped: list[restorelog.Skipped] = field(default_factory=list)


def _s3_client(place: restorelog_s3.Place) -> Any:
    return restorelog_s3.client(place)  # the tests' seam: a fake bucket


def _s3_site(given: bool | None, cfg: Config) -> S3Site | None:
    """The restore records in S3, listed before the history: with ``--ckpt-s3``, or by
    default on a site whose config keeps them there (``[ckpt] s3_bucket`` and ``key_file``, no
    ``shared_root``). None when not read: ``--ckpt-s3`` without what it needs is an error; for
    the config's default, or a bucket that cannot be listed, a warning saying what to check,
    and the report goes on without them."""
    c = cfg.ckpt
    if not (given if given is not None else c.s3_bucket and c.key_file and not c.shared_root):
        return None

    def refused(why: str) -> S3Site | None:
        if given:
            raise click.UsageError(f"--ckpt-s3: {why}")
        log.warning("restore records in S3: %s: none on the page", why)
        return None

    if not (c.s3_bucket and c.key_file):
        return refused("needs [ckpt] s3_bucket and key_file (the site secret each job's key "
                       "is derived from)")
    try:
        site = jobkey.load_site_keys(c.key_file)
    except jobkey.JobKeyError as exc:
        return refused(str(exc))
    place = restorelog_s3.Place(c.s3_bucket, c.s3_prefix, c.s3_endpoint)
    try:
        s3 = _s3_client(place)
    except ModuleNotFoundError as exc:
        return refused(f"needs {exc.name}: pip install 'gpuwarden[s3]'")
    try:
        jobs, skipped = restorelog_s3.list_jobs(s3, place,
                                                time.monotonic() + restorelog_s3.LIST_S)
    except restorelog_s3.S3ReadError as exc:
        log.warning("restore records: %s; the report goes on without them", exc)
        return None
    return S3Site(place, site, cfg.cluster.name, s3, jobs, skipped)


def _read_s3(src: S3Site | None, users: dict[int, set[str]]) -> Read | None:
    """The records of the listed jobs accounting names a user of (``users``: the tally's
    `watched_users`), each verified under that user's job key (`restorelog_s3`)."""
    if src is None:
        return None
    uids: dict[str, int | None] = {}
    owners: dict[int, restorelog_s3.Owners] = {}
    if any(users.get(int(j[len("job-"):])) for j in src.jobs):
        # Against jobuid's rule (a job's uid as Slurm's number): accounting records no uid.
        log.info("restore records in S3: each job's uid is its accounting user name's on "
                 "this host (accounting records no uid): a user renamed or renumbered since "
                 "the job ran has its records left out")
    for job in src.jobs:
        names = users.get(int(job[len("job-"):]))
        if not names:
            continue
        for n in names:
            if n not in uids:
                uids[n] = _uid(n)
        got = sorted({u for n in names if (u := uids[n]) is not None})
        shown = ", ".join(repr(n[:40]) for n in sorted(names)[:3])
        owners[int(job[len("job-"):])] = got or (
            f"accounting names user {shown} for it, with no uid on this host: its key cannot "
            "be derived")
    records, skipped = restorelog_s3.read_records(
        src.s3, src.place, src.jobs, owners, src.site, src.cluster,
        time.monotonic() + restorelog_s3.READ_S)
    skipped = [*src.skipped, *skipped]
    for s in skipped:
        log.warning("restore record %s left out: %s", s.where, s.why)
    return (str(src.place), records, sum(s.records for s in skipped if not s.capped),
            any(s.capped for s in skipped))


def _both(*reads: Read | None) -> Read | None:
    """The records of every place read, as one read (a site can hold both kinds: a shared
    tier now, S3 before)."""
    got = [r for r in reads if r is not None]
    if len(got) < 2:
        return got[0] if got else None
    return (" and ".join(r[0] for r in got), [x for r in got for x in r[1]],
            sum(r[2] for r in got), any(r[3] for r in got))


def _restores(read: Read | None, hist: Any) -> RestoreTimes | None:
    """The records in the history's span (its window, where the accounting named it)."""
    if read is None:
        return None
    root, records, skipped, capped = read
    att = hist.attribution
    lo, hi = hist.window or (att.first_start, att.last_end)
    inside = [r for r in records if lo <= r.at <= hi] if hi > lo else []
    return RestoreTimes(root, restorelog.per_tier(inside), skipped, inside, capped)


@click.command("report")
@LEMON.required
@REPORT.required
@history_options(
    since_help="how far back to read the live cluster: 30d, 12h, or a time (UTC) "
               "[default: 30d]",
    events_help="with --from: exported `sacctmgr show events` (drains, node failures)")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="the HTML file to write")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None,
              help="also write every figure of the page as JSON here")
@click.option("--ckpt-cost", default="30s", show_default=True,
              help="time one checkpoint stalls the job (C)")
@click.option("--ckpt-interval", default="1h", show_default=True,
              help="the site's checkpoint interval today (tau), for ETTR")
@click.option("--restart-cost", default="15m", show_default=True,
              help="requeue wait + restore per failure (u0), for ETTR")
@click.option("--restore-cost", default="5m", show_default=True,
              help="the restore inside the next run (r0), for failures whose requeue wait "
                   "accounting measured and no restore record did")
@click.option("--spares", default=1, show_default=True, type=click.IntRange(0, 64),
              help="hot-spare nodes per job in the redundancy tradeoff (k)")
@click.option("--spare-swap", default="2m", show_default=True,
              help="time for a hot spare to take over a failed node (s)")
@click.option("--gpus-per-node", default=8, show_default=True, type=click.IntRange(1, 1024))
@click.option("--topology", "topology", type=click.Path(dir_okay=False, exists=True),
              default=None, help="topology.conf, for gang jobs within one leaf switch")
@click.option("--ckpt-root", default=None, type=click.Path(file_okay=False),
              help="the checkpoints' shared tier, for restore times per tier "
                   "[default: [ckpt] shared_root, where it is mounted]")
@click.option("--ckpt-s3/--no-ckpt-s3", default=None,
              help="read the restore records jobs keep in S3 ([ckpt] s3_bucket, verified "
                   "with keys from [ckpt] key_file) [default: when there is no shared_root]")
@click.pass_obj
def report(obj: Context, since: str | None, from_files: tuple[str, ...], events_file: str | None,
           store: str | None, live: bool,
           output: str, json_out: str | None, ckpt_cost: str, ckpt_interval: str,
           restart_cost: str, restore_cost: str, spares: int, spare_swap: str, gpus_per_node: int,
           topology: str | None, ckpt_root: str | None, ckpt_s3: bool | None) -> None:
    """Where the site's GPU time went, and what four design choices would change: one
    self-contained HTML page from the site's own accounting."""
    interval = _seconds(ckpt_interval, "--ckpt-interval", positive=True)
    cost = _seconds(ckpt_cost, "--ckpt-cost")
    restart = _seconds(restart_cost, "--restart-cost")
    restore = _seconds(restore_cost, "--restore-cost")
    swap = _seconds(spare_swap, "--spare-swap")
    outputs = [output, *([json_out] if json_out else [])]
    try:
        check_distinct(outputs)
    except OutputError as exc:
        raise click.UsageError(str(exc)) from None
    cfg = obj.config_or_exit()
    leaves = _leaves(topology)
    lc = cfg.lemon
    where = store_of(obj, store, from_files, live)
    blamable = Blamable.of(_store_events(where) if where is not None
                           else _events_first(obj, since, from_files, events_file), lc.grace_s)
    read = _read_restores(ckpt_root, cfg.ckpt.shared_root)
    in_s3 = _s3_site(ckpt_s3, cfg)
    # Every job listed in S3 is watched, not only those restored after a restart: its user,
    # whose key verifies its records, is known only from accounting.
    watch = frozenset(r.job_id for r in (read[1] if read else ()) if r.restarts > 0) | \
        frozenset(int(j[len("job-"):]) for j in (in_s3.jobs if in_s3 else ()))
    hist = load_history(obj, since, from_files, events_file, lc.grace_s,
                        collector=RunTally.factory(leaves, blamable, watch), store=where,
                        live=live)
    tally = hist.collected
    read = _both(read, _read_s3(in_s3, tally.watched_users if isinstance(tally, RunTally)
                                else {}))
    opts = Options(
        source=("files: " + ", ".join(from_files)) if from_files
        else (f"the accounting store {where}" + (f", {since} back" if since else ""))
        if where is not None
        else f"the cluster's accounting, {since or DEFAULT_SINCE} back",
        gpus_per_node=gpus_per_node, ckpt_cost_s=cost, interval_s=interval,
        restart_s=restart, restore_s=restore, spares=spares, swap_s=swap, grace_s=lc.grace_s,
        have_topology=leaves is not None)
    draft = begin(hist, opts, gating=GATING if from_files or where is not None
                  else _gating(obj), restores=_restores(read, hist), uid_of=_uid)
    score_cfg = ScoreConfig(fdr=lc.fdr, min_failures=lc.min_failures, min_jobs=lc.min_jobs,
                            min_ratio=lc.min_ratio)
    # ``data``: the page's and the JSON's (a deep copy of the report: made once). Both files
    # are written before either is renamed into place, the JSON first; the JSON is made as
    # it is written, once the history (the attribution: GBs at a year) is let go.
    rep, data, html = page(draft, partial(scored, draft, hist, score_cfg))
    records = hist.records
    del hist, draft, tally
    files: list[tuple[str, Content]] = [(output, html)]
    if json_out:
        files.insert(0, (json_out, lambda: (as_json_bytes(rep, data), b"\n")))
    try:
        write_all(files)
    except OutputError as exc:
        raise click.ClickException(str(exc)) from None
    for w in rep.warnings:
        log.warning("%s", w)
    click.echo(f"wrote {output}" + (f" and {json_out}" if json_out else "")
               + f" ({records} job records)")
