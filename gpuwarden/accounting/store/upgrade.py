"""A store of an older schema version (`manifest.UPGRADES`) brought to this one in place by the
writers (`accounting ingest`, `accounting sync`) before they write: version 1 had no rollups,
so each runs file's is made from the file (`files.write_rollup`), then the manifest is saved
with the new version, last, as every write of the store is committed. A crash before that
leaves the store at version 1 (its new rollups unread; the next writer writes them again)."""

from __future__ import annotations

import logging
from dataclasses import replace

import polars as pl

from gpuwarden.accounting.store import files, manifest, storedir
from gpuwarden.accounting.store.manifest import Manifest
from gpuwarden.accounting.store.schema import VERSION
from gpuwarden.accounting.store.storedir import Dir, StoreError

log = logging.getLogger(__name__)


def upgraded(store: Dir, m: Manifest) -> Manifest:
    """``m`` (the open store's, `manifest.load_at(..., upgradable=True)`) at this version,
    the store upgraded and its manifest saved when it was older."""
    if m.version == VERSION:
        return m
    rels = m.files
    for rel, path in zip(rels, storedir.vetted(store, rels), strict=True):
        try:
            runs = pl.read_parquet(path, glob=False)
        except (pl.exceptions.PolarsError, OSError) as exc:
            raise StoreError(f"{path}: cannot be read to upgrade the store ({exc}); ingest "
                             "the exports again into a new store") from None
        files.write_rollup(store, rel, runs)
    new = replace(m, version=VERSION)
    manifest.save(store, new)
    log.warning("%s: upgraded from schema version %d to %d (%d runs files' rollups written)",
                store.path, m.version, VERSION, len(rels))
    return new
