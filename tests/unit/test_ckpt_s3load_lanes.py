"""`S3Tier.load` keeps a remote link busy across shards: their GETs overlap (one shard after
another left the link idle for a round trip or two per shard), never more than
`s3_get_concurrency` at once, and a refused shard still refuses the step."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from gpuwarden.ckpt import codec
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.s3mac import MAC
from gpuwarden.ckpt.tier import CorruptStep
from tests.unit.test_ckpt_s3_keyed import JOB, key_of, tier

from .fake_s3 import FakeS3


class Overlapping(FakeS3):
    """Shard GETs wait (``wait_s`` at most) until ``want`` of them are in flight: a load that
    asks one shard at a time never gets there."""

    def __init__(self, want: int, wait_s: float = 5.0) -> None:
        super().__init__()
        self.want, self.wait_s, self.inflight, self.most = want, wait_s, 0, 0
        self.lock = threading.Condition()

    def get_object(self, Bucket: str, Key: str, Range: str | None = None) -> dict[str, Any]:
        if Key.endswith(("MANIFEST.json", MAC)):
            return super().get_object(Bucket=Bucket, Key=Key, Range=Range)
        with self.lock:
            self.inflight += 1
            self.most = max(self.most, self.inflight)
            self.lock.notify_all()
            self.lock.wait_for(lambda: self.most >= self.want, timeout=self.wait_s)
        try:
            return super().get_object(Bucket=Bucket, Key=Key, Range=Range)
        finally:
            with self.lock:
                self.inflight -= 1


def state(step: int) -> dict[str, object]:
    return {f"w{i}": np.full(256, step * 10 + i, dtype="<f4") for i in range(4)}


def save(s3: FakeS3, step: int, **settings: Any) -> None:
    t = tier(s3, **settings)
    shards, data = codec.encode(state(step))
    t.commit(Manifest(JOB, step, 1, 0, tuple(shards), 1.0, {}), data)


def test_the_shards_of_a_step_are_fetched_at_once() -> None:
    s3 = Overlapping(want=4)
    save(s3, 5)
    m, data = tier(s3, get_concurrency=16).load(5)
    assert s3.most == 4, "the 4 shards' GETs overlap"
    for shard in m.shards:
        assert np.array_equal(codec.decode(shard, data[shard.name]), state(5)[shard.name])


def test_no_more_gets_in_flight_than_the_concurrency() -> None:
    s3 = Overlapping(want=99, wait_s=0.2)  # never reached: each GET waits its 0.2 s
    save(s3, 5)
    tier(s3, get_concurrency=2).load(5)
    assert s3.most <= 2


def test_a_refused_shard_still_refuses_the_step() -> None:
    s3 = FakeS3()
    save(s3, 5)
    name = key_of(5, "w2")
    s3.objects[name] = b"\0" * len(s3.objects[name])
    with pytest.raises(CorruptStep, match="w2"):
        tier(s3, get_concurrency=16).load(5)
