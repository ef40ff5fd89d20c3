"""The S3 tier's callers' side, against a dict-backed fake client (the real SeaweedFS is in
tests/e2e/test_ckpt_core.py and test_ckpt_outages.py)."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from gpuwarden.ckpt import codec
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.restore import restore
from gpuwarden.ckpt.s3tier import S3Settings, S3Tier
from gpuwarden.ckpt.tier import CorruptStep
from tests.unit.fake_s3 import FakeS3 as FakeS3  # the other S3 tests import it from here

KEY = b"k" * 32  # the job's key (on a cluster: peer.key in the job's shared directory)


def test_a_large_step_downloads_in_chunks_bit_identical(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeS3()
    tier = S3Tier("s3", S3Settings("b"), "job-1", 0, s3=fake, key=KEY)
    w = np.arange(5 << 20, dtype=np.float32)  # 20 MiB: several 8 MiB chunks
    shards, data = codec.encode({"w": w, "tag": b"x"})
    tier.commit(Manifest("job-1", 3, 1, 0, tuple(shards), time.time(), {}), data)
    caplog.set_level(logging.INFO)
    got = restore([tier])
    assert got is not None and got.step == 3 and np.array_equal(got.state["w"], w)
    assert got.state["w"].flags.writeable and got.state["tag"] == b"x"


def test_an_object_larger_than_its_manifest_says_is_corrupt() -> None:
    fake = FakeS3()
    tier = S3Tier("s3", S3Settings("b"), "job-1", 0, s3=fake, key=KEY)
    shards, data = codec.encode({"tag": b"abc"})
    tier.commit(Manifest("job-1", 1, 1, 0, tuple(shards), time.time(), {}), data)
    key = next(k for k in fake.objects if k.endswith("/tag"))
    fake.objects[key] = b"abcd"
    with pytest.raises(CorruptStep, match="larger than the manifest says"):
        tier.load(1)
