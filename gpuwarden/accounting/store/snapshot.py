"""The store as its readers take it (`lemon scan`, `fleet mttf`, `report`): the manifest read
and checked (`manifest.parse`) and the files it names vetted (`storedir.vetted`) while the
store's directory is held open, so that what is read is what root or we wrote."""

from __future__ import annotations

import os
from dataclasses import dataclass

from gpuwarden.accounting.store import events as eventstore
from gpuwarden.accounting.store import files, manifest, storedir
from gpuwarden.accounting.store.manifest import Manifest
from gpuwarden.slurm.models import NodeEvent


@dataclass(frozen=True)
class Snapshot:
    manifest: Manifest
    files: tuple[str, ...]  # the runs files' paths, vetted
    events: str  # the node events file's path, vetted ("" for none)
    rollups: tuple[str, ...] = ()  # the runs files' rollups' paths, vetted (`files.rollup_of`)


def opened(store: str | os.PathLike[str]) -> Snapshot:
    """The store ``store`` to read (an empty one when it is not there); StoreError when it,
    its manifest or a file it names is not what gpuwarden wrote."""
    with storedir.reading(store) as d:
        if d is None:
            return Snapshot(Manifest(), (), "")
        m = manifest.load_at(d)
        runs = m.files
        found = storedir.vetted(d, [*runs, *map(files.rollup_of, runs),
                                    *([m.events] if m.events else [])])
    n = len(runs)
    return Snapshot(m, tuple(found[:n]), found[2 * n] if m.events else "",
                    tuple(found[n:2 * n]))


def events(snap: Snapshot) -> list[NodeEvent]:
    """The node events the store keeps ([] where none were ingested)."""
    return eventstore.read(snap.events) if snap.events else []
