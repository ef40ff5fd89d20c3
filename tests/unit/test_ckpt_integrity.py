"""Issue 12, items 2, 3 and 5: the manifest is verified too, restore walks back whatever it
meets, and every array comes back as it went in."""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuwarden.ckpt import codec
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.manifest import Manifest, ManifestError, from_json, seal
from gpuwarden.ckpt.names import BadName, check_name, step_dir
from gpuwarden.ckpt.restore import TiersUnavailable, restore
from gpuwarden.ckpt.tier import MANIFEST, TierError, TierFull

JOB = "job-1"


def state(seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"weights": rng.standard_normal((64, 32)).astype(np.float32),
            "optimizer": bytes([seed % 256]) * 100}


def save(tier: FsTier, step: int, st: dict[str, Any], job: str = JOB, rank: int = 0) -> None:
    shards, data = codec.encode(st)
    tier.commit(Manifest(job, step, 2, rank, tuple(shards), time.time(), {"note": "t"}), data)


def two_tiers(tmp_path: Path, step: int = 7, seed: int = 5) -> tuple[FsTier, FsTier]:
    fast, slow = FsTier("memory", str(tmp_path / "a"), JOB), FsTier("shared", str(tmp_path / "b"),
                                                                     JOB)
    for t in (fast, slow):
        save(t, step, state(seed))
    return fast, slow


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        isinstance(a[k], np.ndarray) and a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and a[k].tobytes() == b[k].tobytes() if isinstance(b[k], np.ndarray) else a[k] == b[k]
        for k in a)


def manifest_path(tier: FsTier, step: int) -> Path:
    return Path(tier.dir) / step_dir(step) / MANIFEST


def edit(tier: FsTier, step: int, change: Callable[[dict[str, Any]], None],
         reseal: bool = False) -> None:
    """Change a manifest on disk the way a tool or a person would: the digest is left alone
    unless ``reseal`` (a forger who recomputes it)."""
    path = manifest_path(tier, step)
    doc = json.loads(path.read_text())
    change(doc)
    if reseal:
        doc = seal(doc)
    os.chmod(path, 0o600)
    path.write_text(json.dumps(doc))


def weights(doc: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in doc["shards"] if s["name"] == "weights")


# ---- item 2: the manifest is verified --------------------------------------------------------
@pytest.mark.parametrize("change", [
    pytest.param(lambda d: weights(d).update(dtype=">f4"), id="dtype-byte-swapped"),
    pytest.param(lambda d: weights(d).update(kind="bytes", dtype="", shape=[]), id="kind"),
    pytest.param(lambda d: weights(d).update(shape=[32, 64]), id="shape"),
    pytest.param(lambda d: d.update(shards=[s for s in d["shards"] if s["name"] != "optimizer"]),
                 id="dropped-shard"),
    pytest.param(lambda d: d["metadata"].update(note="edited"), id="metadata"),
])
def test_an_edited_manifest_is_refused_and_restore_takes_the_intact_copy(
        tmp_path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    fast, slow = two_tiers(tmp_path)
    edit(fast, 7, change)
    got = restore([fast, slow])
    assert got is not None and got.step == 7 and got.tier == "shared"
    assert same(got.state, state(5))
    assert "memory step 7" in got.skipped[0] and "digest" in got.skipped[0]


def test_a_step_directory_copied_to_another_number_restores_as_what_it_is_not(
        tmp_path: Path) -> None:
    t0 = FsTier("memory", str(tmp_path), JOB)
    save(t0, 30, state(30))
    shutil.copytree(Path(t0.dir) / step_dir(30), Path(t0.dir) / step_dir(40))
    got = restore([t0])
    assert got is not None and got.step == 30 and got.manifest.step == got.step
    assert "memory step 40" in got.skipped[0] and "step 30" in got.skipped[0]


def test_a_manifest_naming_another_job_or_rank_is_refused(tmp_path: Path) -> None:
    other_job = FsTier("memory", str(tmp_path), "job-2")
    other_rank = FsTier("memory", str(tmp_path), JOB, 1)
    save(other_job, 5, state(1), job="job-2")
    save(other_rank, 6, state(2), rank=1)
    mine = FsTier("memory", str(tmp_path), JOB, 0)
    os.makedirs(mine.dir, mode=0o700)
    shutil.copytree(Path(other_job.dir) / step_dir(5), Path(mine.dir) / step_dir(5))
    shutil.copytree(Path(other_rank.dir) / step_dir(6), Path(mine.dir) / step_dir(6))
    assert restore([mine]) is None
    with pytest.raises(Exception, match="job-2"):
        mine.load(5)
    with pytest.raises(Exception, match="rank 1"):
        mine.load(6)


@pytest.mark.parametrize("change,needle", [
    (lambda d: d.pop("metadata"), "metadata"),
    (lambda d: d.pop("created_at"), "created_at"),
    (lambda d: weights(d).pop("kind"), "shards[0].kind"),
    (lambda d: weights(d).pop("shape"), "shards[0].shape"),
    (lambda d: weights(d).update(dtype="<f4x"), "shards[0].dtype"),
    (lambda d: weights(d).update(dtype="|O"), "shards[0].dtype"),
    (lambda d: weights(d).update(dtype="i4,f8"), "shards[0].dtype"),
    (lambda d: weights(d).update(size=4), "shards[0].size"),
    (lambda d: d["shards"][1].update(shape=[100]), "shards[1].shape"),
    (lambda d: d.update(surprise=1), "surprise"),
])
def test_a_resealed_manifest_is_still_checked_field_by_field_without_defaults(
        change: Callable[[dict[str, Any]], None], needle: str) -> None:
    shards, _ = codec.encode(state(1))
    doc = json.loads(Manifest(JOB, 3, 1, 0, tuple(shards), 1.0, {}).to_json())
    change(doc)
    with pytest.raises(ManifestError) as err:
        from_json(json.dumps(seal(doc)), "m.json")
    assert needle in str(err.value) and "m.json" in str(err.value)


# ---- item 3: restore walks back whatever it meets -------------------------------------------
def test_a_manifest_nested_too_deep_walks_back(tmp_path: Path) -> None:
    fast, slow = two_tiers(tmp_path)
    path = manifest_path(fast, 7)
    os.chmod(path, 0o600)
    path.write_text("[" * 200_000 + "]" * 200_000)
    got = restore([fast, slow])
    assert got is not None and got.tier == "shared" and same(got.state, state(5))


@pytest.mark.parametrize("dtype", ["<f4x", "|O", "|V3"])
def test_a_resealed_manifest_that_cannot_be_decoded_walks_back(tmp_path: Path,
                                                               dtype: str) -> None:
    fast, slow = two_tiers(tmp_path)
    edit(fast, 7, lambda d: weights(d).update(dtype=dtype), reseal=True)
    got = restore([fast, slow])
    assert got is not None and got.tier == "shared" and same(got.state, state(5))


class Unreachable:
    name = "s3"

    def steps(self) -> list[int]:
        raise TierError("s3: cannot list s3://b/job-1/rank-00000 (Could not connect)")

    def load(self, step: int) -> Any:
        raise AssertionError("never listed, never loaded")


def test_s3_unreachable_does_not_stop_the_tiers_that_hold_the_step(tmp_path: Path) -> None:
    fast, slow = two_tiers(tmp_path)
    got = restore([fast, slow, Unreachable()])
    assert got is not None and got.step == 7 and got.tier == "memory"
    assert any("s3: cannot list" in s for s in got.skipped)


def test_with_nothing_restored_and_a_tier_unlisted_restore_does_not_say_start_fresh(
        tmp_path: Path) -> None:
    empty = FsTier("memory", str(tmp_path), JOB)
    with pytest.raises(TiersUnavailable, match="s3: cannot list"):
        restore([empty, Unreachable()])
    assert restore([empty]) is None  # every tier answered: nothing to restore, start fresh


def test_tier0_out_of_inodes_is_tier_full_not_a_raw_os_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t0 = FsTier("memory", str(tmp_path), JOB)
    save(t0, 1, state(1))
    real = os.mkdir

    def no_inodes(path: Any, *args: Any, **kwargs: Any) -> None:
        if os.path.basename(str(path)).startswith(".step-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, *args, **kwargs)
    monkeypatch.setattr(os, "mkdir", no_inodes)
    with pytest.raises(TierFull, match="out of space writing step 2.*previous steps are intact"):
        save(t0, 2, state(2))
    monkeypatch.undo()
    assert t0.steps() == [1]


# ---- item 5: every array comes back as it went in --------------------------------------------
ARRAYS: dict[str, Any] = {
    "scalar-0d": np.array(1.5, dtype=np.float32),
    "int-0d": np.array(7, dtype=np.int64),
    "structured": np.array([(1, 2.5, b"ab"), (3, 4.5, b"cd")],
                           dtype=[("a", "<i4"), ("b", "<f8"), ("c", "S2")]),
    "aligned": np.zeros(3, dtype=np.dtype([("a", "u1"), ("b", "<i4")], align=True)),
    "nested": np.zeros(2, dtype=[("x", [("y", "<i2", (3,))]), ("z", ">f4")]),
    "offsets": np.zeros(2, dtype={"names": ["a"], "formats": ["<i4"], "offsets": [4],
                                  "itemsize": 12}),
    "titles": np.zeros(2, dtype=[(("the a", "a"), "<i4")]),
    "empty-2d": np.zeros((0, 3)),
    "empty-structured": np.zeros((2, 0), dtype=[("a", "<i4")]),
    "datetime": np.array(["2026-01-01T00:00:01", "NaT"], dtype="datetime64[s]"),
    "timedelta": np.array([1, 2], dtype="timedelta64[ns]"),
    "unicode": np.array(["héllo", "x"]),
    "bytes-S": np.array([b"a", b"bcd"]),
    "void": np.array([b"\x00\x01\x02"], dtype="V3"),
    "bool": np.array([True, False]),
    "float16": np.arange(5, dtype=np.float16),
    "longdouble": np.arange(3, dtype=np.longdouble) / 3,
    "complex": np.arange(4, dtype=np.complex128) * 1j,
    "big-endian": np.arange(4, dtype=">i8"),
    "transposed": np.arange(12, dtype=np.int32).reshape(3, 4).T,
    "sliced": np.arange(20, dtype=np.float64)[::3],
    "fortran": np.asfortranarray(np.arange(6, dtype=np.uint16).reshape(2, 3)),
    "high-dim": np.zeros((1,) * 20, dtype=np.int8),
}


@pytest.mark.parametrize("key", list(ARRAYS))
def test_every_array_comes_back_as_it_went_in(tmp_path: Path, key: str) -> None:
    t0 = FsTier("memory", str(tmp_path), JOB)
    value = ARRAYS[key]
    save(t0, 1, {key: value})
    got = restore([t0])
    assert got is not None
    back = got.state[key]
    assert back.dtype == value.dtype and back.dtype.names == value.dtype.names
    assert back.dtype.fields == value.dtype.fields
    assert back.shape == value.shape and back.tobytes() == value.tobytes()
    assert np.array_equal(back, value, equal_nan=False) or value.dtype.kind in "MmV" \
        or value.dtype.names is not None


@pytest.mark.parametrize("value", [np.array([object()]),
                                   np.array(["a"], dtype=np.dtypes.StringDType()),
                                   np.zeros(2, dtype=[("a", "O")])])
def test_arrays_that_cannot_round_trip_are_refused_at_save_naming_the_key(value: Any) -> None:
    with pytest.raises(codec.StateError, match="state key 'moments'"):
        codec.encode({"moments": value})


@pytest.mark.parametrize("bad", ["job\n", "job-1\n", "a\nb"])
def test_a_name_with_a_trailing_newline_is_refused(bad: str) -> None:
    with pytest.raises(BadName):
        check_name(bad)
