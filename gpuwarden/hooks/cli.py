"""The Slurm entry points and the commands that run them or their checks: `gpuwarden health
periodic|prolog|epilog|check|selftest`.

They live here, above the health feature, because they drive gpuwarden.hooks.entry (where
health gating and checkpoint stage-in meet); gpuwarden.cli attaches them to the `health` group
(gpuwarden.health.cli), so the command tree is the same as when they lived there.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import sys
import time
import tomllib
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import click

from gpuwarden.config import Config
from gpuwarden.config.context import Context
from gpuwarden.config.health import HealthConfig
from gpuwarden.core.errors import ConfigError, GpuwardenError
from gpuwarden.health import gatingmetrics
from gpuwarden.health.cli import print_verdict
from gpuwarden.health.model import Status
from gpuwarden.health.store import Store
from gpuwarden.hooks import entry
from gpuwarden.slurm import jobenv
from gpuwarden.slurm.client import check_node_name

log = logging.getLogger(__name__)

# The sh wrapper's hard limits (prolog/gpuwarden-hook.sh GW_HEALTHCHECK_LIMIT, GW_HOOK_LIMIT):
# slurmd kills a HealthCheckProgram after 60 s; the prolog and epilog stay 30 s below
# PrologEpilogTimeout=300. The wrapper passes its limit on in HOOK_LIMIT_ENV.
WRAPPER_HEALTHCHECK_LIMIT_S = 55.0
WRAPPER_HOOK_LIMIT_S = 270.0
HOOK_LIMIT_ENV = "GPUWARDEN_HOOK_LIMIT_S"
WATCHDOG_GRACE_S = 5.0
# Python's run and its watchdog end this long before the wrapper's limit.
WRAPPER_MARGIN_S = WATCHDOG_GRACE_S + 5.0
# The whole health check run, Slurm calls included, ends by this; the watchdog stops it a few
# seconds later wherever it is stuck; the wrapper a few seconds after that.
HEALTHCHECK_LIMIT_S = WRAPPER_HEALTHCHECK_LIMIT_S - WRAPPER_MARGIN_S
# A node whose config is broken still says so in Slurm, within this.
CONFIG_OFF_LIMIT_S = 10.0


def run_limit(what: str, budget: float, extra_s: float = 0.0,
              hook_limit_s: float | None = None) -> float:
    """Seconds the whole entry point may take: checks get up to the budget, all Slurm calls
    together one more budget, plus ``extra_s`` (the prolog's checkpoint stage-in); and it
    ends, watchdog included, before the sh wrapper's limit (``hook_limit_s`` when it said)."""
    wrapper = WRAPPER_HEALTHCHECK_LIMIT_S if what == "health check" else WRAPPER_HOOK_LIMIT_S
    if hook_limit_s is not None:
        wrapper = min(wrapper, hook_limit_s) if what == "health check" else hook_limit_s
    return max(1.0, min(2 * budget + extra_s, wrapper - WRAPPER_MARGIN_S))


def hook_limit(environ: Mapping[str, str]) -> float | None:
    """The wrapper's limit from its environment; None when absent or not a positive number."""
    try:
        value = float(environ.get(HOOK_LIMIT_ENV, ""))
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def stage_in_s(cfg: Config, what: str) -> float:
    """The prolog's checkpoint stage-in budget, when stage-in can run (as fastgate decides)."""
    on = what == "prolog" and cfg.ckpt.stage_in_source()
    return cfg.ckpt.stage_in_budget_s if on else 0.0


def _slurm_entry(obj: Context, what: str, fn: Any, budget_key: str) -> int:
    start = time.monotonic()
    # Missing or broken config: one rule for the hooks. Fail open (exit 0, never fail a job
    # or drain a node on it), but loudly: syslog error, self-error metric, marker in Slurm.
    try:
        cfg = obj.config_required()
    except ConfigError as exc:
        return _config_failed(obj, what, exc)
    budget = getattr(cfg.health, budget_key)
    end = start + run_limit(what, budget, stage_in_s(cfg, what), hook_limit(entry.environ()))
    slurm = replace(cfg.slurm, command_timeout_s=min(cfg.slurm.command_timeout_s, budget),
                    retries=min(cfg.slurm.retries, 1))
    client = obj.client_for(replace(cfg, slurm=slurm), use_path=False, end=end)
    env = entry.Env(config=cfg, client=client, environ=entry.environ(), end=end)
    return entry.run(env, fn, what, watchdog_s=end - time.monotonic() + WATCHDOG_GRACE_S)


def salvage_prom_dir(path: str, key: str = "prom_dir") -> str:
    """`[health] prom_dir` (or ``key``) from a config that failed validation elsewhere, if it
    can be read: the self-error metric should reach node_exporter even then."""
    try:
        with open(path, "rb") as f:
            value = tomllib.load(f).get("health", {}).get(key, "")
    except (OSError, ValueError, AttributeError):
        return ""
    return value if isinstance(value, str) and os.path.isabs(value) else ""


def _config_failed(obj: Context, what: str, exc: ConfigError) -> int:
    log.error("gpuwarden %s: %s; health gating skipped: it is OFF on this node until the "
              "config is fixed (run `gpuwarden config check`)", what, exc)
    prom = salvage_prom_dir(exc.path)
    if prom:
        try:
            Store("", prom).save_self({"config": str(exc)}, time.time())
        except GpuwardenError as err:
            log.error("%s", err)
    if what == "health check":
        if prom:
            _gating_off(prom, salvage_prom_dir(exc.path, "state_dir"))
        _mark_config_off(obj, exc)
    return 0


def _gating_off(prom_dir: str, state_dir: str) -> None:
    """Gating is off here: say so in its textfile (`gpuwarden_health_gating_enabled` 0), with
    the counts kept in the state directory (the config's, if it can be read, else the
    default), never reset by a broken config."""
    state_dir = state_dir or HealthConfig().state_dir
    try:
        with entry.watchdog(CONFIG_OFF_LIMIT_S):
            node = check_node_name(jobenv.node_name(entry.environ(), socket.gethostname))
            with gatingmetrics.held(state_dir) as (counts, _):
                gatingmetrics.write(prom_dir, node, counts, enabled=False)
    except (GpuwardenError, OSError, entry.DeadlineExceeded) as err:
        log.error("%s not written: %s", gatingmetrics.FILE, err)


def _mark_config_off(obj: Context, exc: ConfigError) -> None:
    """Say in the node's Slurm marker that gating is off, with the default Slurm settings."""
    cfg = Config()
    end = time.monotonic() + CONFIG_OFF_LIMIT_S
    slurm = replace(cfg.slurm, command_timeout_s=CONFIG_OFF_LIMIT_S / 2, retries=0)
    env = entry.Env(config=cfg, client=obj.client_for(replace(cfg, slurm=slurm), use_path=False,
                                                      end=end),
                    environ=entry.environ(), end=end)
    env.problems["config"] = str(exc)
    try:
        with entry.watchdog(CONFIG_OFF_LIMIT_S + WATCHDOG_GRACE_S):
            entry.publish_marker(env, env.client.node(env.node), Status.UNKNOWN.name, time.time())
    except (GpuwardenError, entry.DeadlineExceeded) as err:
        log.error("cannot say in Slurm that health gating is off here: %s", err)


@click.command("periodic")
@click.pass_obj
def periodic_cmd(obj: Context) -> None:
    """HealthCheckProgram: all checks, store the verdict, drain or resume."""
    sys.exit(_slurm_entry(obj, "health check", entry.periodic, "periodic_budget_s"))


@click.command("prolog")
@click.pass_obj
def prolog_cmd(obj: Context) -> None:
    """Prolog: the fast gate before a job starts (exit 1 = node drained, job requeued)."""
    sys.exit(_slurm_entry(obj, "prolog", entry.prolog, "prolog_budget_s"))


@click.command("epilog")
@click.pass_obj
def epilog_cmd(obj: Context) -> None:
    """Epilog: deeper checks after a failed job or on a suspect node."""
    sys.exit(_slurm_entry(obj, "epilog", entry.epilog, "epilog_budget_s"))


def _local_env(obj: Context) -> entry.Env:
    """For commands that only look at this node: no Slurm client is built or called."""
    return entry.Env(config=obj.config_required(), client=None,  # type: ignore[arg-type]
                     environ=entry.environ())


@click.command("check")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--gpus", default="", help="limit GPU checks to these indices, e.g. 0,1")
@click.pass_obj
def check_cmd(obj: Context, as_json: bool, gpus: str) -> None:
    """Run every check now; nothing is stored or drained. Exit 0 OK, 1 warning, 2 critical,
    3 unknown (Nagios)."""
    try:
        env = _local_env(obj)
        subset = entry.job_gpus({jobenv.JOB_GPUS: gpus}) if gpus else None
        verdict = entry.check(env, subset)
    except (GpuwardenError, ValueError) as exc:
        click.echo(f"UNKNOWN: {exc}", err=True)
        sys.exit(Status.UNKNOWN.exit_code)
    print_verdict(verdict, as_json)
    sys.exit(verdict.status.exit_code)


@click.command("selftest")
@click.pass_obj
def selftest_cmd(obj: Context) -> None:
    """What to run on a node before enabling Prolog=/Epilog=/HealthCheckProgram=: imports,
    config, Slurm commands, state directory, kernel log, GPU probe, and a dry run of the
    three entry points that changes nothing. Exit 1 when anything needs fixing."""
    from gpuwarden.hooks import selftest  # noqa: PLC0415 - never on a hook's path

    findings = selftest.run_all(obj, entry.environ())
    for f in findings:
        click.echo(f"{'OK  ' if f.ok else 'FAIL'} {f.name}: {f.detail}")
        if not f.ok and f.fix:
            click.echo(f"     fix: {f.fix}")
    bad = [f for f in findings if not f.ok]
    click.echo(f"{len(findings) - len(bad)} of {len(findings)} checks passed"
               + ("" if not bad else "; do not enable the hooks until the FAIL lines are fixed"))
    sys.exit(1 if bad else 0)


# Attached to the `health` group by gpuwarden.cli.
COMMANDS = (periodic_cmd, prolog_cmd, epilog_cmd, check_cmd, selftest_cmd)
