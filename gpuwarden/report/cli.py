"""`gpuwarden report`: the fleet reliability report, one HTML file (and its JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from gpuwarden.errors import GpuwardenError
from gpuwarden.extras import Needs
from gpuwarden.fleet.cli import parse_cost
from gpuwarden.lemon.cli import load_history
from gpuwarden.placement.topology import parse as parse_topology

# numpy (the attribution and lemon scoring), then matplotlib (the charts): the base install
# still lists and explains the command.
with Needs("lemon") as LEMON:
    from gpuwarden.lemon.scoring import ScoreConfig
    from gpuwarden.report.build import Options, as_json, build
    from gpuwarden.report.collect import RunTally
with Needs("report") as REPORT:
    from gpuwarden.report.render import render


def _leaves(path: str | None) -> dict[str, str] | None:
    if path is None:
        return None
    try:
        return parse_topology(Path(path).read_text(encoding="utf-8"), path).leaf_of()
    except OSError as exc:
        raise click.ClickException(f"{path}: cannot read ({exc.strerror})") from None
    except GpuwardenError as exc:
        raise click.ClickException(str(exc)) from None


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise click.ClickException(f"{path}: cannot write ({exc.strerror})") from None


@click.command("report")
@LEMON.required
@REPORT.required
@click.option("--since", default=None,
              help="how far back to read the live cluster: 30d, 12h, or a time (UTC) "
                   "[default: 30d]")
@click.option("--from", "from_files", multiple=True, type=click.Path(exists=True),
              help="exported `sacct --json` output (a file, or a directory of *.json) instead "
                   "of the cluster (repeatable)")
@click.option("--events", "events_file", type=click.Path(dir_okay=False), default=None,
              help="with --from: exported `sacctmgr show events` (drains, node failures)")
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
@click.option("--spares", default=1, show_default=True, type=click.IntRange(0, 64),
              help="hot-spare nodes per job in the redundancy tradeoff (k)")
@click.option("--spare-swap", default="2m", show_default=True,
              help="time for a hot spare to take over a failed node (s)")
@click.option("--gpus-per-node", default=8, show_default=True, type=click.IntRange(1, 1024))
@click.option("--topology", "topology", type=click.Path(dir_okay=False, exists=True),
              default=None, help="topology.conf, for gang jobs within one leaf switch")
@click.pass_obj
def report(obj: Any, since: str | None, from_files: tuple[str, ...], events_file: str | None,
           output: str, json_out: str | None, ckpt_cost: str, ckpt_interval: str,
           restart_cost: str, spares: int, spare_swap: str, gpus_per_node: int,
           topology: str | None) -> None:
    """Where the site's GPU time went, and what four design choices would change: one
    self-contained HTML page from the site's own accounting."""
    interval = parse_cost(ckpt_interval)
    if interval <= 0:
        raise click.BadParameter("must be more than 0", param_hint="--ckpt-interval")
    cfg = obj.config_or_exit()
    leaves = _leaves(topology)
    hist = load_history(obj, since, from_files, events_file, cfg.lemon.grace_s,
                        collector=RunTally.factory(leaves))
    lc = cfg.lemon
    opts = Options(
        source=("files: " + ", ".join(from_files)) if from_files
        else f"the cluster's accounting, {since or '30d'} back",
        gpus_per_node=gpus_per_node, ckpt_cost_s=parse_cost(ckpt_cost),
        interval_h=interval / 3600, restart_h=parse_cost(restart_cost) / 3600, spares=spares,
        swap_h=parse_cost(spare_swap) / 3600, grace_s=lc.grace_s,
        have_topology=leaves is not None)
    rep = build(hist, opts, ScoreConfig(fdr=lc.fdr, min_failures=lc.min_failures,
                                        min_jobs=lc.min_jobs, min_ratio=lc.min_ratio))
    _write(output, render(rep))
    if json_out:
        _write(json_out, as_json(rep) + "\n")
    click.echo(f"wrote {output}" + (f" and {json_out}" if json_out else "")
               + f" ({hist.records} job records)")
