"""Checkpoint core (issue 6, in progress): manifests, filesystem tiers, restore with walk-back."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import numpy as np
import pytest

from gpuwarden.ckpt import codec
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.manifest import Manifest, ManifestError, from_json, seal
from gpuwarden.ckpt.names import BadName, check_name, step_dir
from gpuwarden.ckpt.restore import restore
from gpuwarden.ckpt.tier import MANIFEST, TierError, TierFull


def state(seed: int) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    return {"weights": rng.standard_normal((64, 32)).astype(np.float32),
            "step_count": np.array([seed], dtype=np.int64), "optimizer": bytes([seed % 256]) * 100}


def save(tier: FsTier, step: int, st: dict[str, object]) -> Manifest:
    shards, data = codec.encode(st)
    m = Manifest("job-1", step, 1, 0, tuple(shards), time.time(), {"note": "t"})
    tier.commit(m, data)
    return m


def same(a: dict[str, object], b: dict[str, object]) -> bool:
    return a.keys() == b.keys() and all(
        np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k] for k in a)


@pytest.mark.parametrize("bad", ["../x", "..", ".hidden", "a/b", "", "x" * 129, "-rf"])
def test_names_that_could_leave_their_directory_are_refused(bad: str) -> None:
    with pytest.raises(BadName):
        check_name(bad)


def test_a_committed_step_restores_bit_identical(tmp_path: Path) -> None:
    t0 = FsTier("shm", str(tmp_path / "shm"), "job-1")
    st = state(3)
    save(t0, 10, st)
    got = restore([t0])
    assert got is not None and got.step == 10 and got.tier == "shm" and same(got.state, st)
    assert got.state["weights"].dtype == np.float32  # type: ignore[union-attr]
    assert oct(os.stat(t0.dir).st_mode & 0o777) == "0o700"


def test_a_step_without_its_manifest_is_invisible(tmp_path: Path) -> None:
    t0 = FsTier("shm", str(tmp_path), "job-1")
    save(t0, 1, state(1))
    save(t0, 2, state(2))
    os.unlink(os.path.join(t0.dir, step_dir(2), MANIFEST))  # as if the manifest never landed
    assert t0.steps() == [1]
    got = restore([t0])
    assert got is not None and got.step == 1


def test_a_flipped_byte_is_caught_and_the_same_step_taken_from_the_next_tier(
        tmp_path: Path) -> None:
    fast, slow = FsTier("shm", str(tmp_path / "a"), "job-1"), FsTier("fsx", str(tmp_path / "b"),
                                                                     "job-1")
    st = state(5)
    for t in (fast, slow):
        save(t, 7, st)
    shard = os.path.join(fast.dir, step_dir(7), "weights")
    raw = bytearray(Path(shard).read_bytes())
    raw[100] ^= 0x01
    Path(shard).write_bytes(bytes(raw))
    got = restore([fast, slow])
    assert got is not None and got.step == 7 and got.tier == "fsx" and same(got.state, st)
    assert "shm step 7: shard weights: checksum mismatch" in got.skipped[0]


def test_when_no_tier_has_a_good_copy_restore_walks_back(tmp_path: Path) -> None:
    t0 = FsTier("shm", str(tmp_path), "job-1")
    save(t0, 1, state(1))
    save(t0, 2, state(2))
    Path(os.path.join(t0.dir, step_dir(2), "optimizer")).write_bytes(b"x" * 100)
    got = restore([t0])
    assert got is not None and got.step == 1 and same(got.state, state(1))
    assert any("walking back" in s for s in got.skipped)


def test_out_of_space_is_a_clear_error_and_the_previous_step_stays(tmp_path: Path,
                                                                    monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import gpuwarden.ckpt.fstier as fstier

    t0 = FsTier("shm", str(tmp_path), "job-1")
    save(t0, 1, state(1))
    real = fstier._write_file

    def full(dir_fd: int, name: str, data: bytes | memoryview) -> None:
        if name == "optimizer":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(dir_fd, name, data)
    monkeypatch.setattr(fstier, "_write_file", full)
    with pytest.raises(TierFull, match="out of space writing step 2.*previous steps are intact"):
        save(t0, 2, state(2))
    assert t0.steps() == [1] and [n for n in os.listdir(t0.dir) if n.startswith(".")] == []
    got = restore([t0])
    assert got is not None and got.step == 1


def test_a_job_directory_someone_else_can_write_is_refused(tmp_path: Path) -> None:
    (tmp_path / "job-1").mkdir(mode=0o777)
    os.chmod(tmp_path / "job-1", 0o777)
    with pytest.raises(TierError, match="writable by group or others"):
        save(FsTier("fsx", str(tmp_path), "job-1"), 1, state(1))


def test_a_planted_symlink_is_never_followed(tmp_path: Path) -> None:
    t0 = FsTier("fsx", str(tmp_path), "job-1")
    save(t0, 1, state(1))
    target = os.path.join(t0.dir, step_dir(1), "weights")
    os.unlink(target)
    os.symlink("/etc/passwd", target)
    got = restore([t0])
    assert got is None  # the only step is unreadable through the link: nothing restored


@pytest.mark.parametrize("mutate,needle", [
    (lambda d: d.update(version=1), "version"),
    (lambda d: d.update(step=-1), "step"),
    (lambda d: d.update(job="../etc"), "job"),
    (lambda d: d["shards"][0].update(name="../../x"), "shards[0].name"),
    (lambda d: d["shards"][0].update(checksum="zz"), "shards[0].checksum"),
    (lambda d: d.update(rank=5), "rank"),
])
def test_a_bad_manifest_is_an_error_naming_the_field(mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    import json

    shards, _ = codec.encode(state(1))
    doc = json.loads(Manifest("job-1", 3, 2, 1, tuple(shards), 1.0, {}).to_json())
    mutate(doc)
    with pytest.raises(ManifestError) as err:
        from_json(json.dumps(seal(doc)), "m.json")  # resealed: the fields are checked too
    assert needle in str(err.value) and "m.json" in str(err.value)


def test_state_of_the_wrong_kind_is_refused() -> None:
    with pytest.raises(codec.StateError, match="expected bytes or a NumPy array"):
        codec.encode({"x": [1, 2, 3]})
    with pytest.raises(codec.StateError, match="Python objects"):
        codec.encode({"x": np.array([object()])})


def test_a_spool_another_user_planted_is_refused(tmp_path: Path) -> None:
    """A user who creates the shared spool first would own it, and with it everyone's job
    directories (sticky does not bind a directory's owner)."""
    spool = tmp_path / "spool"
    spool.mkdir(mode=0o1777)
    os.chmod(spool, 0o1777)
    if os.geteuid() == 0:
        os.chown(spool, 12345, 12345)
    tier = FsTier("shared", str(spool), "job-1")
    if os.geteuid() == 0:
        with pytest.raises(TierError, match="belongs to uid 12345"):
            tier.ensure_dir()
        os.chown(spool, 0, 0)
    os.chmod(spool, 0o777)
    with pytest.raises(TierError, match="sticky"):
        FsTier("shared", str(spool), "job-1").ensure_dir()
    os.chmod(spool, 0o1777)
    FsTier("shared", str(spool), "job-1").ensure_dir()
    link = tmp_path / "link"
    link.symlink_to(spool)
    with pytest.raises(TierError, match="not a directory"):
        FsTier("shared", str(link), "job-1").ensure_dir()
