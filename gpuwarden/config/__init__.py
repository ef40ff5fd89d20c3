"""gpuwarden's configuration: one TOML file loaded into frozen dataclasses, validated at load."""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwarden.config.accounting import AccountingConfig
from gpuwarden.config.ckpt import CkptConfig
from gpuwarden.config.health import HealthConfig
from gpuwarden.config.lemon import LemonConfig
from gpuwarden.config.placement import PlacementConfig
from gpuwarden.core.configload import LoadError, build, require, to_dict
from gpuwarden.core.errors import ConfigError
from gpuwarden.slurm.settings import SlurmConfig

DEFAULT_PATH = Path("/etc/gpuwarden/gpuwarden.toml")
ENV_VAR = "GPUWARDEN_CONFIG"

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,39}$")


@dataclass(frozen=True)
class ClusterConfig:
    """One description of a cluster, from which slurm.conf/gres.conf/topology.conf lines are made."""

    name: str = "gpuwarden"
    node_prefix: str = "c"
    nodes: int = 8
    nodes_per_leaf: int = 4
    gpus_per_node: int = 8
    gpu_type: str = "h100"
    gpu_device_dir: str = "/dev"
    cpus_per_node: int = 16
    real_memory_mb: int = 64000
    partition: str = "gpu"

    def __post_init__(self) -> None:
        require(bool(_NAME.match(self.name)), "name", "letters, digits, _ or -, 1-40 chars")
        require(
            bool(re.fullmatch(r"[a-z][a-z-]{0,15}", self.node_prefix)),
            "node_prefix",
            "lower-case letters or -, 1-16 chars",
        )
        require(1 <= self.nodes <= 100_000, "nodes", "an integer from 1 to 100000")
        require(1 <= self.nodes_per_leaf <= 4096, "nodes_per_leaf", "an integer from 1 to 4096")
        require(0 <= self.gpus_per_node <= 64, "gpus_per_node", "an integer from 0 to 64")
        require(bool(_NAME.match(self.gpu_type)), "gpu_type", "a GRES type name such as h100")
        require(
            bool(re.fullmatch(r"(/[A-Za-z0-9._-]+)+", self.gpu_device_dir)),
            "gpu_device_dir",
            "an absolute directory such as /dev",
        )
        require(1 <= self.cpus_per_node <= 4096, "cpus_per_node", "an integer from 1 to 4096")
        require(self.real_memory_mb >= 1, "real_memory_mb", "a positive integer (MB)")
        require(bool(_NAME.match(self.partition)), "partition", "a partition name")


@dataclass(frozen=True)
class LoggingConfig:
    level: str = "INFO"

    def __post_init__(self) -> None:
        levels = ("DEBUG", "INFO", "WARNING", "ERROR")
        require(self.level in levels, "level", f"one of {', '.join(levels)}")


@dataclass(frozen=True)
class Config:
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    lemon: LemonConfig = field(default_factory=LemonConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    accounting: AccountingConfig = field(default_factory=AccountingConfig)


def config_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    if explicit is not None:
        return Path(explicit)
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else DEFAULT_PATH


def parse(text: str, source: str) -> Config:
    """Parse TOML text into a Config; any problem is a ConfigError naming ``source``."""
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, "", f"not valid TOML ({exc})") from None
    try:
        return build(Config, table)
    except LoadError as exc:
        raise ConfigError(source, exc.key, exc.expected) from None


def load(path: str | os.PathLike[str] | None = None, *, missing_ok: bool = True) -> Config:
    """Load the config file; a missing default file means all defaults."""
    p = config_path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        explicit = path is not None or ENV_VAR in os.environ
        if missing_ok and not explicit:
            return Config()
        raise ConfigError(str(p), "", "file not found: write one (`gpuwarden config show > FILE` "
                          "prints the defaults) or point --config / $GPUWARDEN_CONFIG at "
                          "yours") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(p), "", f"cannot read ({exc})") from None
    return parse(text, str(p))


def toml_value(value: Any) -> str:
    """One value as TOML (`config show`, `config set`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        # Control characters would end the line (or the file's validity): TOML's \uXXXX.
        escaped = "".join(c if " " <= c != "\x7f" else f"\\u{ord(c):04x}" for c in escaped)
        return f'"{escaped}"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot render {value!r} as TOML")


def dumps(cfg: Config) -> str:
    """Render the effective configuration as TOML (round-trips through parse)."""
    lines: list[str] = []
    for section, table in to_dict(cfg).items():
        lines.append(f"[{section}]")
        lines.extend(f"{k} = {toml_value(v)}" for k, v in table.items())
        lines.append("")
    return "\n".join(lines)
