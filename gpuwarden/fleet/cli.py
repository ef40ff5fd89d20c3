"""`gpuwarden fleet mttf` and `gpuwarden simulate`."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from gpuwarden.accounting.calibrate import CalibrationError, PaperFigures, solve
from gpuwarden.accounting.options import history_options, load_history, parse_cost, progress
from gpuwarden.config.context import Context
from gpuwarden.core.extras import Needs
from gpuwarden.fleet.simulate import Fleet, write_history

# numpy (the joint attribution): the base install still lists and explains these commands.
with Needs("lemon") as LEMON:
    from gpuwarden.accounting.mttf import human_hours, report
    from gpuwarden.fleet.compare import compare
    from gpuwarden.fleet.spares import payoff

def parse_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected GPU counts like 16384,131072") from None
    if not sizes or min(sizes) <= 0:
        raise click.BadParameter(f"{text!r}: expected positive GPU counts")
    return sizes


@click.group("fleet")
def fleet() -> None:
    """Fleet reliability from the site's own accounting."""


@fleet.command("mttf")
@LEMON.required
@history_options(
    events_help="with --from: exported `sacctmgr show events` (for the node failure rate)")
@click.option("--ckpt-cost", default="30s", show_default=True,
              help="time one checkpoint stalls the job")
@click.option("--project", "project_to", default="16384,131072", show_default=True,
              help="job sizes (GPUs) to project the MTTF to")
@click.option("--gpus-per-node", default=8, show_default=True)
@click.option("--spares", default=1, show_default=True, type=click.IntRange(1, 64),
              help="hot-spare nodes per job (k) whose pay-off is shown per multi-node size")
@click.option("--restart-cost", default="15m", show_default=True,
              help="u0: a requeue's wait plus restore, per failure")
@click.option("--spare-swap", default="2m", show_default=True,
              help="s: a hot spare's take-over, per failure")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def mttf(obj: Context, since: str | None, from_files: tuple[str, ...], events_file: str | None,
         store: str | None, live: bool,
         ckpt_cost: str, project_to: str, gpus_per_node: int, spares: int, restart_cost: str,
         spare_swap: str, as_json: bool) -> None:
    """MTTF by job size, its 1/N projection, the Young/Daly checkpoint interval, and whether
    k hot spares per job pay off at each size."""
    cost = parse_cost(ckpt_cost)
    sizes = parse_sizes(project_to)
    restart, swap = parse_cost(restart_cost), parse_cost(spare_swap)
    grace = obj.config_or_exit().lemon.grace_s
    hist = load_history(obj, since, from_files, events_file, grace,
                        store=store, live=live, mttf_only=True)
    rep = report(hist.attribution, hist.events, gpus_per_node, cost, sizes, windows=hist.windows,
                 grace_s=grace)
    pays = spare_rows(rep, spares, gpus_per_node, restart, swap)
    if as_json:
        click.echo(json.dumps({"records": hist.records, "window_note": hist.window_note,
                               **asdict(rep),
                               "spares": {"k": spares, "restart_s": restart, "swap_s": swap,
                                          "sizes": pays}}, indent=2, default=str))
        return
    click.echo("\n".join([hist.window_note, *mttf_lines(hist.records, rep, gpus_per_node),
                          *spare_lines(pays, spares, restart, swap)]))


def spare_rows(rep: Any, spares: int, gpus_per_node: int, restart_s: float,
               swap_s: float) -> list[dict[str, Any]]:
    """Per multi-node size class of ``rep`` (an `mttf.MttfReport`): what k spares cost and
    save (`fleet.spares.payoff`)."""
    out = []
    for c in rep.classes:
        mean_gpus = c.gpu_hours / c.hours if c.hours > 0 else 0.0
        p = payoff(max(1, c.gpus // gpus_per_node), c.hours, c.failures, mean_gpus, spares,
                   gpus_per_node, restart_s / 3600, swap_s / 3600)
        if p is not None:
            out.append({"gpus": c.gpus, "failures": c.failures,
                        "idle_gpu_h": round(p.idle_gpu_h, 1),
                        "requeue_lost_gpu_h": round(p.requeue_lost_gpu_h, 1), "pays": p.pays})
    return out


def spare_lines(rows: list[dict[str, Any]], spares: int, restart_s: float,
                swap_s: float) -> list[str]:
    if not rows:
        return ["hot spares: no multi-node job size in this history"]
    out = [f"HOT SPARES, k={spares} per job (a requeue costs u0={restart_s:g} s, a spare's "
           f"take-over s={swap_s:g} s; the work since the last checkpoint is lost either way)",
           f"{'SIZE':>6} {'FAILED':>6} {'SPARES IDLE GPU-H':>18} {'REQUEUES LOSE GPU-H':>20} "
           f"{'PAY OFF':>8}"]
    out += [f"{'<=' + str(r['gpus']):>6} {r['failures']:>6} {r['idle_gpu_h']:>18.1f} "
            f"{r['requeue_lost_gpu_h']:>20.1f} {'yes' if r['pays'] else 'no':>8}" for r in rows]
    return out


_PAPER = "Meta (paper)"


def mttf_lines(records: int, rep: Any, gpus_per_node: int) -> list[str]:
    """`fleet mttf`'s text: the site's figures, with Meta's published ones beside them where
    the paper gives one. ``rep`` is an `mttf.MttfReport`."""
    fig = rep.paper
    out = [f"{records} job records; failures are those the attribution rules blame on the "
           "infrastructure (docs/lemons.md)",
           f"{'GPUS':>6} {'RUNS':>7} {'JOB-HOURS':>10} {'FAILED':>6} {'RATE':>6} {'MTTF':>9} "
           f"{'YOUNG':>9} {'DALY':>9} {_PAPER.upper():>13}   (checkpoint cost "
           f"{rep.ckpt_cost_s:g} s)"]
    for c in rep.classes:
        paper = human_hours(c.paper_mttf_h) if c.paper_mttf_h is not None else ""
        out.append(f"{'<=' + str(c.gpus):>6} {c.runs:>7} {c.hours:>10.1f} {c.failures:>6} "
                   f"{100 * c.failure_rate:>5.1f}% {human_hours(c.mttf_h):>9} "
                   f"{human_hours(c.young_h):>9} {human_hours(c.daly_h):>9} {paper:>13}"
                   .rstrip())
    if rep.gpuless_runs:
        out.append(f"left out: {rep.gpuless_runs} runs without GPUs in accounting "
                   f"({rep.gpuless_failures} of them blamed on the infrastructure); if they "
                   "had GPUs, Slurm records them only with AccountingStorageTRES=gres/gpu")
    if rep.big_runs:
        out.append(f"runs of >=512 GPUs (classes <=512 and up): {rep.big_failures} of "
                   f"{rep.big_runs} failed ({100 * rep.big_failures / rep.big_runs:.1f}%); "
                   f"{_PAPER}: {100 * fig.big_fail_with_lemons:.0f}% with lemons in service, "
                   f"{100 * fig.big_fail_without_lemons:.0f}% with them drained")
    if rep.node_days < 30 or (rep.node_failures and rep.node_rate is None):
        out.append(f"node failure rate r_f: too little history ({rep.node_days:.1f} node-days, "
                   f"{rep.node_failures} health-gating drains; a rate needs months of node "
                   "time)")
    elif rep.node_rate:
        out.append(f"node failure rate r_f: {rep.node_failures} health-gating drains in "
                   f"{rep.node_days:.0f} node-days = {1000 * rep.node_rate:.2f} per 1000 "
                   f"node-days; {_PAPER}: {1000 * fig.node_rate:.2f}, implied by its "
                   f"{fig.projection_16k_h:g} h projection at 16,384 GPUs")
    else:
        out.append("node failure rate r_f: no health-gating drains in this history")
    if rep.node_failures:
        out.append(rep.drains_note)
    if rep.insufficient and rep.node_rate is None:
        return [*out, f"projected MTTF (1/N): {rep.insufficient}"]
    out.append(f"{'PROJECTED MTTF (1/N)':<20} {'FROM r_f':>9} {'FROM JOB FAILURES':>18} "
               f"{_PAPER.upper():>13}")
    for pr in rep.projections:
        paper = human_hours(pr.paper_h) if pr.paper_h is not None else ""
        out.append(f"{f'{pr.gpus} GPUs':>20} {human_hours(pr.from_node_rate_h):>9} "
                   f"{human_hours(pr.from_history_h):>18} {paper:>13}".rstrip())
    out.append(f"FROM r_f: N/{gpus_per_node} nodes at the node failure rate r_f (the paper's "
               "method); FROM JOB FAILURES: the pooled per-GPU rate of the runs above"
               + (f" ({rep.insufficient})" if rep.insufficient else ""))
    out.append(f"{_PAPER}: Kokolis et al., \"Revisiting Reliability in Large-Scale ML Research "
               "Clusters\" (2024): 11 months, >150M A100 GPU-hours")
    return out


def _simulate(nodes: int, days: int, seed: int, lemon_fraction: float, records: int | None,
              out: str | None, do_compare: bool, seeds: int) -> None:
    if nodes < 128 or days < 1 or not 0 <= lemon_fraction < 0.5 or seeds < 1:
        raise click.UsageError("need --nodes >= 128 (a 1024-GPU job), --days >= 1, "
                               "--lemon-fraction in [0, 0.5), --seeds >= 1")
    try:
        params = solve(PaperFigures(lemon_fraction=lemon_fraction))
    except CalibrationError as exc:
        raise click.ClickException(f"calibration: {exc}") from None
    click.echo(f"calibrated: normal nodes {1000 * params.normal_rate:.2f}, transient "
               f"{1000 * params.transient_rate:.2f}, lemons {1000 * params.lemon_rate:.0f} "
               f"failures per 1000 busy node-days ({100 * params.lemon_detected:.0f}% of a "
               f"lemon's caught by health checks); fabric {1000 * params.fabric_rate:.2f} per "
               f"extra node; >=512-GPU runs last {params.mix[-1].mean_hours:.2f} h on average")
    if out:
        w = write_history(params, Fleet(nodes=nodes, days=days, seed=seed, records=records),
                          Path(out), progress("writing day"))
        click.echo(f"wrote {w.records} job records in {len(w.files)} files, {w.events.name} and "
                   f"{w.truth.name} ({len(w.lemons)} lemons) to {out}")
        click.echo(f"scan it: gpuwarden lemon scan --from {out}/sacct --events {w.events}")
    if do_compare:
        rows = compare(params, nodes, days, seeds, PaperFigures(lemon_fraction=lemon_fraction),
                       say=lambda s: click.echo(s, err=True))
        click.echo(f"\n{nodes} nodes x {days} days, {seeds} seed(s) pooled")
        click.echo(f"{'FIGURE':<52} {'PAPER':>22} {'SIMULATED':>12}")
        for r in rows:
            click.echo(f"{r.figure:<52} {r.paper:>22} {r.simulated:>12}")


@click.command("simulate")
@LEMON.required
@click.option("--nodes", default=2000, show_default=True)
@click.option("--days", default=30, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--lemon-fraction", default=0.012, show_default=True)
@click.option("--records", type=int, default=None,
              help="job records to make (default: as many as keep 90% of the fleet busy)")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="write the history here (sacct/dayNNN.json, events.txt, truth.json)")
@click.option("--compare/--no-compare", "do_compare", default=True, show_default=True,
              help="simulate, scan and set the measured figures beside the paper's")
@click.option("--seeds", default=3, show_default=True, help="fleets pooled in --compare")
def simulate(**kwargs: Any) -> None:
    """A fleet and its job history, calibrated to Meta's published reliability figures."""
    _simulate(**kwargs)
