"""Issue 37, step 3 (docs/design/object-store-sites.md 3.4): S3 manifest MACs name the site key
they were made under (``kid:<hex>``), so a site secret can be rotated and retired; the plain-hex
MACs of a shared tier's ``peer.key`` keep verifying with that key alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpuwarden.ckpt import codec
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.jobkey import JobKeys, derive
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.restore import restore
from gpuwarden.ckpt.s3mac import step_mac
from gpuwarden.ckpt.s3tier import MAC, S3Settings, S3Tier, manifest_mac
from gpuwarden.ckpt.tier import CorruptStep, TierError

from .test_ckpt_s3tier import FakeS3

ALICE, BOB = 23456, 34567
A, B = ("ka", b"\x01" * 32), ("kb", b"\x02" * 32)
JOB = "job-612"
SHARED = b"p" * 32  # a shared tier's peer.key


def keys(*site: tuple[str, bytes], job: str = "612", uid: int = ALICE) -> JobKeys:
    return JobKeys.of(derive(site, "c1", job, uid))


def tier(s3: FakeS3, k: JobKeys | None = None, key: bytes | None = None) -> S3Tier:
    return S3Tier("s3", S3Settings("site-bucket"), JOB, 0, s3=s3, keys=k, key=key)


def commit(t: S3Tier, step: int, value: float = 1.0) -> None:
    shards, data = codec.encode({"w": np.full(4, value, "<f4")})
    t.commit(Manifest(JOB, step, 1, 0, tuple(shards), 1.0, {}), data)


def mac_of(s3: FakeS3, step: int) -> bytes:
    return s3.objects[f"gpuwarden-ckpt/{JOB}/rank-00000/step-{step:012d}/{MAC}"]


def head_of(s3: FakeS3, step: int) -> bytes:
    """MANIFEST.mac's first line: ``v2 <kid>:<hex>`` (the shards' digests follow)."""
    return mac_of(s3, step).split(b"\n")[0]


def test_a_derived_key_signs_with_its_key_id() -> None:
    s3, k = FakeS3(), keys(A)
    commit(tier(s3, k), 1)
    raw = s3.objects[f"gpuwarden-ckpt/{JOB}/rank-00000/step-{1:012d}/MANIFEST.json"]
    records = mac_of(s3, 1).split(b"\n", 1)[1]
    assert head_of(s3, 1) == b"v2 ka:" + step_mac(k.signing[1], raw, records).encode()
    assert tier(s3, k).manifest(1).step == 1


def test_a_step_signed_before_a_rotation_verifies_after_it_and_not_after_retirement() -> None:
    s3 = FakeS3()
    commit(tier(s3, keys(A)), 1)
    rotated = keys(B, A)  # B signs now, A still verifies
    commit(tier(s3, rotated), 2)
    assert head_of(s3, 2).startswith(b"v2 kb:")
    assert [tier(s3, rotated).manifest(s).step for s in (1, 2)] == [1, 2]
    retired = keys(B)
    assert tier(s3, retired).manifest(2).step == 2
    with pytest.raises(CorruptStep, match="signed with site key kid ka, which this node no "
                                          r"longer has \(retired\?\)"):
        tier(s3, retired).manifest(1)


def test_a_legacy_mac_verifies_only_with_a_shared_tier_key() -> None:
    s3 = FakeS3()
    commit(tier(s3, key=SHARED), 1)  # today's shared-tier job: plain hex
    raw = s3.objects[f"gpuwarden-ckpt/{JOB}/rank-00000/step-{1:012d}/MANIFEST.json"]
    records = mac_of(s3, 1).split(b"\n", 1)[1]
    assert head_of(s3, 1) == b"v2 " + step_mac(SHARED, raw, records).encode()
    assert tier(s3, key=SHARED).manifest(1).step == 1
    assert tier(s3, JobKeys.shared(SHARED)).manifest(1).step == 1
    with pytest.raises(CorruptStep, match="no shared-tier key"):
        tier(s3, keys(A)).manifest(1)
    # The previous release's MAC of the same manifest (version 1: plain hex, no digests).
    s3.objects[f"gpuwarden-ckpt/{JOB}/rank-00000/step-{1:012d}/{MAC}"] = \
        manifest_mac(SHARED, raw).encode()
    assert tier(s3, key=SHARED).manifest(1).step == 1
    with pytest.raises(CorruptStep, match="no shared-tier key"):
        tier(s3, keys(A)).manifest(1)
    # A site that set key_file under a running shared-tier job: its old steps still verify,
    # new ones are signed with the derived key.
    both = keys(A).with_shared(SHARED)
    assert tier(s3, both).manifest(1).step == 1
    commit(tier(s3, both), 2)
    assert head_of(s3, 2).startswith(b"v2 ka:")


def test_a_derived_mac_never_verifies_against_a_shared_tier_key_alone() -> None:
    s3 = FakeS3()
    commit(tier(s3, keys(A)), 1)
    with pytest.raises(CorruptStep, match="kid ka"):
        tier(s3, key=SHARED).manifest(1)


@pytest.mark.parametrize("who", ["another job", "another user", "another cluster"])
def test_a_planted_step_under_another_jobs_key_is_refused(tmp_path: Path, who: str) -> None:
    s3, alice = FakeS3(), keys(A)
    mem = FsTier("memory", str(tmp_path), JOB)
    shards, data = codec.encode({"w": np.ones(4, "<f4")})
    mem.commit(Manifest(JOB, 5, 1, 0, tuple(shards), 1.0, {}), data)
    # bob, with the nodes' shared credentials and his own job's key (valid digest, a MAC of
    # the right shape and key id), writes under alice's job's names
    other = {"another job": JobKeys.of(derive([A], "c1", "613", ALICE)),
             "another user": JobKeys.of(derive([A], "c1", "612", BOB)),
             "another cluster": JobKeys.of(derive([A], "c2", "612", ALICE))}[who]
    commit(tier(s3, other), 999, 666.0)
    got = restore([mem, tier(s3, alice)])
    assert got is not None and (got.step, got.tier) == (5, "memory")
    with pytest.raises(CorruptStep, match="not authenticated with this job's key"):
        tier(s3, alice).manifest(999)


def test_a_mac_relabelled_with_another_key_id_is_refused() -> None:
    s3, k = FakeS3(), keys(B, A)
    commit(tier(s3, k), 1)
    body = mac_of(s3, 1)
    assert body.startswith(b"v2 kb:")
    s3.objects[f"gpuwarden-ckpt/{JOB}/rank-00000/step-{1:012d}/{MAC}"] = b"v2 ka:" + body[6:]
    with pytest.raises(CorruptStep, match="not authenticated with this job's key"):
        tier(s3, k).manifest(1)


@pytest.mark.parametrize("body", [b"", b"ka:", b"ka:" + b"0" * 63, b"k a:" + b"0" * 64,
                                  b"ka:" + b"G" * 64, b"ka:" + b"0" * 64 + b"\n",
                                  b"x" * 33 + b":" + b"0" * 64, b"ka:kb:" + b"0" * 64,
                                  b"0" * 200])
def test_a_malformed_mac_is_refused(body: bytes) -> None:
    s3, k = FakeS3(), keys(A)
    commit(tier(s3, k), 1)
    s3.objects[f"gpuwarden-ckpt/{JOB}/rank-00000/step-{1:012d}/{MAC}"] = body
    with pytest.raises(CorruptStep, match="refused"):
        tier(s3, k).manifest(1)


def test_without_keys_nothing_is_written_and_nothing_trusted() -> None:
    s3 = FakeS3()
    with pytest.raises(TierError, match="key_file"):
        commit(tier(s3), 1)
    commit(tier(s3, keys(A)), 1)
    with pytest.raises(CorruptStep, match="no job key"):
        tier(s3).manifest(1)


def test_the_shared_key_setter_of_todays_callers_still_signs_plain_hex() -> None:
    s3 = FakeS3()
    t = tier(s3)
    t.key = SHARED  # JobCheckpointer on a shared-tier site (until step 5)
    commit(t, 1)
    assert b":" not in head_of(s3, 1) and t.key == SHARED
    assert tier(s3, key=SHARED).manifest(1).step == 1
    t.key = None
    assert t.keys is None
