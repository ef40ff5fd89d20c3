"""`gpuwarden lemon scan|list`: rank nodes by how much more often than the fleet they fail jobs,
drain the lemons under the blast-radius cap, and publish the list for the placement filter."""

from __future__ import annotations

import json
import sys
import time
from datetime import UTC, datetime
from typing import Any

import click

from gpuwarden.accounting import lemonlist as listfile
from gpuwarden.accounting.options import history_options, load_history
from gpuwarden.config.context import Context
from gpuwarden.core.errors import GpuwardenError
from gpuwarden.core.extras import Needs
from gpuwarden.lemon import promfile

# numpy (the joint attribution): `lemon list` and every --help work on the base install.
with Needs("lemon") as LEMON:
    from gpuwarden.accounting.mttf import class_mttf_h
    from gpuwarden.lemon.drain import Outcome, drain_lemons
    from gpuwarden.lemon.scoring import NodeScore, ScoreConfig, score


def _row(s: NodeScore) -> dict[str, Any]:
    return {
        "node": s.node, "lemon": s.lemon, "jobs": s.jobs, "hours": round(s.hours, 2),
        "failures": s.failures, "blame": round(s.blame, 3), "expected": round(s.expected, 3),
        "attributed": round(s.attributed, 3), "explanation": s.explanation,
        "fleet_rate": s.fleet_rate, "p_value": s.p_value, "q_value": s.q_value,
        "summary": s.summary if s.lemon else "",
        "evidence": [{"job_id": b.job_id, "at": b.at, "reason": b.reason, "weight": b.weight}
                     for b in s.evidence],
    }


@click.group("lemon")
def lemon() -> None:
    """Find nodes that fail jobs far more often than the fleet (Slurm accounting)."""


@lemon.command("scan")
@LEMON.required
@history_options(
    since_help="how far back to read accounting: 90m, 12h, 30d, 2w, or a time "
               "(2026-11-29T12:00:00, UTC unless it gives an offset) [default: 30d]",
    from_help="scan exported `sacct --json` output (a file, or a directory of *.json) "
              "instead of asking the cluster (repeatable)",
    events_help="with --from: exported `sacctmgr -P -n show events format=Cluster,NodeName,"
                "TimeStart,TimeEnd,State,Reason,User`")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--drain", is_flag=True,
              help="drain the lemons (under the blast-radius cap; never over another drain)")
@click.option("--write-list", is_flag=True,
              help="publish the lemons to [lemon] list_file for the placement filter "
                   "(--drain does this too)")
@click.option("--fdr", type=float, default=None, help="false discovery rate [config: 0.01]")
@click.option("--min-failures", type=int, default=None)
@click.option("--min-jobs", type=int, default=None)
@click.option("--all", "show_all", is_flag=True, help="list every node, not only suspects")
@click.pass_obj
def scan(obj: Context, since: str | None, from_files: tuple[str, ...], events_file: str | None,
         store: str | None, live: bool,
         as_json: bool, drain: bool, write_list: bool, fdr: float | None,
         min_failures: int | None, min_jobs: int | None, show_all: bool) -> None:
    """Rank nodes by failures against what the fleet's rate predicts for their exposure."""
    cfg = obj.config_or_exit()
    if (drain or write_list) and from_files:
        raise click.UsageError("--drain and --write-list act on the live cluster: not with --from")
    lc = cfg.lemon
    hist = load_history(obj, since, from_files, events_file, lc.grace_s,
                        store=store, live=live)
    att = hist.attribution
    sc = ScoreConfig(fdr=fdr if fdr is not None else lc.fdr,
                     min_failures=min_failures if min_failures is not None else lc.min_failures,
                     min_jobs=min_jobs if min_jobs is not None else lc.min_jobs,
                     min_ratio=lc.min_ratio)
    scores = score(att, sc)
    lemons = [s for s in scores if s.lemon]
    outcomes: dict[str, Outcome] = {}
    if drain:
        client = obj.client()
        outcomes = {o.node: o for o in drain_lemons(lemons, client, cfg.health.blast_radius)}
    if drain or write_list:
        entries = [listfile.LemonEntry(s.node, s.summary, s.failures, s.jobs, s.q_value,
                                       outcomes[s.node].action if s.node in outcomes
                                       else "not asked to drain") for s in lemons]
        try:
            listfile.write(lc.list_file, entries)
        except OSError as exc:
            raise click.ClickException(f"{lc.list_file}: cannot write the lemon list "
                                       f"({exc.strerror}); run as root or set [lemon] "
                                       "list_file") from None
    shown = scores if show_all else [s for s in scores if s.lemon or (s.failures > s.expected * 2
                                     and s.failures >= sc.min_failures)]
    skipped = dict(att.skipped)
    failed = [o for o in outcomes.values() if o.action == "error"]
    # Only the scan that acts (the timer's `--drain`) is the one the series describe: a look
    # by hand (the runbooks' own) must not set held back to 0 nor pass for a scan working.
    if cfg.health.prom_dir and drain:
        _publish(cfg.health.prom_dir, cfg.health.state_dir, not failed, len(lemons),
                 [o.action for o in outcomes.values()], class_mttf_h(att))
    if as_json:
        click.echo(json.dumps({
            "records": hist.records, "skipped": skipped, "nodes": [_row(s) for s in shown],
            "drain": [o.__dict__ for o in outcomes.values()]}, indent=2))
        if failed:
            sys.exit(1)
        return
    rate = scores[0].fleet_rate if scores else 0.0
    click.echo(f"{hist.records} job records, {len(att.exposure)} nodes, fleet failure rate "
               f"{100 * rate:.2f}% per node-run; {len(lemons)} lemon(s)")
    for why, n in sorted(skipped.items()):
        click.echo(f"  skipped {n}: {why}")
    if not lemons:
        click.echo(f"no lemons among {len(att.exposure)} nodes ({hist.records} jobs)")
    if shown:
        _table(shown, outcomes)
    if failed:
        click.echo(f"gpuwarden: {len(failed)} lemon drain(s) failed: "
                   + "; ".join(f"{o.node}: {o.detail}" for o in failed), err=True)
        sys.exit(1)


def _publish(prom_dir: str, state_dir: str, clean: bool, flagged: int, actions: list[str],
             mttf_h: dict[int, float]) -> None:
    """The scan's textfile (a `--drain` scan of the live cluster, never of exported files):
    a failure to write it is said on stderr, and the scan's result stands."""
    try:
        reset = promfile.publish(prom_dir, state_dir, time.time(), clean, flagged, actions,
                                 mttf_h)
    except (GpuwardenError, OSError) as exc:
        click.echo(f"gpuwarden: {promfile.FILE} not written: {exc}", err=True)
        return
    if reset:
        click.echo(f"gpuwarden: {promfile.COUNTS}: {reset}: the lemon drain count starts "
                   "again from 0", err=True)


def _table(shown: list[NodeScore], outcomes: dict[str, Outcome]) -> None:
    click.echo("FAILED: failed runs that included the node; ATTRIB: failures the joint fit puts "
               "on it; FLEET x H: the fleet's failure rate per node-hour x its node-hours")
    click.echo(f"{'NODE':<10} {'JOBS':>6} {'FAILED':>6} {'ATTRIB':>6} {'FLEET x H':>9} "
               f"{'Q':>9}  VERDICT")
    for s in shown:
        verdict = s.summary if s.lemon else "-"
        click.echo(f"{s.node:<10} {s.jobs:>6} {s.failures:>6} {s.attributed:>6.1f} "
                   f"{s.expected:>9.2f} {s.q_value:>9.2e}  {verdict}")
        if s.explanation:
            click.echo(f"{'':<12}why: {s.explanation}")
        if s.node in outcomes:
            o = outcomes[s.node]
            click.echo(f"{'':<12}--drain: {o.action}: {o.detail}")
        if s.lemon:
            for b in s.evidence[:5]:
                when = datetime.fromtimestamp(b.at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                job = f"job {b.job_id}" if b.job_id is not None else "no job"
                click.echo(f"{'':<12}{when}  {job}: {b.reason}")
            if len(s.evidence) > 5:
                click.echo(f"{'':<12}(+{len(s.evidence) - 5} more; --json lists all)")


@lemon.command("list")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.pass_obj
def list_cmd(obj: Context, as_json: bool) -> None:
    """The published lemon list (what the placement filter keeps jobs away from)."""
    path = obj.config_or_exit().lemon.list_file
    try:
        current = listfile.read(path)
    except GpuwardenError as exc:
        raise click.ClickException(str(exc)) from None
    states = _states(obj, current.nodes)
    if as_json:
        click.echo(json.dumps({"generated_at": current.generated_at,
                               "nodes": [{**e.__dict__, "state": states.get(e.node)}
                                         for e in current.entries]}, indent=2))
        return
    age = time.time() - current.generated_at
    click.echo(f"{path}: {len(current.entries)} lemon(s), written {age / 60:.0f} min ago")
    for e in current.entries:
        click.echo(f"{e.node:<10} {e.summary}  [{listfile.status(e, states.get(e.node))}]")


def _states(obj: Context, nodes: tuple[str, ...]) -> dict[str, str]:
    """Each listed node's state now (the list says what --drain did then; an operator may have
    resumed the node since). Unreadable: said once, and the list shown as written."""
    if not nodes:
        return {}
    try:
        view = obj.client().out_of_service(also=nodes)
    except GpuwardenError as exc:
        click.echo(f"gpuwarden: node states unknown ({exc}); showing what the scan did", err=True)
        return {}
    out = {n.name: (listfile.IN_SERVICE if not n.unavailable else n.state_text)
           for n in view.nodes}
    return {n: out.get(n, "not known to slurmctld") for n in nodes}
