"""What every `gpuwarden` command shares: the config file, loaded once, and a Slurm client.

Below the features (the config layer), so each feature's commands take a typed ``obj:
Context`` rather than ``Any``; the top-level command tree creates it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NoReturn

import click

from gpuwarden import config as configmod
from gpuwarden.core.errors import ConfigError
from gpuwarden.slurm import bindir
from gpuwarden.slurm.client import CliSlurmClient, SlurmClient
from gpuwarden.slurm.runner import CommandRunner, DeadlineRunner, SubprocessRunner

EXIT_CONFIG = 2


@dataclass
class Context:
    """What commands share; tests replace the client factory with a fake."""

    config_path: str | None = None
    client_factory: Callable[[configmod.Config], SlurmClient] | None = None
    _config: configmod.Config | None = field(default=None, repr=False)

    _from_file: bool = field(default=False, repr=False)

    def config(self) -> configmod.Config:
        """The config; a missing default file means defaults (for the offline commands)."""
        if self._config is None:
            self._config = configmod.load(self.config_path)
        return self._config

    def config_required(self) -> configmod.Config:
        """The config for anything that acts on nodes (the hooks, health, nodes, drain,
        resume): a missing file is as broken as an invalid one (ConfigError)."""
        if not self._from_file:
            self._config = configmod.load(self.config_path, missing_ok=False)
            self._from_file = True
        assert self._config is not None
        return self._config

    def config_or_exit(self) -> configmod.Config:
        """The config, or exit 2 naming the file, key and what is expected. For commands; the
        Slurm entry points (prolog, epilog, health check) fail open instead."""
        try:
            return self.config()
        except ConfigError as exc:
            die(str(exc), EXIT_CONFIG)

    def client(self) -> SlurmClient:
        return self.client_for(self.config())

    def client_for(self, cfg: configmod.Config, *, use_path: bool = True,
                   end: float | None = None) -> SlurmClient:
        """A Slurm client for ``cfg``. Commands are run from the directory bindir.locate finds
        (checked, at the first call); ``use_path=False`` for what slurmd starts (it passes no
        PATH); ``end``: one time.monotonic() deadline for every call together."""
        if self.client_factory is not None:
            return self.client_factory(cfg)
        configured = cfg.slurm.bin_dir
        runner: CommandRunner = SubprocessRunner(
            lambda: bindir.locate(configured, use_path=use_path).path)
        if end is not None:
            runner = DeadlineRunner(runner, end)
        return CliSlurmClient(replace(cfg.slurm, bin_dir=""), runner)


def die(message: str, code: int) -> NoReturn:
    click.echo(f"gpuwarden: {message}", err=True)
    sys.exit(code)
