"""State in, shards out: a mapping of names to bytes or NumPy arrays. Pure.

An array's bytes are its C-ordered buffer; its dtype (as `dtypes.describe` writes it: fields,
offsets and units included) and its shape go in the manifest, so a restore rebuilds the same
array bit for bit: 0-d arrays keep the shape (), empty arrays save, structured dtypes keep their
fields. A dtype that could not come back as it went in (Python objects, NumPy's variable-width
strings) is refused at save, with an error naming the key.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Mapping
from typing import Any

import numpy as np
import xxhash

from gpuwarden.ckpt.dtypes import DtypeError, describe, parse
from gpuwarden.ckpt.manifest import Shard
from gpuwarden.ckpt.names import check_name
from gpuwarden.core.errors import GpuwardenError

# The ckpt extra names xxhash with no floor (pyproject.toml: Debian's package says 0.0.0), so
# the version that matters is checked here: xxh3 came with python-xxhash 2.0.
if not hasattr(xxhash, "xxh3_64"):  # pragma: no cover - no supported distribution is that old
    raise ImportError(f"xxhash {getattr(xxhash, 'VERSION', '?')} has no xxh3: gpuwarden's "
                      "checkpoints need python-xxhash 2.0 or newer (pip install -U xxhash)")


class StateError(GpuwardenError):
    """A state value that cannot be checkpointed, or a shard that cannot be decoded."""


# A shard's bytes, wherever they came from; an mmap is a private copy-on-write mapping of a
# tier-0 file (safeio.map_file), the restore's own like a bytearray.
Buf = bytes | bytearray | memoryview | mmap.mmap


def checksum(data: Buf) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def _array_shard(name: str, value: np.ndarray[Any, Any],
                 hashed: bool = True) -> tuple[Shard, memoryview]:
    dt = value.dtype
    try:
        if dt.hasobject:
            raise DtypeError("arrays of Python objects cannot be saved")
        text = describe(dt)
        back = parse(text)
    except DtypeError as exc:
        raise StateError(f"state key {name!r}: dtype {dt}: {exc}") from None
    if back != dt or back.fields != dt.fields:
        raise StateError(f"state key {name!r}: dtype {dt} would not come back as it went in")
    # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
    arr = value if value.flags.c_contiguous else value.copy(order="C")
    # A flat byte view works for every dtype, datetimes and structured ones included.
    buf = memoryview(b"") if arr.nbytes == 0 else arr.reshape(-1).view(np.uint8).data
    return Shard(name, buf.nbytes, checksum(buf) if hashed else "", "ndarray", text,
                 tuple(int(x) for x in arr.shape)), buf


def encode(state: Mapping[str, Any],
           hashed: bool = True) -> tuple[list[Shard], dict[str, memoryview]]:
    """Shards (for the manifest) and their bytes, without copying C-ordered arrays.
    ``hashed=False`` leaves each checksum empty, for a writer that hashes while it writes
    (`FsTier.commit(..., hash_while_writing=True)`)."""
    shards, data = [], {}
    for name, value in state.items():
        check_name(name, "state key")
        if isinstance(value, (bytes, bytearray, memoryview)):
            buf = memoryview(value).cast("B")
            shard = Shard(name, buf.nbytes, checksum(buf) if hashed else "")
        elif isinstance(value, np.ndarray):
            shard, buf = _array_shard(name, value, hashed)
        else:
            raise StateError(f"state key {name!r}: expected bytes or a NumPy array, got "
                             f"{type(value).__name__}")
        shards.append(shard)
        data[name] = buf
    return shards, data


def decode(shard: Shard, data: Buf) -> Any:
    """The value a verified shard holds; StateError when the shard cannot be one (a manifest
    read through `manifest.from_json` never gives such a shard)."""
    if shard.kind == "bytes":
        return bytes(data)
    try:
        dt = parse(shard.dtype)
    except DtypeError as exc:
        raise StateError(f"shard {shard.name}: dtype: {exc}") from None
    count = math.prod(shard.shape)
    if memoryview(data).nbytes != count * dt.itemsize:
        raise StateError(f"shard {shard.name}: {memoryview(data).nbytes} bytes for shape "
                         f"{shard.shape} of {dt}")
    if count == 0 or dt.itemsize == 0:
        try:
            return np.zeros(shard.shape, dtype=dt)
        except (ValueError, OverflowError, MemoryError) as exc:  # (0, 2**62, 2**62): too big
            raise StateError(f"shard {shard.name}: shape {shard.shape[:8]} of {dt}: "
                             f"{str(exc)[:120]}") from None
    arr = np.frombuffer(data, dtype=dt, count=count).reshape(shard.shape)
    # A bytearray read, or a private mapping made, for this restore alone: the array can own
    # it, writable, no copy.
    return arr if isinstance(data, (bytearray, mmap.mmap)) else arr.copy()
