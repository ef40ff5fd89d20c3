"""The node events (`sacctmgr show events`) kept in the store beside the runs, one Parquet
file at its root. Events ingested again (a later export of the same span) replace the ones
with the same node, start, state and reason: an event still open then (end "Unknown") gets its
end. Pure apart from `read` and `write`; a file that is not one (corrupt, forged) is a
StoreError, not polars' own."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import astuple, fields
from pathlib import Path

import polars as pl

from gpuwarden.accounting.store.files import write_file
from gpuwarden.accounting.store.storedir import Dir, StoreError
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


def read(path: str | Path) -> list[NodeEvent]:
    """The events file ``path`` (vetted: `storedir.vetted`)."""
    try:
        df = pl.read_parquet(path, glob=False)
        wrong = [n for n in NAMES if df.schema.get(n) != pl.String]
        if wrong:
            raise StoreError(f"{path}: the node events file cannot be read (column "
                             f"{wrong[0]} missing or not text); ingest the exports again "
                             "into a new store")
        return [NodeEvent(*row) for row in df.select(NAMES).iter_rows()]
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise StoreError(f"{path}: the node events file cannot be read ({exc}); ingest the "
                         "exports again into a new store") from None


def write(store: Dir, name: str, events: Sequence[NodeEvent]) -> None:
    write_file(store.fd, name, pl.DataFrame([astuple(e) for e in events], schema=SCHEMA,
                                            orient="row"))
