"""Tier 0 restores can map the shards' pages instead of copying them (mapped=True): the
arrays are the caller's own (writable, and a write never reaches the file) and stay valid
after tier 0 is pruned; a damaged shard is still caught by its checksum."""

from __future__ import annotations

import mmap
import os
import shutil
from pathlib import Path

import numpy as np

from gpuwarden.ckpt.build import tiers
from gpuwarden.ckpt.checkpointer import Checkpointer
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.config.ckpt import CkptConfig


def owner(a: object) -> object:
    """What finally holds an array's memory."""
    while (isinstance(a, np.ndarray) and a.base is not None) or isinstance(a, memoryview):
        a = a.base if isinstance(a, np.ndarray) else a.obj
    return a


def test_node_memory_is_mapped_and_the_shared_tier_is_not(tmp_path: Path) -> None:
    memory, shared = tiers(CkptConfig(memory_root=str(tmp_path / "m"),
                                      shared_root=str(tmp_path / "s")), "job-5", 0)
    assert memory.map_reads and not shared.map_reads


def test_restored_arrays_are_private_and_outlive_the_tier(tmp_path: Path) -> None:
    tier = FsTier("memory", str(tmp_path / "shm"), "job-5", map_reads=True)
    ck = Checkpointer("job-5", tier, [])
    w = np.arange(1 << 16, dtype=np.float64)
    ck.save(1, {"w": w, "b": b"abc"})
    copied = ck.restore()
    got = ck.restore(mapped=True)
    ck.close()
    assert got is not None and got.state["b"] == b"abc" and copied is not None
    # By default the caller gets its own memory; mapped=True the tier's pages, copy-on-write.
    assert not isinstance(owner(copied.state["w"]), mmap.mmap)
    arr = got.state["w"]
    assert isinstance(owner(arr), mmap.mmap)
    assert arr.flags.writeable and np.array_equal(arr, w)
    arr[:10] = -1.0  # the caller's own copy-on-write pages
    again = Checkpointer("job-5", FsTier("memory", str(tmp_path / "shm"), "job-5",
                                         map_reads=True), []).restore(mapped=True)
    assert again is not None and np.array_equal(again.state["w"], w)
    shutil.rmtree(tmp_path / "shm")  # retention prunes tier 0
    assert arr[10:].sum() == w[10:].sum() and arr[0] == -1.0


def test_a_flipped_byte_in_a_mapped_shard_is_caught(tmp_path: Path) -> None:
    ck = Checkpointer("job-5", FsTier("memory", str(tmp_path / "shm"), "job-5", map_reads=True),
                      [], keep=2)
    ck.save(1, {"w": np.ones(1000)})
    ck.save(2, {"w": np.full(1000, 2.0)})
    ck.close()
    shard = tmp_path / "shm" / "job-5" / "rank-00000" / "step-000000000002" / "w"
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 1
    os.chmod(shard, 0o600)
    shard.write_bytes(bytes(raw))
    got = Checkpointer("job-5", FsTier("memory", str(tmp_path / "shm"), "job-5",
                                       map_reads=True), []).restore(mapped=True)
    assert got is not None and got.step == 1 and got.state["w"][0] == 1.0
