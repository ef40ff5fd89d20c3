"""The `gpuwarden` command. Wiring only: logic lives in the modules it calls."""

from __future__ import annotations

import importlib
import json
import logging
import sys
import time
from dataclasses import asdict

import click

from gpuwarden import config as configmod
from gpuwarden.config.context import EXIT_CONFIG, Context, die
from gpuwarden.core import extras, logsetup
from gpuwarden.core.errors import ConfigError, NotOurDrainError, SlurmError
from gpuwarden.slurm import bindir
from gpuwarden.slurm.client import NodeBusyError, SlurmClient

log = logging.getLogger(__name__)

EXIT_REFUSED = 3


# Command groups imported only when invoked: the prolog (`health prolog`) must not pay for
# loading the lemon scanner, nor the scanner for the health checks.
_LAZY = {
    "health": ("gpuwarden.health.cli", "health"),
    "lemon": ("gpuwarden.lemon.cli", "lemon"),
    "accounting": ("gpuwarden.accounting.cli", "accounting"),
    "fleet": ("gpuwarden.fleet.cli", "fleet"),
    "simulate": ("gpuwarden.fleet.cli", "simulate"),
    "report": ("gpuwarden.report.cli", "report"),
    "placement": ("gpuwarden.placement.cli", "placement"),
    "ckpt": ("gpuwarden.ckpt.cli", "ckpt"),
    "install-files": ("gpuwarden.install.cli", "install_files"),
    "launch": ("gpuwarden.launch.cli", "launch"),
    "slurm-conf": ("gpuwarden.slurmconf.cli", "slurm_conf_cmd"),
}
# Commands of a lazy group defined a layer above its package, attached when the group is
# loaded: `health periodic|prolog|epilog|check|selftest` drive gpuwarden.hooks.entry, which
# gpuwarden.health must not import.
_ATTACHED = {
    "health": ("gpuwarden.hooks.cli", "COMMANDS"),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *_LAZY])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in _LAZY:
            module, attr = _LAZY[cmd_name]
            command: click.Command = getattr(importlib.import_module(module), attr)
            if cmd_name in _ATTACHED and isinstance(command, click.Group):
                extra, extra_attr = _ATTACHED[cmd_name]
                for sub in getattr(importlib.import_module(extra), extra_attr):
                    command.add_command(sub)
            return command
        return super().get_command(ctx, cmd_name)


@click.group(cls=_LazyGroup)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help=f"config file (default: ${configmod.ENV_VAR} or {configmod.DEFAULT_PATH})")
@click.option("-v", "--verbose", is_flag=True, help="log debug messages")
@click.version_option(package_name="gpuwarden", prog_name="gpuwarden",
                      message="%(prog)s %(version)s")
@click.pass_context
def cli(ctx: click.Context, config_path: str | None, verbose: bool) -> None:
    """gpuwarden: health gating, lemon-node draining, topology placement and tiered
    checkpointing for Slurm GPU clusters."""
    logsetup.setup_stderr(verbose)
    obj = ctx.ensure_object(Context)
    if config_path is not None:
        obj.config_path = config_path


# ---- config ---------------------------------------------------------------------------------
@cli.group("config")
def config_group() -> None:
    """Check or show the configuration."""


def _site_problems(cfg: configmod.Config, target: object) -> tuple[str, str, str]:
    """What `config check` refuses in ``cfg`` beyond the schema (an error), what it only warns
    about, and where Slurm's commands were found: ("", "", where) when all is well."""
    try:
        place = bindir.locate(cfg.slurm.bin_dir, use_path=False)
    except SlurmError as exc:
        return f"{target}: slurm.bin_dir: {exc}", "", ""
    from gpuwarden.placement import location  # noqa: PLC0415

    misplaced = location.problem(cfg.placement.snapshot_file)
    if misplaced:
        return f"{target}: {misplaced}", "", ""
    from gpuwarden.health.kernlogtrust import check_file  # noqa: PLC0415

    # A kernel_log rendering a user can forge lines in is refused; one this user cannot read
    # here (not root, not the node) is only a warning: the self-test on the node reads it.
    readable, why = check_file(cfg.health.kernel_log, cfg.health.check_timeout_s)
    if why and readable:
        return f"{target}: health.kernel_log: {why}", "", ""
    warning = f"{target}: warning: health.kernel_log not checked: {why}" if why else ""
    return "", warning, f"{place.path}, {place.how}"


@config_group.command("check")
@click.argument("path", required=False)
@click.pass_obj
def config_check(obj: Context, path: str | None) -> None:
    """Validate PATH (default: the configured file), and that Slurm's commands can be found
    without PATH (as slurmd runs the hooks). Exit 2 when it is invalid."""
    target = configmod.config_path(path or obj.config_path)
    try:
        cfg = configmod.load(target, missing_ok=False)
    except ConfigError as exc:
        die(str(exc), EXIT_CONFIG)
    error, warning, place = _site_problems(cfg, target)
    if error:
        die(error, EXIT_CONFIG)
    if warning:
        click.echo(warning, err=True)
    click.echo(f"{target}: OK (Slurm commands: {place})")


@config_group.command("set")
@click.argument("assignments", nargs=-1, required=True, metavar="KEY=VALUE...")
@click.pass_obj
def config_set(obj: Context, assignments: tuple[str, ...]) -> None:
    """Set keys of the configuration file in place, e.g. `gpuwarden config set
    health.gpu_probe=fake cluster.nodes=16`: each key's line is changed (or added to its
    table), every other line is kept. The file is written only when the result passes
    `config check`; otherwise exit 2 and nothing changes. A string needs no quotes; a list or
    table is TOML (`health.expected.ib_ports='["mlx5_0:1"]'`)."""
    from gpuwarden.config import setvalue as configset  # noqa: PLC0415
    from gpuwarden.config import write as configwrite  # noqa: PLC0415

    target = configmod.config_path(obj.config_path)
    unchanged = "nothing was written (`gpuwarden config show` lists every key)"
    try:
        sets = [configset.assignment(a) for a in assignments]
    except ValueError as exc:
        die(f"config set: {exc}; {unchanged}", EXIT_CONFIG)
    try:
        text = configwrite.read(target)
        new, changes = configset.apply(text, str(target), sets)
    except ConfigError as exc:
        die(f"{exc}; {unchanged}", EXIT_CONFIG)
    error, warning, place = _site_problems(configmod.parse(new, str(target)), target)
    if error:
        die(f"{error}; nothing was written", EXIT_CONFIG)
    if warning:
        click.echo(warning, err=True)
    try:
        if new != text:
            configwrite.replace(target, new)
    except ConfigError as exc:
        die(str(exc), EXIT_CONFIG)
    for c in changes:
        before = "not in the file" if c.before is None else configmod.toml_value(c.before)
        click.echo(f"{target}: {c.key} = {configmod.toml_value(c.after)} (was {before})")
    click.echo(f"{target}: OK (Slurm commands: {place})")


@config_group.command("show")
@click.pass_obj
def config_show(obj: Context) -> None:
    """Print the effective configuration, defaults included, as TOML (all defaults when the
    file does not exist yet: how the admin guide makes the first one)."""
    try:
        cfg = obj.config()
    except ConfigError as exc:
        die(str(exc), EXIT_CONFIG)
    where = configmod.config_path(obj.config_path)
    absent = "" if where.exists() else ": absent, these are the defaults"
    click.echo(f"# effective configuration ({where}{absent})")
    click.echo(configmod.dumps(cfg), nl=False)


# ---- nodes ----------------------------------------------------------------------------------
def _client_ordie(obj: Context) -> SlurmClient:
    try:
        return obj.client_for(obj.config_required())
    except ConfigError as exc:
        die(str(exc), EXIT_CONFIG)


@cli.command("nodes")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.pass_obj
def nodes_cmd(obj: Context, as_json: bool) -> None:
    """List nodes with their state, reason and who set the reason, and the nodes whose health
    gating is off or whose health verdict is stale (from each node's marker in Slurm)."""
    from gpuwarden.health import gatingstate  # noqa: PLC0415

    client = _client_ordie(obj)
    try:
        nodes = client.nodes()
    except SlurmError as exc:
        die(str(exc), 1)
    now = time.time()
    if as_json:
        rows = [{**asdict(n), "owner": n.owner,
                 "health": gatingstate.of_node(n.name, n.extra, now).as_json()} for n in nodes]
        click.echo(json.dumps(rows, indent=2))
        return
    width = max([4, *(len(n.name) for n in nodes)])
    click.echo(f"{'NODE':<{width}}  {'STATE':<16} {'SET BY':<10} REASON")
    flagged = 0
    unmarked: list[str] = []
    for n in nodes:
        line = f"{n.name:<{width}}  {n.state_text:<16} {n.owner or '-':<10} {n.reason or '-'}"
        if n.comment.startswith("gpuwarden: would drain"):
            # Held back by the blast-radius cap: the evidence is in the node comment.
            line += f"  [{n.comment.removeprefix('gpuwarden: ')}]"
        gating = gatingstate.of_node(n.name, n.extra, now)
        if gating.marker is None:
            unmarked.append(n.name)
        elif gating.note:
            flagged += 1
        if gating.note:
            line += f"  [{gating.note}]"
        click.echo(line)
    if unmarked:
        click.echo(_never_reported(unmarked), err=True)
    if flagged:
        click.echo(f"gpuwarden: health gating is off or stale on {flagged} node(s): see "
                   "`gpuwarden health selftest` and the node's syslog", err=True)


def _never_reported(names: list[str]) -> str:
    from gpuwarden.health.marker import HEALTHCHECK  # noqa: PLC0415
    from gpuwarden.slurm import hostlist  # noqa: PLC0415

    return (f"gpuwarden: {len(names)} node(s) never reported their health gating "
            f"({hostlist.compress(names)}): run `{HEALTHCHECK}` once as root on each (docs/"
            "admin-guide.md, step 8, runs it on every node over ssh), or wait one "
            "HealthCheckInterval; a node still unmarked after that: `gpuwarden health "
            "selftest` there and its syslog")


@cli.command("drain")
@click.argument("node")
@click.option("--reason", required=True, help="why; stored as 'gpuwarden: REASON'")
@click.option("--replace", is_flag=True,
              help="replace the reason of a drain gpuwarden already made (default: keep it)")
@click.pass_obj
def drain_cmd(obj: Context, node: str, reason: str, replace: bool) -> None:
    """Drain NODE with a gpuwarden reason (refused over someone else's drain).

    A node gpuwarden already drained keeps its reason, the first evidence, unless --replace."""
    from gpuwarden.slurm.reasons import HEALTH_TAG, names_the_tag  # noqa: PLC0415

    if names_the_tag(reason):
        # Health gating auto-resumes drains whose reason carries its tag.
        die(f"a reason containing {HEALTH_TAG} is reserved for health gating's own drains",
             EXIT_CONFIG)
    client = _client_ordie(obj)
    try:
        client.drain(node, reason, in_service_only=not replace)
    except NodeBusyError:
        # Only gpuwarden's own drains get here (anyone else's is NotOurDrainError below).
        kept = client.node(node).reason
        click.echo(f"{node}: already drained by gpuwarden, reason kept (the first evidence): "
                   f"{kept}; use --replace to change it")
        return
    except NotOurDrainError as exc:
        die(str(exc), EXIT_REFUSED)
    except (SlurmError, ValueError) as exc:
        die(str(exc), 1)
    click.echo(f"{node}: drained")


@cli.command("resume")
@click.argument("node")
@click.pass_obj
def resume_cmd(obj: Context, node: str) -> None:
    """Resume NODE if gpuwarden drained it (refused otherwise, exit 3)."""
    client = _client_ordie(obj)
    try:
        done = client.resume(node)
    except NotOurDrainError as exc:
        die(str(exc), EXIT_REFUSED)
    except SlurmError as exc:
        die(str(exc), 1)
    click.echo(f"{node}: resumed" if done else f"{node}: not drained, nothing to do")


def main() -> int:
    # Errors also to syslog/the journal: what slurmd starts exits 0 on them, and Slurm shows
    # the stderr of a hook only when it fails.
    logsetup.add_syslog()
    try:
        cli.main(standalone_mode=False, obj=Context())
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except ConfigError as exc:
        click.echo(f"gpuwarden: {exc}", err=True)
        return EXIT_CONFIG
    except ModuleNotFoundError as exc:
        # A path to an extra's package that no command marks `required`: still one line.
        line = extras.missing_line("gpuwarden", exc, None)
        if line is None:
            raise
        click.echo(line, err=True)
        return extras.EXIT_MISSING
    return 0


if __name__ == "__main__":
    sys.exit(main())
