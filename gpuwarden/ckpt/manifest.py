"""A step's manifest: written last, it is what makes a step visible. Pure, but for one warning
for each legacy manifest read.

It decides how the shards' bytes are read back, so it is verified as strictly as they are:

* it is decoded by `safejson` (at most `MAX_BYTES`, no integer beyond 64 bits, no NaN or
  infinity, no key twice, no deep nesting, UTF-8 without lone surrogates): a user's file that
  holds anything else is refused naming the field, never an exception of another kind;
* every field is required (no defaults) and no other field is allowed;
* a shard's dtype must parse (``dtypes.parse``: canonical, never Python objects) and its size
  must equal the product of its shape times the dtype's item size; a ``bytes`` shard has the
  dtype ``""`` and the shape ``[]``;
* ``digest`` is ``sha256:`` over the canonical JSON of every other field (keys sorted, no
  spaces, ASCII), so damage or an edit by a tool that does not recompute it is caught. A digest
  does not stop someone who can write the file and recompute it: ownership checks do that.

A manifest that is not exactly what `to_json` writes is an error naming the file and the field,
and the step is treated as absent. Whether a manifest belongs where it was found (job, rank,
step) is `check_identity`'s question.

Version 1 (the previous release's, without ``digest``) is read, never written: a job
checkpointed before an upgrade must restore after it. It is held to every rule above but the
digest (it had every other field, always written), and each one read is logged as legacy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

from gpuwarden.ckpt.dtypes import DtypeError, parse
from gpuwarden.ckpt.names import BadName, check_name, check_step
from gpuwarden.core import safejson
from gpuwarden.core.errors import GpuwardenError

log = logging.getLogger(__name__)

VERSION = 2
LEGACY = 1  # read-only: the previous release's manifests, without a digest
ALGO = "xxh3_64"
KINDS = ("bytes", "ndarray")
_TOP = ("algo", "created_at", "job", "metadata", "rank", "shards", "step", "version",
        "world_size")
_SHARD = ("checksum", "dtype", "kind", "name", "shape", "size")
_MAX_NDIM = 64
MAX_BYTES = 16 << 20  # a manifest larger than this is not read
# A shard's size, and its shape's product times its items: what a file can hold (a size is
# compared with the file's before anything is read or allocated).
MAX_SIZE = safejson.MAX_INT


class ManifestError(GpuwardenError):
    """A manifest that cannot be trusted."""


@dataclass(frozen=True)
class Shard:
    name: str
    size: int
    checksum: str  # hex digest of the shard's bytes under ALGO
    kind: str = "bytes"
    dtype: str = ""  # ndarray only: dtypes.describe's text
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class Manifest:
    job: str
    step: int
    world_size: int
    rank: int
    shards: tuple[Shard, ...]
    created_at: float
    metadata: dict[str, str]
    algo: str = ALGO
    version: int = VERSION

    @property
    def total_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    def to_json(self) -> str:
        if self.version == LEGACY:  # as the previous release wrote it (a peer serves it so)
            return json.dumps(asdict(self), sort_keys=True, indent=1) + "\n"
        return json.dumps(seal(asdict(self)), sort_keys=True, indent=1) + "\n"


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def digest_of(body: dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(_canonical(body)).hexdigest()


def seal(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with ``digest`` set over every other field."""
    body = {k: v for k, v in doc.items() if k != "digest"}
    return {**body, "digest": digest_of(body)}


def _need(cond: bool, source: str, field: str, expected: str) -> None:
    if not cond:
        raise ManifestError(f"{source}: {field}: expected {expected}")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _keys(doc: dict[str, Any], wanted: tuple[str, ...], source: str, where: str) -> None:
    missing = [k for k in wanted if k not in doc]
    _need(not missing, source, f"{where}{missing[0] if missing else ''}", "a value (no defaults)")
    extra = sorted(k for k in doc if k not in wanted)
    _need(not extra, source, f"{where}{extra[0] if extra else ''}", "no such field")


def _shard(item: Any, source: str, i: int) -> Shard:
    where = f"shards[{i}]"
    _need(isinstance(item, dict), source, where, "an object")
    _keys(item, _SHARD, source, f"{where}.")
    try:
        name = check_name(item["name"], "shard")
    except BadName as exc:
        raise ManifestError(f"{source}: {where}.name: {exc}") from None
    size, checksum, kind = item["size"], item["checksum"], item["kind"]
    dtype, shape = item["dtype"], item["shape"]
    _need(_int(size) and 0 <= size <= MAX_SIZE, source, f"{where}.size",
          f"an integer from 0 to {MAX_SIZE}")
    _need(isinstance(checksum, str) and len(checksum) == 16
          and all(c in "0123456789abcdef" for c in checksum), source, f"{where}.checksum",
          "16 hex digits (xxh3_64)")
    _need(kind in KINDS, source, f"{where}.kind", "bytes or ndarray")
    _need(isinstance(shape, list) and len(shape) <= _MAX_NDIM
          and all(_int(x) and x >= 0 for x in shape), source, f"{where}.shape",
          f"a list of at most {_MAX_NDIM} integers >= 0")
    if kind == "bytes":
        _need(dtype == "", source, f"{where}.dtype", '"" for a bytes shard')
        _need(shape == [], source, f"{where}.shape", "[] for a bytes shard")
        return Shard(name, size, checksum, kind, "", ())
    try:
        itemsize = parse(dtype).itemsize
    except DtypeError as exc:
        raise ManifestError(f"{source}: {where}.dtype: {exc}") from None
    want = math.prod(shape) * itemsize
    _need(want <= MAX_SIZE, source, f"{where}.shape", f"a shape of at most {MAX_SIZE} bytes "
          f"(its product times the dtype's {itemsize}-byte items)")
    _need(size == want, source, f"{where}.size", f"{want} (the shape's product times the "
          f"dtype's {itemsize}-byte items)")
    return Shard(name, size, checksum, kind, dtype, tuple(shape))


def from_json(text: str | bytes, source: str) -> Manifest:
    """The manifest ``text`` (UTF-8 bytes, or text) holds; ManifestError naming the file and
    what is wrong with it, whatever it holds (`safejson`: no integer beyond 64 bits, no NaN,
    no key twice, no deep nesting, nothing past `MAX_BYTES`)."""
    try:
        doc = safejson.loads(text, max_bytes=MAX_BYTES)
    except safejson.JsonError as exc:
        raise ManifestError(f"{source}: {exc}") from None
    _need(isinstance(doc, dict), source, "manifest", "a JSON object")
    version = doc.get("version")
    _need(_int(version) and version in (VERSION, LEGACY), source, "version",
          f"{VERSION}, or {LEGACY} (legacy, read-only)")
    body = {k: v for k, v in doc.items() if k != "digest"}
    if version == LEGACY:
        # Nobody ever wrote a version-1 manifest with a digest: one is a forgery or damage.
        _need("digest" not in doc, source, "version", f"{VERSION} for a manifest with a digest")
    else:
        ok = doc.get("digest") == digest_of(body)
        _need(ok, source, "digest", "sha256 of the manifest's other fields: it was changed or "
              "damaged after it was written")
    _keys(body, _TOP, source, "")
    _need(body["algo"] == ALGO, source, "algo", ALGO)
    try:
        job = check_name(body["job"], "job")
        step = check_step(body["step"])
    except BadName as exc:
        raise ManifestError(f"{source}: {exc}") from None
    ws, rank = body["world_size"], body["rank"]
    _need(_int(ws) and ws >= 1, source, "world_size", "an integer >= 1")
    _need(_int(rank) and 0 <= rank < ws, source, "rank", "an integer in [0, world_size)")
    shards = body["shards"]
    _need(isinstance(shards, list), source, "shards", "a list")
    parsed = tuple(_shard(x, source, i) for i, x in enumerate(shards))
    _need(len({s.name for s in parsed}) == len(parsed), source, "shards", "unique names")
    created = body["created_at"]
    _need(isinstance(created, (int, float)) and not isinstance(created, bool)
          and math.isfinite(created), source, "created_at", "a time")
    meta = body["metadata"]
    _need(isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str)
                                         for k, v in meta.items()), source, "metadata",
          "an object of strings")
    if version == LEGACY and _first_legacy(source, job, rank, step):
        log.warning("%s: a legacy version-%d manifest (no digest) of %s rank %d step %d: "
                    "read-only, checked field by field and by its shards' checksums", source,
                    LEGACY, job, rank, step)
    return Manifest(job, step, ws, rank, parsed, float(created), dict(meta), ALGO, version)


_LEGACY_SEEN: set[tuple[str, str, int, int]] = set()
_LEGACY_SEEN_MAX = 100_000  # bounded: a long job reading many legacy steps


def _first_legacy(source: str, job: str, rank: int, step: int) -> bool:
    """True the first time this process reads this legacy manifest: warned once, not at every
    read (restore, retention and listing each read it)."""
    seen = (source, job, rank, step)
    if seen in _LEGACY_SEEN:
        return False
    if len(_LEGACY_SEEN) < _LEGACY_SEEN_MAX:
        _LEGACY_SEEN.add(seen)
    return True


def check_identity(m: Manifest, job: str, rank: int, step: int, source: str) -> None:
    """A manifest is used only where it was written: its job, rank and step are those of the
    place it was found (a step directory copied to another number, job or rank is refused)."""
    if (m.job, m.rank, m.step) != (job, rank, step):
        raise ManifestError(f"{source}: the manifest is of {m.job} rank {m.rank} step {m.step}, "
                            f"found where {job} rank {rank} step {step} belongs")
