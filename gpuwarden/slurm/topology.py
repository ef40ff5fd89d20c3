"""Parse Slurm's topology.conf (topology/tree and topology/block) into leaf groups. Pure.

A bad line is an error naming the file, the line number and what is wrong; nothing is guessed.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from gpuwarden.core.errors import GpuwardenError
from gpuwarden.slurm.hostlist import HostlistError, expand

log = logging.getLogger(__name__)


class TopologyError(GpuwardenError):
    """topology.conf cannot be used as it is."""


@dataclass(frozen=True)
class Leaf:
    """A leaf switch (tree) or a block: the nodes a gang job should stay within."""

    name: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Topology:
    kind: str  # "tree" or "block"
    leaves: tuple[Leaf, ...]
    block_sizes: tuple[int, ...] = ()

    def leaf_of(self) -> dict[str, str]:
        return {n: leaf.name for leaf in self.leaves for n in leaf.nodes}


_KV = re.compile(r"(\w+)=(\S+)")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def _leaf_fields(fields: dict[str, str], kinds: set[str]) -> tuple[str, str] | str | None:
    """(name, nodes expr) for a leaf line, None for a line placement skips, or why it is bad."""
    if "SwitchName" in fields:
        kinds.add("tree")
        name, above = fields["SwitchName"], "Switches" in fields
        problem = ("a switch has Nodes= or Switches=, not both" if "Nodes" in fields and above
                   else "" if "Nodes" in fields or above
                   else "a switch needs Nodes= (a leaf) or Switches= (above leaves)")
    elif "BlockName" in fields:
        kinds.add("block")
        name, above = fields["BlockName"], False
        problem = "" if "Nodes" in fields else "a block needs Nodes="
    else:
        problem, name, above = "expected SwitchName=, BlockName= or BlockSizes=", "", False
    if problem:
        return problem
    # A switch above the leaves: placement counts leaves only.
    return None if above else (name, fields["Nodes"])


def parse(text: str, source: str = "topology.conf") -> Topology:
    leaves: list[Leaf] = []
    kinds: set[str] = set()
    sizes: tuple[int, ...] = ()
    seen: dict[str, int] = {}
    owner: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue

        def bad(why: str, lineno: int = lineno, raw: str = raw) -> TopologyError:
            return TopologyError(f"{source}:{lineno}: {why}: {raw.strip()!r}")
        pairs = _KV.findall(line)
        if " ".join(f"{k}={v}" for k, v in pairs) != " ".join(line.split()):
            raise bad("expected Key=Value fields only")
        fields = dict(pairs)
        if "BlockSizes" in fields and "BlockName" not in fields:
            try:
                sizes = tuple(int(x) for x in fields["BlockSizes"].split(","))
            except ValueError:
                raise bad("BlockSizes= takes a list of integers") from None
            continue
        leaf = _leaf_fields(fields, kinds)
        if leaf is None:
            continue
        if isinstance(leaf, str):
            raise bad(leaf)
        name, expr = leaf
        if not _NAME.match(name):
            raise bad(f"{name!r} is not a valid name")
        if name in seen:
            raise bad(f"{name} is already defined on line {seen[name]}")
        seen[name] = lineno
        try:
            nodes = tuple(expand(expr))
        except HostlistError as exc:
            raise bad(f"Nodes=: {exc}") from None
        for n in nodes:
            if n in owner:
                raise bad(f"node {n} is already under {owner[n]}")
            owner[n] = name
        leaves.append(Leaf(name, nodes))
    if len(kinds) > 1:
        raise TopologyError(f"{source}: mixes SwitchName= (tree) and BlockName= (block) lines")
    if not leaves:
        raise TopologyError(f"{source}: no leaf switches or blocks with Nodes=")
    return Topology(kinds.pop(), tuple(leaves), sizes)


def leaf_of_file(path: str, otherwise: str) -> dict[str, str]:
    """Node -> leaf from a topology.conf, for jobs that only prefer a leaf: {} when the file
    cannot be read or parsed, logged with what the caller does ``otherwise``."""
    try:
        with open(path, encoding="utf-8") as fh:
            return parse(fh.read(), path).leaf_of()
    except (OSError, TopologyError) as exc:
        log.info("no leaf switches (%s): %s", exc, otherwise)
        return {}
