"""The node events (`sacctmgr show events`) kept in the store beside the runs, one Parquet
file at its root. Events ingested again (a later export of the same span) replace the ones
with the same node, start, state and reason: an event still open then (end "Unknown") gets its
end. Pure apart from `read` and `write`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import astuple, fields
from pathlib import Path

import polars as pl

from gpuwarden.slurm.models import NodeEvent

NAMES = tuple(f.name for f in fields(NodeEvent))
SCHEMA = pl.Schema(dict.fromkeys(NAMES, pl.String))


def merged(old: Iterable[NodeEvent], new: Iterable[NodeEvent]) -> list[NodeEvent]:
    """``old`` and ``new``, one event per (cluster, node, start, state, reason), the newer one
    kept; in start order."""
    out: dict[tuple[str, ...], NodeEvent] = {}
    for e in (*old, *new):
        out[(e.cluster, e.node, e.start, e.state, e.reason)] = e
    return sorted(out.values(), key=lambda e: (e.start, e.node, e.state, e.reason))


def read(path: Path) -> list[NodeEvent]:
    df = pl.read_parquet(path)
    return [NodeEvent(*row) for row in df.select(NAMES).iter_rows()]


def write(path: Path, events: Sequence[NodeEvent]) -> None:
    pl.DataFrame([astuple(e) for e in events], schema=SCHEMA, orient="row").write_parquet(path)
