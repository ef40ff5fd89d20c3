"""Version-1 manifests (the previous release's, no digest) restore after an upgrade, read-only,
checked as strictly as version 2 for every field they had.

`write_v1` writes a step exactly as the previous release did (`git show 0ac749f:` of
gpuwarden/ckpt/manifest.py, codec.py and fstier.py): each array's ``np.ascontiguousarray``
bytes with ``dtype.str`` and its shape, ``json.dumps(asdict(manifest), sort_keys=True,
indent=1) + "\\n"`` with ``version: 1``, the manifest written last.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.job import JobCheckpointer, JobEnv
from gpuwarden.ckpt.manifest import Manifest, ManifestError, from_json
from gpuwarden.ckpt.names import step_dir
from gpuwarden.ckpt.restore import restore
from gpuwarden.ckpt.tier import MANIFEST, TierError
from gpuwarden.config.ckpt import CkptConfig

JOB = "job-77"
PAIR = np.dtype([("a", "<i4"), ("b", "<f8")])


def old_state(step: int) -> dict[str, Any]:
    return {"w": np.full((16, 8), step, dtype=np.float32),
            "ids": np.arange(step, step + 5, dtype=">i8"),
            "pairs": np.array([(step, 0.5)], dtype=PAIR),  # v1 kept only "|V12" of it
            "tag": f"s{step}".encode()}


def v1_doc(step: int, st: dict[str, Any], job: str = JOB, rank: int = 0,
           world: int = 1) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The previous release's codec.encode and Manifest, as a dict (asdict of it)."""
    shards, data = [], {}
    for name, value in st.items():
        if isinstance(value, bytes):
            buf = value
            shards.append({"name": name, "size": len(buf), "checksum":
                           xxhash.xxh3_64_hexdigest(buf), "kind": "bytes", "dtype": "",
                           "shape": []})
        else:
            arr = np.ascontiguousarray(value)
            buf = arr.tobytes()
            shards.append({"name": name, "size": len(buf), "checksum":
                           xxhash.xxh3_64_hexdigest(buf), "kind": "ndarray",
                           "dtype": arr.dtype.str, "shape": list(arr.shape)})
        data[name] = buf
    doc = {"job": job, "step": step, "world_size": world, "rank": rank, "shards": shards,
           "created_at": time.time(), "metadata": {}, "algo": "xxh3_64", "version": 1}
    return doc, data


def write_v1(tier: FsTier, step: int, doc: dict[str, Any], data: dict[str, bytes]) -> Path:
    tier.ensure_dir()
    where = Path(tier.dir) / step_dir(step)
    where.mkdir(mode=0o700)
    for name, buf in data.items():
        (where / name).write_bytes(buf)
    (where / MANIFEST).write_text(json.dumps(doc, sort_keys=True, indent=1) + "\n")
    for p in where.iterdir():
        os.chmod(p, 0o600)
    return where


def two_tiers(tmp_path: Path) -> tuple[FsTier, FsTier]:
    return (FsTier("memory", str(tmp_path / "shm"), JOB),
            FsTier("shared", str(tmp_path / "fsx"), JOB))


def test_a_job_checkpointed_before_the_upgrade_restores_after_it_and_loses_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for t in two_tiers(tmp_path):
        for step in (10, 20):
            write_v1(t, step, *v1_doc(step, old_state(step)))
    cfg = CkptConfig(memory_root=str(tmp_path / "shm"), shared_root=str(tmp_path / "fsx"),
                     peer_replicas=0)
    caplog.set_level("WARNING", "gpuwarden.ckpt.manifest")
    ck = JobCheckpointer(cfg, JobEnv("77", 0, 1, 1, "0", "n1"))
    got = ck.restore()
    assert got is not None and got.step == 20 and got.manifest.step == 20
    want = old_state(20)
    assert np.array_equal(got.state["w"], want["w"]) and got.state["w"].dtype == np.float32
    assert got.state["ids"].dtype.str == ">i8" and list(got.state["ids"]) == list(want["ids"])
    assert got.state["pairs"].tobytes() == want["pairs"].tobytes()  # as v1 restored it: |V12
    assert got.state["tag"] == b"s20"
    legacy = [r.getMessage() for r in caplog.records if "legacy" in r.getMessage()]
    assert len(legacy) == 1 and step_dir(20) in legacy[0] and "version-1" in legacy[0]
    # Training goes on: new steps are version 2; the old ones are still there.
    ck.save(30, {"w": np.zeros(3, dtype=np.float32)})
    assert ck.wait_durable(30, timeout=30)
    ck.finish()
    for t in two_tiers(tmp_path):
        assert t.steps()[-1] == 30 and 20 in t.steps()
        assert t.manifest(30).version == 2 and t.manifest(20).version == 1


def _weights(doc: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in doc["shards"] if s["name"] == "w")


def _flip(where: Path) -> None:
    raw = bytearray((where / "w").read_bytes())
    raw[3] ^= 1
    (where / "w").write_bytes(bytes(raw))


@pytest.mark.parametrize("change,needle", [
    (lambda d: _weights(d).update(dtype="<f3"), "shards[0].dtype"),
    (lambda d: _weights(d).update(dtype="|O"), "shards[0].dtype"),
    (lambda d: _weights(d).update(dtype="f4"), "shards[0].dtype"),  # not canonical
    (lambda d: _weights(d).update(shape=[8, 8]), "shards[0].size"),
    (lambda d: _weights(d).update(kind="bytes"), "shards[0].dtype"),
    (lambda d: _weights(d).pop("kind"), "shards[0].kind"),
    (lambda d: d.pop("metadata"), "metadata"),
    (lambda d: d.update(surprise=1), "surprise"),
    (lambda d: d.update(job="job-78"), "job-78"),
    (lambda d: d.update(rank=1, world_size=2), "rank 1"),
    (lambda d: d.update(step=10), "step 10"),  # a step directory copied to another number
    (lambda d: d.update(created_at=float("nan")), "created_at"),
    (lambda d: d.update(version=True), "version"),
    (lambda d: d.update(digest="sha256:00"), "version"),  # v1 never had one
    (lambda d: _weights(d).update(checksum="0" * 16), "checksum mismatch"),
])
def test_a_legacy_manifest_is_checked_as_strictly_as_a_current_one(
        tmp_path: Path, change: Callable[[dict[str, Any]], None], needle: str) -> None:
    fast, slow = two_tiers(tmp_path)
    doc, data = v1_doc(20, old_state(20))
    write_v1(slow, 20, json.loads(json.dumps(doc)), data)  # an intact copy on the shared tier
    change(doc)
    write_v1(fast, 20, doc, data)
    got = restore([fast, slow])
    assert got is not None and got.step == 20 and got.tier == "shared"
    assert "memory step 20" in got.skipped[0] and needle in got.skipped[0], got.skipped


def test_a_damaged_legacy_shard_is_refused(tmp_path: Path) -> None:
    fast, slow = two_tiers(tmp_path)
    for t in (fast, slow):
        where = write_v1(t, 20, *v1_doc(20, old_state(20)))
    _flip(where)  # the shared copy
    write_v1(fast, 10, *v1_doc(10, old_state(10)))
    _flip(Path(fast.dir) / step_dir(20))
    got = restore([fast, slow])
    assert got is not None and got.step == 10 and got.tier == "memory"
    assert len([s for s in got.skipped if "checksum mismatch" in s]) == 2


def test_legacy_manifests_are_never_written(tmp_path: Path) -> None:
    doc, data = v1_doc(5, old_state(5))
    text = json.dumps(doc, sort_keys=True, indent=1) + "\n"
    m = from_json(text, "m.json")
    assert m.version == 1 and m.to_json() == text  # served to a peer as it was written
    with pytest.raises(TierError, match="read-only"):
        FsTier("memory", str(tmp_path), JOB).commit(m, data)
    assert isinstance(m, Manifest)


def test_an_unknown_version_is_still_refused() -> None:
    doc, _ = v1_doc(5, old_state(5))
    doc["version"] = 3
    with pytest.raises(ManifestError, match="version"):
        from_json(json.dumps(doc), "m.json")
