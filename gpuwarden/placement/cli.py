"""`gpuwarden placement daemon|explain`."""

from __future__ import annotations

import sys
import time

import click

from gpuwarden import config as configmod
from gpuwarden.config.context import Context
from gpuwarden.core import safefs
from gpuwarden.core.errors import GpuwardenError
from gpuwarden.placement import daemon, reload, snapshot
from gpuwarden.placement.advice import advise
from gpuwarden.placement.decide import JobRequest, decide


def _snapshot_age(path: str, stale_after_s: int) -> str:
    """What the filter itself sees now: explain decides on fresh state, the filter on the file."""
    unsafe = safefs.admin_file_problem(path)
    if unsafe and not unsafe.endswith(" is missing"):
        return (f"the filter refuses its snapshot: {unsafe}; it lets every job through "
                "unchanged")
    try:
        written, lines = snapshot.read_head(path)
    except (OSError, ValueError):
        return (f"the filter's snapshot {path} is missing or unreadable: it lets every job "
                "through unchanged (is `gpuwarden placement daemon` running?)")
    age = time.time() - written
    state = "stale: the filter lets every job through unchanged" if age > stale_after_s else "fresh"
    _, refused, why = lines[1].partition(daemon.REFUSED) if len(lines) > 2 else ("", "", "")
    note = f"\nthe daemon refused a change of its config file:{why}" if refused else ""
    return f"the filter's snapshot {path}: written {age:.0f} s ago ({state}){note}"


def _node_range(text: str) -> tuple[int, int]:
    """sbatch -N's "4" or "2-8" as (min, max); sbatch sets max to min for a plain count."""
    lo, dash, hi = text.partition("-")
    try:
        low = int(lo)
        high = int(hi) if dash else low
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected N or MIN-MAX", param_hint="-N") from None
    if not 1 <= low <= high:
        raise click.BadParameter(f"{text!r}: expected 1 <= MIN <= MAX", param_hint="-N")
    return low, high


@click.group("placement")
def placement() -> None:
    """Gang-aware topology placement (the job_submit.lua filter and its daemon)."""


@placement.command("daemon")
@click.option("--once", is_flag=True, help="write one snapshot and exit (1 if it failed)")
@click.pass_obj
def daemon_cmd(obj: Context, once: bool) -> None:
    """Keep the filter's snapshot current (run on the slurmctld host, as root). The config
    file is re-read when it changes and on SIGHUP (`systemctl reload gpuwarden-placement`);
    a change that does not validate is refused and logged, and the running settings stay."""
    cfg = obj.config_or_exit()
    # Its metrics go where node_exporter reads this host's: `[health] prom_dir`.
    prom = cfg.health.prom_dir
    if once:
        sys.exit(daemon.run(cfg.placement, obj.client, cfg.lemon.list_file, once=True,
                            prom_dir=prom))
    reloader = reload.Reloader(configmod.config_path(obj.config_path), cfg)
    reload.install_sighup(reloader)
    # A new client each round, from the config now running ([slurm] changes apply too).
    sys.exit(daemon.run(cfg.placement, lambda: obj.client_for(reloader.running),
                        cfg.lemon.list_file, reload=reloader, prom_dir=prom))


@placement.command("explain")
@click.option("-N", "--nodes", "nodes", required=True, help="as sbatch -N: N or MIN-MAX")
@click.option("--gpus-per-node", type=click.IntRange(min=0), default=8, show_default=True)
@click.option("--gpus", "gpus_per_job", type=click.IntRange(min=0), default=0,
              help="as sbatch --gpus")
@click.option("-p", "--partition", default="", help="as sbatch -p (default: the default one)")
@click.option("--switches", type=click.IntRange(min=1), default=None, help="as sbatch --switches")
@click.option("-w", "--nodelist", default="", help="as sbatch --nodelist")
@click.option("-x", "--exclude", default="", help="as sbatch --exclude")
@click.option("--contiguous", is_flag=True)
@click.pass_obj
def explain(obj: Context, nodes: str, gpus_per_node: int, gpus_per_job: int, partition: str,
            switches: int | None, nodelist: str, exclude: str, contiguous: bool) -> None:
    """What the filter would do to such a job now, and why (reservations not counted)."""
    min_nodes, max_nodes = _node_range(nodes)
    cfg = obj.config_or_exit()
    state = daemon.State()
    try:
        snap = daemon.build_once(cfg.placement, obj.client(), cfg.lemon.list_file, state,
                                 time.time())
    except GpuwardenError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(_snapshot_age(cfg.placement.snapshot_file, cfg.placement.stale_after_s))
    job = JobRequest(min_nodes, gpus_per_node > 0 or gpus_per_job > 0, partition, switches,
                     nodelist, exclude, contiguous, max_nodes=max_nodes,
                     gpus_per_job=gpus_per_job, gpus_per_node=gpus_per_node)
    d = decide(snap, job)
    part = partition or snap.default_partition
    view = snap.partitions.get(part)
    if view is not None:
        click.echo(f"partition {part}: {view.size} nodes, {view.in_service} in service, "
                   f"{view.healthy} healthy in {len(view.capacity)} "
                   f"{'leaf switches' if snap.kind == 'tree' else 'blocks'} "
                   f"(per leaf: {', '.join(map(str, view.capacity)) or 'none'}); policy "
                   f"{view.policy.mode}, wait {view.policy.wait_s} s"
                   f"{', shadow' if view.policy.shadow else ''}")
        for node in view.exclude:
            click.echo(f"  avoid {node}: {snap.why.get(node, '?')}")
    verb = {"place": "would set", "shadow": "shadow mode: would only log", "pass": "leaves it"}
    click.echo(f"decision: {verb[d.action]}: {d.why or 'unchanged'}")
    if d.switches is not None:
        click.echo(f"  --switches={d.switches}@{d.wait_s}s")
    if d.exc_nodes is not None:
        click.echo(f"  --exclude={d.exc_nodes}")
    if d.user_message:
        click.echo(f"  tells the user: {d.user_message}")
    for line in advise(snap, job, d):
        click.echo(f"advice: {line}")
