"""What an accounting store holds: `manifest.json` at its root, written last and atomically.

It names the schema version, every export ingested (its path, size, mtime and a fingerprint
of its content, the window its runs were counted in, the cluster it names, its malformed
records) with the Parquet files that hold its rows, and the node events file. Readers read
only the files it names, so a crash mid-ingest (files written, manifest not yet) leaves the
previous store as it was; the next ingest removes what no manifest names.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from gpuwarden.accounting.store.schema import VERSION
from gpuwarden.core.errors import GpuwardenError
from gpuwarden.core.safefs import atomic_write

NAME = "manifest.json"
SAMPLE = 1 << 20  # bytes hashed at each end of an export for its fingerprint


class StoreError(GpuwardenError):
    """A store that cannot be read or written as asked (another schema version, a bad
    manifest, exports that overlap)."""


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
    """The store's manifest; an empty one for a store not made yet (no manifest)."""
    p = Path(store) / NAME
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        return Manifest()
    except OSError as exc:
        raise StoreError(f"{p}: cannot read ({exc.strerror})") from None
    try:
        doc = json.loads(raw)
        version = doc["schema"]
    except (ValueError, KeyError, TypeError):
        raise StoreError(f"{p}: not a gpuwarden accounting store manifest") from None
    if version != VERSION:
        raise StoreError(
            f"{store}: an accounting store of schema version {version}; this gpuwarden reads "
            f"version {VERSION}: ingest the exports again into a new store (--store), or use "
            "the gpuwarden that wrote it")
    try:
        exports = tuple(Export(**{**e, "named": tuple(e["named"]), "files": tuple(e["files"])})
                        for e in doc["exports"])
        return Manifest(exports, doc.get("events", ""), doc.get("synced_to"), version,
                        doc.get("extra", {}))
    except (KeyError, TypeError) as exc:
        raise StoreError(f"{p}: a malformed manifest ({exc})") from None


def save(store: str | os.PathLike[str], m: Manifest) -> None:
    """The manifest replaced atomically (temp file, fsync, rename): the store's commit."""
    doc = {"schema": m.version, "exports": [asdict(e) for e in m.exports],
           "events": m.events, "synced_to": m.synced_to, "extra": m.extra}
    atomic_write(str(store), NAME, (json.dumps(doc, indent=1) + "\n").encode(), 0o644)
