"""What an accounting store holds: `manifest.json` at its root, written last and atomically.

It names the schema version, every export ingested (its path, size, mtime and a fingerprint
of its content, the window its runs were counted in, the cluster it names, its malformed
records) with the Parquet files that hold its rows, and the node events file. Readers read
only the files it names, so a crash mid-ingest (files written, manifest not yet) leaves the
previous store as it was; the next ingest removes what no manifest names. Its file entries
are store names, checked when read (`storedir.file_problem`): never a path that leads out.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from gpuwarden.accounting.store import storedir
from gpuwarden.accounting.store.schema import VERSION
from gpuwarden.accounting.store.storedir import Dir, StoreError
from gpuwarden.core.safefs import write_at

# StoreError too: callers import it from here, as before it moved to storedir.
__all__ = ["NAME", "Export", "Manifest", "StoreError", "fingerprint", "load", "load_at", "parse",
           "save"]

NAME = "manifest.json"
SAMPLE = 1 << 20  # bytes hashed at each end of an export for its fingerprint


@dataclass(frozen=True)
class Export:
    """One export ingested."""

    path: str  # as resolved when ingested
    size: int
    mtime_ns: int
    fingerprint: str  # blake2b of its size, first and last MiB: a changed file shows
    lo: float | None  # the window its runs were counted in (a run counts where it ended)
    hi: float | None
    named: tuple[float | None, float | None]  # the window its own "meta" names
    cluster: str
    rows: int  # records stored (those that ended in the window)
    malformed: int  # records that could not be read (counted, as the readers count them)
    first_bad: str
    files: tuple[str, ...]  # its Parquet files, relative to the store

    @property
    def window(self) -> tuple[float | None, float | None]:
        return (self.lo, self.hi)

    def same_file(self, size: int, mtime_ns: int, fingerprint: str) -> bool:
        return (self.size, self.mtime_ns, self.fingerprint) == (size, mtime_ns, fingerprint)


@dataclass(frozen=True)
class Manifest:
    exports: tuple[Export, ...] = ()
    events: str = ""  # the node events' Parquet file, relative to the store ("" for none)
    synced_to: float | None = None  # `accounting sync`: the end of the last window pulled
    version: int = VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def files(self) -> list[str]:
        return [f for e in self.exports for f in e.files]

    def without(self, paths: set[str]) -> Manifest:
        return replace(self, exports=tuple(e for e in self.exports if e.path not in paths))


def fingerprint(path: str, size: int) -> str:
    """A cheap content fingerprint: size, the first and the last MiB (an export that grew,
    shrank or was rewritten shows; one changed only in its middle keeps size and ends, and
    shows by its mtime)."""
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as fh:
        h.update(fh.read(SAMPLE))
        if size > SAMPLE:
            fh.seek(max(SAMPLE, size - SAMPLE))
            h.update(fh.read(SAMPLE))
    return h.hexdigest()


def load(store: str | os.PathLike[str]) -> Manifest:
    """The store's manifest, read as a reader reads it (`storedir.reading`); an empty one for
    a store not made yet."""
    with storedir.reading(store) as d:
        return Manifest() if d is None else load_at(d)


def load_at(d: Dir, upgradable: bool = False) -> Manifest:
    """The manifest of the open store ``d``; an empty one when there is none yet.
    ``upgradable``: a writer's, which upgrades a store of a version in `UPGRADES`
    (`store.upgrade`): such a manifest is returned with its own version."""
    raw = storedir.read_manifest(d, NAME)
    return (Manifest() if raw is None
            else parse(raw, f"{d.path}/{NAME}", str(d.path), upgradable))


UPGRADES = (1,)  # versions a writer upgrades in place (1: no rollups yet)


def parse(raw: bytes, p: str, store: str, upgradable: bool = False) -> Manifest:
    """A manifest's bytes (``p``: where they were read) checked: the version, every field,
    every file it names a store name."""
    try:
        doc = json.loads(raw)
        version = doc["schema"]
    except (ValueError, KeyError, TypeError):
        raise StoreError(f"{p}: not a gpuwarden accounting store manifest") from None
    if version in UPGRADES and not upgradable:
        raise StoreError(
            f"{store}: an accounting store of schema version {version}, written before the "
            f"rollups (this gpuwarden reads version {VERSION}): upgrade it in place by "
            "running `gpuwarden accounting sync` or `gpuwarden accounting ingest` on it once "
            "(each run file's rollup is made from the file; nothing is read again)")
    if version != VERSION and version not in UPGRADES:
        raise StoreError(
            f"{store}: an accounting store of schema version {version}; this gpuwarden reads "
            f"version {VERSION}: ingest the exports again into a new store (--store), or use "
            "the gpuwarden that wrote it")
    try:
        exports = tuple(Export(**{**e, "named": tuple(e["named"]), "files": tuple(e["files"])})
                        for e in doc["exports"])
        m = Manifest(exports, doc.get("events", ""), doc.get("synced_to"), version,
                     doc.get("extra", {}))
    except (KeyError, TypeError) as exc:
        raise StoreError(f"{p}: a malformed manifest ({exc})") from None
    names = [(f, storedir.file_problem(f) if isinstance(f, str) else "not a name")
             for f in m.files]
    if m.events:
        names.append((m.events, storedir.events_problem(m.events) if isinstance(m.events, str)
                      else "not a name"))
    for name, problem in names:
        if problem:
            raise StoreError(f"{p} names {name!r}, {problem}: a manifest gpuwarden did not "
                             "write; ingest the exports again into a new store")
    return m


def save(d: Dir, m: Manifest) -> None:
    """The manifest replaced atomically (temp file, fsync, rename): the store's commit."""
    doc = {"schema": m.version, "exports": [asdict(e) for e in m.exports],
           "events": m.events, "synced_to": m.synced_to, "extra": m.extra}
    write_at(d.fd, NAME, (json.dumps(doc, indent=1) + "\n").encode(), storedir.FILE_MODE)
