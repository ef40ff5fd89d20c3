"""Whether a node's health gating is on and current, from the marker it keeps in Slurm (its
node `Extra`, `marker`): what `gpuwarden nodes` flags and the fleet report lists. Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuwarden.health import marker
from gpuwarden.health.marker import Marker


@dataclass(frozen=True)
class NodeGating:
    node: str
    marker: Marker | None  # None: the node never posted one (or Extra holds other text)
    note: str  # why gating is off or stale there; "" when it is on and current

    def as_json(self) -> dict[str, Any] | None:
        """The marker with its note (`gpuwarden nodes --json`); None without a marker."""
        if self.marker is None:
            return None
        return {**self.marker.to_json(), "note": self.note}


def of_node(node: str, extra: str, now: float) -> NodeGating:
    m = marker.decode(extra)
    return NodeGating(node, m, marker.describe(m, now))
