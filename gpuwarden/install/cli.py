"""`gpuwarden install-files PREFIX`: wiring only (gpuwarden.install.run does the work)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from gpuwarden import config as configmod
from gpuwarden.install import plan, run

EXIT_REFUSED = 3
_DONE = {"create": "created", "update": "updated", "keep": "unchanged", "add": "line added",
         "replace": "line replaced"}
_WOULD = {"create": "would create", "update": "would update", "keep": "unchanged",
          "add": "would add the line", "replace": "would replace the line"}


def _fail(message: str, code: int) -> None:
    click.echo(f"gpuwarden: install-files: {message}", err=True)
    sys.exit(code)


def _warn(req: run.Request, unreachable: list[str]) -> None:
    if req.defaults_file is not None and req.defaults_file != plan.DEFAULTS_FILE:
        click.echo(f"warning: the shipped hooks read {plan.DEFAULTS_FILE}, not "
                   f"{req.defaults_file}: on a node that runs them, put the line "
                   f"GPUWARDEN_PYTHON={req.target.python} in {plan.DEFAULTS_FILE} (rerun "
                   "without --defaults-file)", err=True)
    if unreachable:
        shown = ", ".join(unreachable[:6]) + (f" and {len(unreachable) - 6} more"
                                              if len(unreachable) > 6 else "")
        click.echo(f"warning: users other than root cannot get through {shown}: jobs cannot "
                   f"run {req.target.python} (train.sbatch's GW_PYTHON) or read "
                   f"{req.target.prefix}/ckpt/; chmod o+rx those directories and o+r those "
                   "files (a umask such as 077 made them so) if jobs checkpoint here",
                   err=True)


@click.command("install-files")
@click.argument("prefix")
@click.option("--defaults-file", default=plan.DEFAULTS_FILE, show_default=True,
              help="where to name this interpreter as GPUWARDEN_PYTHON= (the hooks read "
                   f"{plan.DEFAULTS_FILE})")
@click.option("--no-defaults-file", is_flag=True,
              help="leave the defaults file alone (a host that runs no Slurm hooks)")
@click.option("--replace-python", is_flag=True,
              help="replace a different GPUWARDEN_PYTHON= already in the defaults file")
@click.option("--dry-run", is_flag=True, help="list what would be written; write nothing")
def install_files(prefix: str, defaults_file: str, no_defaults_file: bool,
                  replace_python: bool, dry_run: bool) -> None:
    """Copy the Slurm hooks (prolog/, epilog/), the Lua plugins (plugins/), the checkpoint kit
    (ckpt/), the systemd units (systemd/), and the Prometheus rules and Grafana dashboard
    (prometheus/, grafana/) from this install into PREFIX (e.g. /opt/gpuwarden), rendered for
    this install's interpreter and `gpuwarden`, and name the interpreter in the defaults file
    the hooks read. Safe to rerun: unchanged files are left alone. Refuses (exit 3) links and
    directories others can write."""
    owner = os.geteuid()
    try:
        req = run.Request(run.this_install(prefix), run.source_dir(),
                          None if no_defaults_file else defaults_file, replace_python, dry_run,
                          owner)
        outcome = run.install(req)
    except plan.InstallError as exc:
        _fail(str(exc), EXIT_REFUSED)
        return
    except OSError as exc:
        what = f" ({exc.filename})" if exc.filename else ""
        _fail(f"cannot write under {prefix}: {exc.strerror}{what}; run it as root, or fix "
              "that, and rerun (files already written are left as they are)", 1)
        return
    words = _WOULD if dry_run else _DONE
    click.echo(f"{'dry run: ' if dry_run else ''}install-files {req.target.prefix} for "
               f"{req.target.python} ({req.target.gpuwarden})")
    for step in outcome.steps:
        detail = f"  {step.detail}" if step.detail else ""
        click.echo(f"  {words[step.action]:<22} {step.path} ({step.mode:04o}){detail}")
    have = run.extras()
    click.echo("extras here: " + ", ".join(f"{name} {'yes' if ok else 'no'}"
                                           for name, ok in have.items()))
    for name, ok in have.items():
        if not ok:
            click.echo(f"  no {name}: needed on {run.NEEDED_ON[name]}; add it with "
                       f"{os.path.dirname(req.target.python)}/pip install "
                       f"'<the gpuwarden wheel>[{name}]'")
    _warn(req, outcome.unreachable)
    if owner != 0:
        click.echo("note: not root: slurmd runs the hooks as root, and they trust only root's "
                   "files; run install-files as root for the cluster")
    if dry_run:
        click.echo("next: rerun without --dry-run")
        return
    for line in next_steps(req.target.gpuwarden, configmod.config_path()):
        click.echo(line)


def next_steps(gpuwarden: str, config: Path) -> list[str]:
    """What comes after this step, in docs/admin-guide.md's order (a test holds the two
    together): the self-test reads the configuration, so the configuration comes first."""
    if config.exists():
        conf = f"{config} is there; check it still describes this site: `{gpuwarden} config check`"
    else:
        conf = (f"`install -d -m 0755 {config.parent}`, `{gpuwarden} config show > {config}`, "
                f"`{gpuwarden} config set KEY=VALUE ...` for this site ([cluster], and [health] "
                f"on a node without GPUs), `{gpuwarden} config check`")
    return ["next, in the order of docs/admin-guide.md:",
            f"  step 4, the configuration (every host): {conf}",
            f"  step 5, as root on each compute node: `{gpuwarden} health selftest`",
            "  then steps 6 to 9 (the checkpoint spool, placement, the slurm.conf lines: only "
            "after every file they name is in place, the lemon scan)"]
