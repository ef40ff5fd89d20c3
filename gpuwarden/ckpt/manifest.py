"""A step's manifest: written last, it is what makes a step visible. Pure.

Every field is checked on reading; a manifest that is not exactly what `to_json` writes is an
error naming the file and the field, and the step is treated as absent.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from gpuwarden.ckpt.names import BadName, check_name, check_step
from gpuwarden.errors import GpuwardenError

VERSION = 1
ALGO = "xxh3_64"
KINDS = ("bytes", "ndarray")


class ManifestError(GpuwardenError):
    """A manifest that cannot be trusted."""


@dataclass(frozen=True)
class Shard:
    name: str
    size: int
    checksum: str  # hex digest of the shard's bytes under ALGO
    kind: str = "bytes"
    dtype: str = ""  # ndarray only
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
        return json.dumps(asdict(self), sort_keys=True, indent=1) + "\n"


def _need(cond: bool, source: str, field: str, expected: str) -> None:
    if not cond:
        raise ManifestError(f"{source}: {field}: expected {expected}")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _shard(item: Any, source: str, i: int) -> Shard:
    where = f"shards[{i}]"
    _need(isinstance(item, dict), source, where, "an object")
    try:
        name = check_name(item.get("name", ""), "shard")
    except BadName as exc:
        raise ManifestError(f"{source}: {where}.name: {exc}") from None
    size, checksum = item.get("size"), item.get("checksum")
    kind, dtype, shape = item.get("kind", "bytes"), item.get("dtype", ""), item.get("shape", [])
    _need(_int(size) and size >= 0, source, f"{where}.size", "an integer >= 0")
    _need(isinstance(checksum, str) and len(checksum) == 16
          and all(c in "0123456789abcdef" for c in checksum), source, f"{where}.checksum",
          "16 hex digits (xxh3_64)")
    _need(kind in KINDS, source, f"{where}.kind", "bytes or ndarray")
    _need(isinstance(dtype, str) and len(dtype) <= 16, source, f"{where}.dtype", "a dtype")
    _need(isinstance(shape, list) and all(_int(x) and x >= 0 for x in shape), source,
          f"{where}.shape", "a list of integers >= 0")
    return Shard(name, size, checksum, kind, dtype, tuple(shape))


def from_json(text: str, source: str) -> Manifest:
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{source}: not JSON ({exc})") from None
    _need(isinstance(doc, dict), source, "manifest", "a JSON object")
    _need(doc.get("version") == VERSION, source, "version", str(VERSION))
    _need(doc.get("algo") == ALGO, source, "algo", ALGO)
    try:
        job = check_name(doc.get("job", ""), "job")
        step = check_step(doc.get("step"))
    except BadName as exc:
        raise ManifestError(f"{source}: {exc}") from None
    ws, rank = doc.get("world_size"), doc.get("rank")
    _need(_int(ws) and ws >= 1, source, "world_size", "an integer >= 1")
    _need(_int(rank) and 0 <= rank < ws, source, "rank", "an integer in [0, world_size)")
    shards = doc.get("shards")
    _need(isinstance(shards, list), source, "shards", "a list")
    parsed = tuple(_shard(x, source, i) for i, x in enumerate(shards))
    _need(len({s.name for s in parsed}) == len(parsed), source, "shards", "unique names")
    created = doc.get("created_at")
    _need(isinstance(created, (int, float)), source, "created_at", "a time")
    meta = doc.get("metadata", {})
    _need(isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str)
                                         for k, v in meta.items()), source, "metadata",
          "an object of strings")
    return Manifest(job, step, ws, rank, parsed, float(created), dict(meta))
