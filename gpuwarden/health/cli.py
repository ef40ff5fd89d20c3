"""`gpuwarden health ...`: the commands slurm.conf and operators call."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from typing import Any

import click

from gpuwarden.errors import ConfigError, GpuwardenError
from gpuwarden.health import entry
from gpuwarden.health.model import Status, Verdict
from gpuwarden.slurm.client import CliSlurmClient
from gpuwarden.slurm.runner import DeadlineRunner, SubprocessRunner


@click.group("health")
def health() -> None:
    """GPU and node health checks (prolog, epilog, HealthCheckProgram, by hand)."""


def _slurm_entry(obj: Any, what: str, fn: Any, budget_key: str) -> int:
    # A broken config must never fail jobs or drain nodes fleet-wide: log it, exit 0.
    try:
        cfg = obj.config()
    except ConfigError as exc:
        click.echo(f"gpuwarden {what}: {exc}; health gating skipped", err=True)
        return 0
    # Checks get the budget; all Slurm calls together get one more budget (one retry each), so
    # a slow controller cannot stretch an entry point past 2 x budget + settle_s.
    budget = getattr(cfg.health, budget_key)
    slurm = replace(cfg.slurm, command_timeout_s=min(cfg.slurm.command_timeout_s, budget),
                    retries=min(cfg.slurm.retries, 1))
    runner = DeadlineRunner(SubprocessRunner(), time.monotonic() + 2 * budget)
    client = CliSlurmClient(slurm, runner) if obj.client_factory is None else obj.client()
    env = entry.Env(config=cfg, client=client, environ=entry.environ())
    return entry.safe(lambda: fn(env), what, on_error=0)


@health.command("periodic")
@click.pass_obj
def periodic_cmd(obj: Any) -> None:
    """HealthCheckProgram: all checks, store the verdict, drain or resume."""
    sys.exit(_slurm_entry(obj, "health check", entry.periodic, "periodic_budget_s"))


@health.command("prolog")
@click.pass_obj
def prolog_cmd(obj: Any) -> None:
    """Prolog: the fast gate before a job starts (exit 1 = node drained, job requeued)."""
    sys.exit(_slurm_entry(obj, "prolog", entry.prolog, "prolog_budget_s"))


@health.command("epilog")
@click.pass_obj
def epilog_cmd(obj: Any) -> None:
    """Epilog: deeper checks after a failed job or on a suspect node."""
    sys.exit(_slurm_entry(obj, "epilog", entry.epilog, "epilog_budget_s"))


def _print(v: Verdict, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(v.to_json(), indent=2))
        return
    click.echo(f"{v.node}: {v.status.name} ({v.context})")
    for r in v.results:
        click.echo(f"  {r.status.name:<8} {r.check:<16} {r.message}")


def _local_env(obj: Any) -> entry.Env:
    """For commands that only look at this node: no Slurm client is built or called."""
    return entry.Env(config=obj.config(), client=None, environ=entry.environ())  # type: ignore[arg-type]


@health.command("check")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--gpus", default="", help="limit GPU checks to these indices, e.g. 0,1")
@click.pass_obj
def check_cmd(obj: Any, as_json: bool, gpus: str) -> None:
    """Run every check now; nothing is stored or drained. Exit 0 OK, 1 warning, 2 critical,
    3 unknown (Nagios)."""
    try:
        env = _local_env(obj)
        subset = entry.job_gpus({"SLURM_JOB_GPUS": gpus}) if gpus else None
        verdict = entry.check(env, subset)
    except (GpuwardenError, ValueError) as exc:
        click.echo(f"UNKNOWN: {exc}", err=True)
        sys.exit(Status.UNKNOWN.exit_code)
    _print(verdict, as_json)
    sys.exit(verdict.status.exit_code)


@health.command("show")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def show_cmd(obj: Any, as_json: bool) -> None:
    """The verdict stored by the last health check on this node."""
    try:
        env = _local_env(obj)
        verdict = env.store.load_verdict()
    except GpuwardenError as exc:
        click.echo(f"gpuwarden: {exc}", err=True)
        sys.exit(2)
    if verdict is None:
        click.echo("no stored verdict yet (run `gpuwarden health periodic`)", err=True)
        sys.exit(Status.UNKNOWN.exit_code)
    _print(verdict, as_json)
