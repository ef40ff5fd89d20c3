"""`gpuwarden lemon scan`: rank nodes by how much more often than the fleet they fail jobs."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import click

from gpuwarden.errors import ConfigError, GpuwardenError, SlurmError
from gpuwarden.lemon.attribution import attribute, health_drains
from gpuwarden.lemon.scoring import NodeScore, ScoreConfig, score
from gpuwarden.slurm import parse
from gpuwarden.slurm.models import AcctJob, NodeEvent

_SPAN = re.compile(r"^(\d+)([hdw])$")
_UNITS = {"h": 3600, "d": 86_400, "w": 604_800}
_SLURM_TIME = "%Y-%m-%dT%H:%M:%S"


def parse_span(text: str) -> timedelta:
    m = _SPAN.match(text.strip())
    if not m:
        raise click.BadParameter(f"{text!r}: expected a span like 12h, 30d or 2w")
    return timedelta(seconds=int(m.group(1)) * _UNITS[m.group(2)])


def _from_files(paths: tuple[str, ...], skipped: dict[str, int]) -> Iterator[AcctJob]:
    for p in paths:
        try:
            text = Path(p).read_text(encoding="utf-8", errors="replace")
            records = list(parse.iter_acct_jobs(text))
        except (OSError, SlurmError) as exc:
            raise click.ClickException(f"{p}: {exc} (expected `sacct --json` output)") from None
        for r in records:
            if isinstance(r, AcctJob):
                yield r
            else:
                skipped[f"{p}: malformed record"] = skipped.get(f"{p}: malformed record", 0) + 1


def _from_cluster(client: Any, since: timedelta, skipped: dict[str, int]) -> Iterator[AcctJob]:
    """One day per sacct call, so a long scan never asks slurmdbd for everything at once."""
    end = datetime.now(UTC).replace(microsecond=0)
    start = end - since
    while start < end:
        stop = min(start + timedelta(days=1), end)
        for r in client.acct_jobs(start.strftime(_SLURM_TIME), stop.strftime(_SLURM_TIME)):
            if isinstance(r, AcctJob):
                yield r
            else:
                skipped["malformed record"] = skipped.get("malformed record", 0) + 1
        start = stop


def _row(s: NodeScore) -> dict[str, Any]:
    return {
        "node": s.node, "lemon": s.lemon, "jobs": s.jobs, "hours": round(s.hours, 2),
        "failures": s.failures, "blame": round(s.blame, 3), "expected": round(s.expected, 3),
        "fleet_rate": s.fleet_rate, "p_value": s.p_value, "q_value": s.q_value,
        "evidence": [{"job_id": b.job_id, "at": b.at, "reason": b.reason, "weight": b.weight}
                     for b in s.evidence],
    }


@click.group("lemon")
def lemon() -> None:
    """Find nodes that fail jobs far more often than the fleet (Slurm accounting)."""


@lemon.command("scan")
@click.option("--since", "since", default="30d", show_default=True,
              help="how far back to read accounting (12h, 30d, 2w)")
@click.option("--from", "from_files", multiple=True, type=click.Path(dir_okay=False),
              help="scan exported `sacct --json` output instead of asking the cluster "
                   "(repeatable)")
@click.option("--events", "events_file", type=click.Path(dir_okay=False), default=None,
              help="exported `sacctmgr -P -n show events format=Cluster,NodeName,TimeStart,"
                   "TimeEnd,State,Reason,User`")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--fdr", default=0.01, show_default=True, help="false discovery rate")
@click.option("--min-failures", default=3, show_default=True)
@click.option("--min-jobs", default=10, show_default=True)
@click.option("--all", "show_all", is_flag=True, help="list every node, not only suspects")
@click.pass_obj
def scan(obj: Any, since: str, from_files: tuple[str, ...], events_file: str | None,
         as_json: bool, fdr: float, min_failures: int, min_jobs: int, show_all: bool) -> None:
    """Rank nodes by failures against what the fleet's rate predicts for their exposure."""
    span = parse_span(since)
    skipped: dict[str, int] = {}
    try:
        if from_files:
            jobs = list(_from_files(from_files, skipped))
            events: list[NodeEvent] = []
            if events_file:
                events = parse.parse_events(Path(events_file).read_text(errors="replace"))
        else:
            client = obj.client()
            jobs = list(_from_cluster(client, span, skipped))
            now = datetime.now(UTC)
            events = client.events((now - span).strftime(_SLURM_TIME), now.strftime(_SLURM_TIME))
    except ConfigError as exc:
        click.echo(f"gpuwarden: {exc}", err=True)
        sys.exit(2)
    except (GpuwardenError, OSError) as exc:
        raise click.ClickException(str(exc)) from None
    att = attribute(jobs, health_drains(events))
    for why, n in att.skipped.items():
        skipped[why] = skipped.get(why, 0) + n
    scores = score(att, ScoreConfig(fdr=fdr, min_failures=min_failures, min_jobs=min_jobs))
    shown = scores if show_all else [s for s in scores if s.lemon or s.failures > s.expected * 2]
    if as_json:
        click.echo(json.dumps({"records": len(jobs), "skipped": skipped,
                               "nodes": [_row(s) for s in shown]}, indent=2))
        return
    lemons = [s for s in scores if s.lemon]
    click.echo(f"{len(jobs)} job records, {len(att.exposure)} nodes, "
               f"fleet failure rate {100 * (scores[0].fleet_rate if scores else 0):.2f}% per "
               f"node-run; {len(lemons)} lemon(s)")
    for why, n in sorted(skipped.items()):
        click.echo(f"  skipped {n}: {why}")
    click.echo(f"{'NODE':<10} {'JOBS':>6} {'FAILED':>6} {'EXPECTED':>8} {'Q':>9}  VERDICT")
    for s in shown:
        verdict = s.summary if s.lemon else "-"
        click.echo(f"{s.node:<10} {s.jobs:>6} {s.failures:>6} {s.expected:>8.2f} "
                   f"{s.q_value:>9.2e}  {verdict}")
        if s.lemon:
            for b in s.evidence[:5]:
                when = datetime.fromtimestamp(b.at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                job = f"job {b.job_id}" if b.job_id is not None else "no job"
                click.echo(f"{'':<12}{when}  {job}: {b.reason}")
            if len(s.evidence) > 5:
                click.echo(f"{'':<12}(+{len(s.evidence) - 5} more)")
