"""`gpuwarden slurm-conf`: the slurm.conf, gres.conf and topology.conf lines for the [cluster]
description, or a check of a site's slurm.conf for what gpuwarden's features need."""

from __future__ import annotations

import sys
from dataclasses import replace

import click

from gpuwarden import config as configmod
from gpuwarden.config.context import EXIT_CONFIG, Context, die
from gpuwarden.core.errors import ConfigError
from gpuwarden.slurm import bindir
from gpuwarden.slurm.runner import SubprocessRunner
from gpuwarden.slurmconf import render as slurmconf
from gpuwarden.slurmconf.needs import FEATURES


def _bin_dir_or_path(obj: Context) -> str:
    """The config's Slurm directory, or "" (PATH) when the config file is broken."""
    try:
        return obj.config().slurm.bin_dir
    except ConfigError:
        return ""


@click.command("slurm-conf")
@click.option("--part", type=click.Choice([*slurmconf.PARTS, "gpuwarden", "all"]), default="all",
              show_default=True, help="which file's lines to print; gpuwarden: the settings "
              "gpuwarden's features need in slurm.conf, merged into one block")
@click.option("--check", "check_path", type=click.Path(dir_okay=False), default=None,
              help="check this slurm.conf (and what it includes) for what gpuwarden needs: exit 0 "
              "all there, 1 something missing or conflicting, 2 a file unreadable")
@click.option("--feature", "features", type=click.Choice(list(FEATURES)), multiple=True,
              help="only this feature, for --check and --part gpuwarden (repeatable; default: all)")
@click.option("--slurm-version", "release", metavar="RELEASE", default=None,
              help="--check and --part gpuwarden: the Slurm release whose slurm.conf keys to "
              "accept or write, e.g. 24.11 (default: `scontrol --version` on this host)")
@click.option("--autodetect/--no-autodetect", default=True, show_default=True,
              help="gres.conf: AutoDetect=nvml (real GPUs) or explicit File= lines")
@click.option("--nodes", type=int, default=None, help="override [cluster] nodes")
@click.option("--nodes-per-leaf", type=int, default=None, help="override [cluster] nodes_per_leaf")
@click.option("--example", is_flag=True, help="print the lines even when the config file does not "
              "set [cluster] (they then describe gpuwarden's example cluster, not yours)")
@click.pass_obj
def slurm_conf_cmd(obj: Context, part: str, check_path: str | None, features: tuple[str, ...],
                   release: str | None, autodetect: bool, nodes: int | None,
                   nodes_per_leaf: int | None, example: bool) -> None:
    """Print the slurm.conf, gres.conf and topology.conf lines for the [cluster] description,
    or check a site's slurm.conf (--check FILE) for the lines gpuwarden needs."""

    from gpuwarden.slurmconf import check as slurmconfcheck  # noqa: PLC0415
    from gpuwarden.slurmconf.keys import parse_release  # noqa: PLC0415

    chosen = features or tuple(FEATURES)
    config_file = configmod.config_path(obj.config_path)
    slurm_version = None if release is None else parse_release(release)
    if release is not None and slurm_version is None:
        die(f"--slurm-version {release!r}: give a release such as 24.11 or 25.05.2 "
             "(`scontrol --version` on a Slurm host says which)", EXIT_CONFIG)
    # --check needs the config; the printed block only the Slurm commands' directory, so a
    # broken config file does not stop it (the commands are then looked for on PATH).
    cfg = obj.config_or_exit() if check_path is not None else None
    how = "--slurm-version"
    if slurm_version is None and (cfg is not None or part == "gpuwarden"):
        bin_dir = cfg.slurm.bin_dir if cfg is not None else _bin_dir_or_path(obj)
        runner = SubprocessRunner(lambda: bindir.locate(bin_dir, use_path=True).path)
        slurm_version, how = slurmconfcheck.running_version(runner), "scontrol --version"
    if cfg is not None:
        assert check_path is not None
        sys.exit(slurmconfcheck.check(
            check_path, chosen, slurmconfcheck.placement_wait_s(cfg.placement), click.echo,
            lambda line: click.echo(line, err=True), slurm_version=slurm_version,
            version_from=how, cluster_set=slurmconf.described(config_file)))
    if part == "gpuwarden":
        click.echo(slurmconfcheck.block(chosen, slurm_version=slurm_version), nl=False)
        return
    try:
        cluster = obj.config().cluster
        cluster = replace(
            cluster,
            nodes=cluster.nodes if nodes is None else nodes,
            nodes_per_leaf=cluster.nodes_per_leaf if nodes_per_leaf is None else nodes_per_leaf,
        )
    except ConfigError as exc:
        die(str(exc), EXIT_CONFIG)
    except ValueError as exc:
        die(f"bad option: {exc}", EXIT_CONFIG)
    if not example and not slurmconf.described(config_file):
        warning = slurmconf.example_warning(config_file, cluster)
        if part == "topology.conf":
            # The file the guide writes straight into /etc/slurm: refused, not just warned.
            die(f"{warning}; or pass --example to see the example's", EXIT_CONFIG)
        click.echo(f"gpuwarden: warning: {warning}", err=True)
    parts = slurmconf.PARTS if part == "all" else (part,)
    for i, p in enumerate(parts):
        if len(parts) > 1:
            click.echo(f"{'' if i == 0 else chr(10)}### {p}")
        click.echo(slurmconf.render(p, cluster, autodetect=autodetect), nl=False)
