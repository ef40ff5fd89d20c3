"""`gpuwarden health ...`: the commands slurm.conf and operators call.

The group and the commands that only read this node's state or write test faults. The Slurm
entry points (periodic, prolog, epilog) and `check` and `selftest`, which drive
gpuwarden.hooks.entry, are in gpuwarden.hooks.cli, a layer above: gpuwarden.cli attaches them
to this group.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import time
from typing import Any

import click

from gpuwarden.config.context import Context
from gpuwarden.core.errors import GpuwardenError
from gpuwarden.health.model import Status, Verdict
from gpuwarden.health.store import Store
from gpuwarden.slurm import jobenv
from gpuwarden.slurm.client import check_node_name

log = logging.getLogger(__name__)


@click.group("health")
def health() -> None:
    """GPU and node health checks (prolog, epilog, HealthCheckProgram, by hand)."""


def print_verdict(v: Verdict, as_json: bool) -> None:
    """A verdict, as `health check` and `health show` print it."""
    if as_json:
        click.echo(json.dumps(v.to_json(), indent=2))
        return
    click.echo(f"{v.node}: {v.status.name} ({v.context})")
    for r in v.results:
        click.echo(f"  {r.status.name:<8} {r.check:<16} {r.message}")


@health.command("show")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def show_cmd(obj: Context, as_json: bool) -> None:
    """The verdict stored by the last health check on this node."""
    try:
        h = obj.config_required().health
        verdict = Store(h.state_dir, h.prom_dir).load_verdict()
    except GpuwardenError as exc:
        click.echo(f"gpuwarden: {exc}", err=True)
        sys.exit(2)
    if verdict is None:
        click.echo("no stored verdict yet (run `gpuwarden health periodic`)", err=True)
        sys.exit(Status.UNKNOWN.exit_code)
    print_verdict(verdict, as_json)


# ---- rehearsing a drain on a test node --------------------------------------------------------
@health.group("inject")
def inject_group() -> None:
    """Rehearse a drain on a TEST node: write a fault where its config reads faults from (a
    fake GPU file and a kernel-log file). Refused where the node reads real GPUs or /dev/kmsg.
    See docs/testing-without-gpus.md."""


def _fault_files(obj: Context) -> Any:
    from gpuwarden.health import inject  # noqa: PLC0415 - never on a hook's path

    try:
        return inject.fault_files(obj.config_required().health)
    except GpuwardenError as exc:
        click.echo(f"gpuwarden: health inject: {exc}", err=True)
        sys.exit(2)


def _this_node() -> str:
    """The node's Slurm name, as its hooks see it."""
    try:
        return check_node_name(jobenv.node_name(hostname=socket.gethostname))
    except GpuwardenError as exc:
        click.echo(f"gpuwarden: health inject: {exc}; set SLURMD_NODENAME to this node's "
                   "Slurm name", err=True)
        sys.exit(2)


@inject_group.command("xid")
@click.argument("code", type=click.IntRange(1, 99999))
@click.option("--gpu", type=click.IntRange(0, 63), required=True, help="the GPU's index")
@click.option("--text", default="", help="the driver's words after the code, on one line "
              "(default: what the driver prints for it)")
@click.pass_obj
def inject_xid_cmd(obj: Context, code: int, gpu: int, text: str) -> None:
    """Log Xid CODE for GPU --gpu in the test kernel log, as the NVIDIA driver does. The next
    health check, or the next job's prolog here, judges it like a real one, and Slurm's
    accounting records the drain like a real one."""
    from gpuwarden.health import inject  # noqa: PLC0415

    files = _fault_files(obj)
    cfg = obj.config_required().health
    node = _this_node()
    try:
        line = inject.inject_xid(files, code, gpu, text)
    except GpuwardenError as exc:
        click.echo(f"gpuwarden: health inject: {exc}", err=True)
        sys.exit(2)
    click.echo(f"{files.kernel_log}: {line}")
    click.echo(inject.outcome(code, text))
    click.echo("it is judged at the next health check (HealthCheckInterval) or job start here; "
               "see it now: gpuwarden health check")
    click.echo(f"undo: gpuwarden health inject clear; a node gpuwarden drained is resumed "
               f"after {cfg.resume_after_passes} passing health checks")
    at = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    click.echo(f"note: Slurm's accounting keeps a drain this causes like a real one (lemon scan "
               f"and fleet mttf count it); injected on {node} at {at} UTC: to leave it out, see "
               f"{inject.DOC}")


@inject_group.command("clear")
@click.pass_obj
def inject_clear_cmd(obj: Context) -> None:
    """Undo every injected fault: empty the test kernel log and write a healthy fake GPU file
    (the GPU count, model and NVLinks this node's class expects). Also the first step on a
    new test node. Refused when either file is anything but a test file."""
    from gpuwarden.health import inject  # noqa: PLC0415

    files = _fault_files(obj)
    cfg = obj.config_required().health
    node = _this_node()
    try:
        done = inject.clear(files, cfg.expected_for(node))
    except GpuwardenError as exc:
        click.echo(f"gpuwarden: health inject: {exc}", err=True)
        sys.exit(2)
    for what in done:
        click.echo(what)
    click.echo(f"a node gpuwarden drained is resumed after {cfg.resume_after_passes} passing "
               "health checks (HealthCheckInterval apart; `gpuwarden nodes` shows it)")
