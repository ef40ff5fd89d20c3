"""A save in two halves (issue 15: DCP's coordinator writes its items beside the other ranks',
and only its metadata once all are done): nothing is visible until the second half, and an
abandoned first half leaves nothing behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from gpuwarden.ckpt import codec, nested
from gpuwarden.ckpt.checkpointer import Checkpointer
from gpuwarden.ckpt.codec import StateError
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.restore import restore
from gpuwarden.ckpt.tier import TierError


def _header(step: int, state: dict[str, object]) -> tuple[Manifest, dict[str, codec.Buf]]:
    shards, data = codec.encode(state, hashed=False)
    return Manifest("job-1", step, 1, 0, tuple(shards), time.time(), {}), dict(data)


def _entries(tier: FsTier) -> list[str]:
    return sorted(os.listdir(tier.dir))


def test_a_staged_step_is_invisible_until_committed_then_restores_whole(tmp_path: Path) -> None:
    t0 = FsTier("memory", str(tmp_path), "job-1")
    w = np.arange(1000, dtype=np.float32)
    header, data = _header(5, {"w": w})
    staged = t0.stage(header, data, hash_while_writing=True)
    assert t0.steps() == []
    assert restore([t0]) is None
    late, late_data = codec.encode({"meta": b"known only now"})
    m = staged.commit(late, late_data)
    assert [s.name for s in m.shards] == ["w", "meta"]
    got = restore([t0])
    assert got is not None and got.step == 5
    assert np.array_equal(got.state["w"], w) and got.state["meta"] == b"known only now"
    assert _entries(t0) == ["step-000000000005"]  # no temp dir left


def test_an_aborted_stage_leaves_nothing_and_the_older_step_stands(tmp_path: Path) -> None:
    t0 = FsTier("memory", str(tmp_path), "job-1")
    t0.commit(*_header(4, {"w": np.ones(10)}), hash_while_writing=True)
    t0.stage(*_header(5, {"w": np.zeros(10)}), hash_while_writing=True).abort()
    assert _entries(t0) == ["step-000000000004"]
    got = restore([t0])
    assert got is not None and got.step == 4


def test_a_late_shard_named_as_an_early_one_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    t0 = FsTier("memory", str(tmp_path), "job-1")
    staged = t0.stage(*_header(5, {"w": np.ones(10)}))
    late, late_data = codec.encode({"w": b"twice"})
    with pytest.raises(TierError, match="given twice"):
        staged.commit(late, late_data)
    assert _entries(t0) == []
    with pytest.raises(TierError, match="already committed or aborted"):
        staged.commit([], {})


def test_a_save_whose_late_value_never_came_saves_nothing(tmp_path: Path) -> None:
    ck = Checkpointer("job-1", FsTier("memory", str(tmp_path), "job-1"), [])
    try:
        ck.save(1, {"w": np.ones(4)})
        pending = ck.begin(2, {"w": np.zeros(4), "meta": nested.Later()})
        with pytest.raises(StateError, match="never given: nothing saved"):
            pending.commit()
        assert ck.tier0.steps() == [1]
        assert [n for n in _entries(ck.tier0) if n.startswith(".")] == []
        later = nested.Later()
        pending = ck.begin(3, {"w": np.full(4, 3.0), "meta": later})
        later.set(b"metadata")
        pending.commit()
        got = ck.restore()
        assert got is not None and got.step == 3
        assert got.state["meta"] == b"metadata" and np.array_equal(got.state["w"], np.full(4, 3.0))
    finally:
        ck.close()


def test_a_half_save_dropped_without_commit_or_abort_frees_its_bytes(tmp_path: Path) -> None:
    # DCP raises on every rank when one rank's write fails: the coordinator's writer, and
    # its half-written step in node memory (RAM), is then simply dropped.
    t0 = FsTier("memory", str(tmp_path), "job-1")
    staged = t0.stage(*_header(5, {"w": np.ones(1 << 16)}))
    assert len(_entries(t0)) == 1
    del staged
    assert _entries(t0) == []


def test_a_retry_of_a_step_already_committed_writes_nothing(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # Staging first wrote the whole step again before noticing it was there: on a nearly
    # full tier a retry of a durable step failed with TierFull.
    from gpuwarden.ckpt import fstier
    t0 = FsTier("shared", str(tmp_path), "job-1")
    header, data = _header(5, {"w": np.arange(100.0)})
    first = t0.commit(header, data, hash_while_writing=True)

    def no_write(*_a: object) -> None:
        raise AssertionError("a retry of the same step wrote a file")
    monkeypatch.setattr(fstier, "_write_file", no_write)
    assert t0.commit(header, data, hash_while_writing=True) == first


def test_late_shards_without_their_bytes_are_refused_and_leave_nothing(tmp_path: Path) -> None:
    t0 = FsTier("memory", str(tmp_path), "job-1")
    staged = t0.stage(*_header(5, {"w": np.ones(10)}))
    late, _ = codec.encode({"meta": b"x"})
    with pytest.raises(TierError, match="no bytes for shards"):
        staged.commit(late, {})
    assert _entries(t0) == []


def test_closing_the_checkpointer_frees_a_save_left_half_way(tmp_path: Path) -> None:
    ck = Checkpointer("job-1", FsTier("memory", str(tmp_path), "job-1"), [])
    pending = ck.begin(2, {"w": np.zeros(1 << 16), "meta": nested.Later()})
    assert len(_entries(ck.tier0)) == 1
    ck.close()
    assert _entries(ck.tier0) == []
    del pending
