"""Render the slurm.conf, gres.conf and topology.conf lines for a cluster description.

One description ([cluster] in the config) drives the node count and the switch layout; the
dockerized test cluster and `gpuwarden slurm-conf` use the same templates. Without [cluster] in
the config file the description is gpuwarden's example (ClusterConfig's defaults, c[1-8]), not
the site's: `described` tells the two apart.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwarden.config import ClusterConfig
from gpuwarden.slurm.hostlist import compress


@dataclass(frozen=True)
class Switch:
    name: str
    nodes: tuple[str, ...] = ()
    switches: tuple[str, ...] = ()

    @property
    def nodes_expr(self) -> str:
        return compress(self.nodes)

    @property
    def switches_expr(self) -> str:
        return compress(self.switches)


@dataclass(frozen=True)
class Layout:
    cluster: ClusterConfig
    nodes: tuple[str, ...]
    leaves: tuple[Switch, ...]
    spine: Switch

    @property
    def nodes_expr(self) -> str:
        return compress(self.nodes)

    @property
    def gpu_files(self) -> str:
        n = self.cluster.gpus_per_node
        return f"{self.cluster.gpu_device_dir}/nvidia" + ("0" if n == 1 else f"[0-{n - 1}]")


def layout(cluster: ClusterConfig) -> Layout:
    nodes = tuple(f"{cluster.node_prefix}{i}" for i in range(1, cluster.nodes + 1))
    per = cluster.nodes_per_leaf
    leaves = tuple(
        Switch(name=f"leaf{k + 1}", nodes=nodes[k * per : (k + 1) * per])
        for k in range((len(nodes) + per - 1) // per)
    )
    spine = Switch(name="spine", switches=tuple(leaf.name for leaf in leaves))
    return Layout(cluster=cluster, nodes=nodes, leaves=leaves, spine=spine)


@functools.cache
def _env() -> Any:
    # jinja2 is imported here, not at module load: the prolog's import path stays small.
    import jinja2  # noqa: PLC0415

    return jinja2.Environment(
        loader=jinja2.PackageLoader("gpuwarden", "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,  # noqa: S701 - renders config files, not HTML
    )

PARTS = ("slurm.conf", "gres.conf", "topology.conf")


def described(config_file: Path) -> bool:
    """Whether ``config_file`` sets [cluster] to something of its own: only then do the
    rendered lines describe the site's nodes and switches rather than the example's. A table
    that only repeats the defaults (what `gpuwarden config show > gpuwarden.toml` writes before
    the admin edits it) is the example still."""
    try:
        table = tomllib.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    cluster = table.get("cluster")
    if not isinstance(cluster, dict):
        return False
    defaults = dataclasses.asdict(ClusterConfig())
    return any(k not in defaults or v != defaults[k] for k, v in cluster.items())


def example_warning(config_file: Path, cluster: ClusterConfig) -> str:
    """Why lines rendered from the example [cluster] must not go into a site's files."""
    lay = layout(cluster)
    return (f"[cluster] in {config_file} is not set, or is still the defaults: these lines "
            "describe gpuwarden's example "
            f"cluster ({lay.nodes_expr}, {cluster.nodes_per_leaf} per leaf switch), not yours; "
            "Slurm only warns about nodes in topology.conf that it does not know, so placement "
            "would run with no real switches. Describe your nodes in [cluster] (name, "
            "node_prefix, nodes, nodes_per_leaf, gpus_per_node ...) first")


def render(part: str, cluster: ClusterConfig, **extra: object) -> str:
    if part not in PARTS:
        raise ValueError(f"unknown part {part!r}: one of {', '.join(PARTS)}")
    text: str = _env().get_template(f"{part}.j2").render(layout=layout(cluster), **extra)
    return text
