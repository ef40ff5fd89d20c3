"""State in, shards out: a mapping of names to bytes or NumPy arrays. Pure.

An array's bytes are its C-contiguous buffer; dtype and shape go in the manifest, so a restore
rebuilds the same array bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import xxhash

from gpuwarden.ckpt.manifest import Shard
from gpuwarden.ckpt.names import check_name
from gpuwarden.errors import GpuwardenError


class StateError(GpuwardenError):
    """A state value that cannot be checkpointed."""


Buf = bytes | bytearray | memoryview  # a shard's bytes, wherever they came from


def checksum(data: Buf) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def encode(state: Mapping[str, Any]) -> tuple[list[Shard], dict[str, memoryview]]:
    """Shards (for the manifest) and their bytes, without copying arrays."""
    shards, data = [], {}
    for name, value in state.items():
        check_name(name, "state key")
        if isinstance(value, (bytes, bytearray, memoryview)):
            buf = memoryview(value).cast("B")
            shards.append(Shard(name, buf.nbytes, checksum(buf)))
        elif isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                raise StateError(f"state key {name!r}: arrays of Python objects cannot be saved")
            arr = np.ascontiguousarray(value)
            buf = arr.data.cast("B")
            shards.append(Shard(name, buf.nbytes, checksum(buf), "ndarray", arr.dtype.str,
                                tuple(int(x) for x in arr.shape)))
        else:
            raise StateError(f"state key {name!r}: expected bytes or a NumPy array, got "
                             f"{type(value).__name__}")
        data[name] = buf
    return shards, data


def decode(shard: Shard, data: Buf) -> Any:
    if shard.kind == "bytes":
        return bytes(data)
    arr = np.frombuffer(data, dtype=np.dtype(shard.dtype)).reshape(shard.shape)
    # A bytearray was read for this restore alone: the array can own it, writable, no copy.
    return arr if isinstance(data, bytearray) else arr.copy()
