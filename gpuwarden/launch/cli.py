"""`gpuwarden launch --spares k -- <training command>`: from a batch script of N+k nodes."""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import IO

import click

from gpuwarden.config.context import Context
from gpuwarden.core.errors import ConfigError, SlurmError
from gpuwarden.launch.launcher import launch as run_launch
from gpuwarden.launch.report import Events, JobComment
from gpuwarden.launch.settings import LaunchSettings, settings
from gpuwarden.launch.steps import SrunSteps
from gpuwarden.slurm import bindir, jobenv
from gpuwarden.slurm.hostlist import HostlistError, expand
from gpuwarden.slurm.runner import SubprocessRunner

log = logging.getLogger(__name__)

_D = LaunchSettings()


def _leaves(path: str) -> dict[str, str]:
    from gpuwarden.slurm.topology import leaf_of_file  # noqa: PLC0415 - optional

    return leaf_of_file(path, "spares in allocation order")


@click.command("launch", context_settings={"allow_interspersed_args": False})
@click.option("--spares", type=int, default=_D.spares, show_default=True,
              help="nodes of the allocation kept idle to replace a lost one (#SBATCH -N N+k)")
@click.option("--beat-s", type=float, default=_D.beat_s, show_default=True,
              help="each rank's heartbeat period")
@click.option("--deadline-s", type=float, default=_D.deadline_s, show_default=True,
              help="a rank silent this long has lost its node")
@click.option("--start-s", type=float, default=_D.start_s, show_default=True,
              help="time a rank has from the step's start to its first heartbeat")
@click.option("--hang-s", type=float, default=_D.hang_s, show_default=True,
              help="no progress (saves, ck.progress) this long while every rank beats: hung "
              "(at least twice the longest gap seen between saves); 0: off")
@click.option("--stop-s", type=float, default=_D.stop_s, show_default=True,
              help="how long ending a step may take before srun is killed")
@click.option("--hang-relaunches", type=int, default=_D.hang_relaunches, show_default=True,
              help="relaunches on the same nodes after a hang before requeueing")
@click.option("--beat-host", default=None,
              help="this host's name as the ranks reach it (default: SLURMD_NODENAME)")
@click.option("--beat-port", type=int, default=0, help="UDP port for heartbeats (0: any)")
@click.option("--overlap/--no-overlap", default=True, show_default=True,
              help="srun --overlap: start the new step while the lost node still holds the old")
@click.option("--topology", "topology", default=None,
              help="topology.conf, to pick a spare on the lost node's leaf switch "
              "(default: [ckpt] topology_conf)")
@click.option("--events", "events_file", type=click.File("a"), default=None,
              help="append every event as a JSON line here (for measuring recovery)")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
def launch(obj: Context, spares: int, beat_s: float, deadline_s: float, start_s: float,
           hang_s: float, stop_s: float, hang_relaunches: int, beat_host: str | None,
           beat_port: int, overlap: bool, topology: str | None, events_file: IO[str] | None,
           command: tuple[str, ...]) -> None:
    """Run COMMAND as one step on N of the job's N+k nodes and keep k idle: a rank whose node
    is lost (no heartbeat for --deadline-s) is restarted on a spare, the others where they
    were, all restoring from the checkpoint tiers. Exit: the training's status, or 75 (the
    template requeues) when no spare is left. Needs `#SBATCH --no-kill`."""
    try:
        s = settings(spares=spares, beat_s=beat_s, deadline_s=deadline_s, start_s=start_s,
                     hang_s=hang_s, stop_s=stop_s, hang_relaunches=hang_relaunches)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    job_id = jobenv.job_id()
    if not job_id.isdigit():
        raise click.UsageError("SLURM_JOB_ID is not set: run this in a batch script")
    try:
        nodes = expand(jobenv.job_nodelist())
    except HostlistError as exc:
        raise click.UsageError(f"SLURM_JOB_NODELIST: {exc}") from None
    try:
        cfg = obj.config()
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        where = bindir.locate(cfg.slurm.bin_dir, use_path=True).path
    except SlurmError as exc:
        raise click.ClickException(str(exc)) from None
    runner = SubprocessRunner(lambda: where)
    host = beat_host or jobenv.node_name(hostname=socket.gethostname)
    try:
        rc = run_launch(job_id, nodes, command, s, SrunSteps(job_id, runner, os.path.join(where, "srun"),
                                                     overlap=overlap),
                        JobComment(job_id, runner), Events(events_file), host, beat_port,
                        _leaves(topology or cfg.ckpt.topology_conf))
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    sys.exit(rc)
