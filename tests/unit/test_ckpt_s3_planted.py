"""Issue 37, a hostile review of the S3 tier: names anyone with the bucket's credentials can
write (an empty ``MANIFEST.json`` under a rank's prefix) must not move root's gc floor, must not
make a restore walk one GET per planted name, and a refused shard stops the other shards'
downloads; a malformed answer is a CorruptStep naming the object."""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import pytest

from gpuwarden.ckpt import codec, listing, s3tier
from gpuwarden.ckpt.jobkey import JobKeys, derive
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.restore import TiersUnavailable, restore
from gpuwarden.ckpt.retention import to_delete
from gpuwarden.ckpt.s3index import INDEX
from gpuwarden.ckpt.s3tier import MAC, S3Settings, S3Tier
from gpuwarden.ckpt.tier import MANIFEST, CorruptStep

from .fake_s3 import FakeS3

JOB = "job-612"
KEYS = JobKeys.of(derive([("ka", b"\x01" * 32)], "c1", "612", 2001))


def tier(s3: FakeS3, rank: int = 0, **settings: Any) -> S3Tier:
    return S3Tier("s3", S3Settings("b", **settings), JOB, rank, s3=s3, keys=KEYS)


def commit(t: S3Tier, step: int, world: int = 1, **state: np.ndarray) -> None:
    shards, data = codec.encode(state or {"w": np.arange(16, dtype="<f4") + step})
    t.commit(Manifest(JOB, step, world, t.rank, tuple(shards), 1.0, {}), data)


def plant(s3: FakeS3, step: int, rank: int = 0) -> None:
    """Another user's one PUT: an empty manifest name under the job's rank."""
    s3.put_object(Bucket="b", Key=f"gpuwarden-ckpt/{JOB}/rank-{rank:05d}/step-{step:012d}/"
                  f"{MANIFEST}", Body=b"")


def unmark(s3: FakeS3) -> None:
    """The job's steps as written before the index (a legacy step: no marker)."""
    for k in [k for k in s3.objects if f"/{INDEX}/" in k]:
        del s3.objects[k]


def gc(t: S3Tier, keep: int = 2) -> list[int]:
    """`ckpt gc`'s body for a durable tier."""
    gone, _ = to_delete(t, keep)
    floor, _ = listing.restart_floor(t)
    gone = [s for s in gone if floor is not None and s < floor]
    for s in gone:
        t.delete(s)
    return gone


# ---- MED-1: root's gc floor ---------------------------------------------------------------------
def lagging(s3: FakeS3) -> tuple[S3Tier, S3Tier]:
    r0, r1 = tier(s3, 0), tier(s3, 1)
    for s in (10, 20, 30):
        commit(r0, s, world=2)
    commit(r1, 10, world=2)  # rank 1 died after step 10: a restart restores step 10
    return r0, r1


def test_a_planted_manifest_name_does_not_lift_roots_gc_floor() -> None:
    s3 = FakeS3()
    r0, _ = lagging(s3)
    plant(s3, 999_999, rank=1)
    assert listing.restart_floor(r0)[0] == 10
    assert gc(r0) == []
    assert r0.manifest(10).step == 10, "the step rank 1 needs from rank 0 is kept"


def test_the_floor_still_counts_a_legacy_step_that_verifies() -> None:
    s3 = FakeS3()
    r0, _ = lagging(s3)
    unmark(s3)  # every step from before the index: each read and verified instead
    plant(s3, 999_999, rank=1)
    assert listing.restart_floor(r0)[0] == 10
    assert gc(r0) == []


def test_a_rank_with_only_planted_names_has_no_floor_and_nothing_is_deleted() -> None:
    s3 = FakeS3()
    r0 = tier(s3, 0)
    for s in (10, 20, 30):
        commit(r0, s, world=2)
    plant(s3, 999_999, rank=1)
    floor, why = listing.restart_floor(r0)
    assert floor is None and "rank 1" in why
    assert gc(r0) == []


def test_at_rank_keeps_the_jobs_derived_keys() -> None:
    s3 = FakeS3()
    _, r1 = lagging(s3)
    other = listing.at_rank(tier(s3, 0), 1)
    assert other.keys == r1.keys
    assert other.manifest(10).step == 10  # "ka:"-signed: verified with the job's keys


# ---- MED-3: a restore's walk over planted names -------------------------------------------------
def gets(s3: FakeS3) -> int:
    return sum(op == "get" for op, _ in s3.calls)


def test_planted_names_above_the_newest_step_cost_a_restore_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    s3 = FakeS3()
    t = tier(s3)
    commit(t, 100)
    for s in range(101, 2101):
        plant(s3, s)
    s3.calls.clear()
    with caplog.at_level(logging.WARNING):
        got = restore([t])
    assert got is not None and got.step == 100
    assert t.steps() == [100]
    assert gets(s3) <= 4, "the MAC, the manifest, the shard: no GET per planted name"
    assert sum(len(r.getMessage()) for r in caplog.records) < 4000


def test_a_few_planted_names_cost_a_bounded_walk_and_a_bounded_log(
        caplog: pytest.LogCaptureFixture) -> None:
    s3 = FakeS3()
    t = tier(s3)
    commit(t, 100)
    for s in range(101, 101 + s3tier.MAX_UNMARKED):  # each may be a legacy step: tried
        plant(s3, s)
    s3.calls.clear()
    with caplog.at_level(logging.WARNING):
        got = restore([t])
    assert got is not None and got.step == 100
    assert gets(s3) <= s3tier.MAX_UNMARKED + 4
    assert len(got.skipped) <= 40
    assert max(len(r.getMessage()) for r in caplog.records) < 8000


def test_a_legacy_step_restores_as_before() -> None:
    s3 = FakeS3()
    t = tier(s3)
    commit(t, 7)
    commit(t, 8)
    unmark(s3)
    assert t.steps() == [7, 8]
    got = restore([t])
    assert got is not None and got.step == 8


def test_a_step_whose_marker_is_missing_still_restores_beside_marked_ones() -> None:
    s3 = FakeS3()
    t = tier(s3)
    commit(t, 7)
    commit(t, 8)
    for k in [k for k in s3.objects if f"/{INDEX}/step-{8:012d}/" in k]:
        del s3.objects[k]  # its marker's PUT failed: a warning, the step is committed
    assert t.steps() == [7, 8]
    got = restore([t])
    assert got is not None and got.step == 8


def test_a_flood_over_a_job_of_legacy_steps_is_a_listing_failure_not_a_fresh_start() -> None:
    s3 = FakeS3()
    t = tier(s3)
    commit(t, 7)
    unmark(s3)
    for s in range(8, 9 + s3tier.MAX_UNMARKED):
        plant(s3, s)
    s3.calls.clear()
    with pytest.raises(TiersUnavailable, match="index marker"):
        restore([t])
    assert gets(s3) == 0


def test_a_marked_step_whose_manifest_is_gone_is_not_held() -> None:
    s3 = FakeS3()
    t = tier(s3)
    commit(t, 7)
    commit(t, 8)
    del s3.objects[f"gpuwarden-ckpt/{JOB}/rank-00000/step-{8:012d}/{MANIFEST}"]
    assert t.steps() == [7]


def test_listing_every_rank_reads_the_index_once() -> None:
    s3 = FakeS3()
    r0, _ = lagging(s3)
    s3.calls.clear()
    rows = list(listing.rows([r0], None))
    assert [(r.rank, r.steps) for r in rows] == [(0, (10, 20, 30)), (1, (10,))]
    assert sum(op == "list" and k.endswith(f"/{INDEX}/") for op, k in s3.calls) <= 1


# ---- LOW-2: a refused shard stops the other lanes -----------------------------------------------
def test_a_refused_shard_stops_the_other_shards_downloads(monkeypatch: pytest.MonkeyPatch) -> None:
    s3 = FakeS3()
    t = tier(s3, get_part_size=1 << 20, get_concurrency=16)  # 4 lanes of 4 parts each
    commit(t, 1, **{f"s{i}": np.zeros(8 << 18, "<f4") for i in range(4)})  # 8 MiB, 8 parts
    k = next(k for k in s3.objects if k.endswith("/s0"))
    s3.objects[k] = s3.objects[k][:-1]  # refused at its first GET: not the size it says
    stops: list[threading.Event] = []
    real = s3tier.fetch

    def spy(*a: Any, **kw: Any) -> None:
        stops.append(kw.get("stop") or threading.Event())
        real(*a, **kw)
    monkeypatch.setattr(s3tier, "fetch", spy)

    def held_back(key: str, _span: Any) -> None:
        if not key.endswith(("/s0", MAC, MANIFEST)):  # the others wait for the refusal
            assert all(e.wait(10) for e in list(stops)), "the load was never stopped"
    s3.on_get = held_back
    s3.calls.clear()
    with pytest.raises(CorruptStep, match="s0"):
        t.load(1)
    others = [key for op, key in s3.calls if op == "get" and key[-3:] in ("/s1", "/s2", "/s3")]
    assert len(others) <= 3 * 4, "only the parts already asked for when s0 was refused"


# ---- LOW-4: a malformed Content-Length ----------------------------------------------------------
class Lying(FakeS3):
    def __init__(self, length: object) -> None:
        super().__init__()
        self.length = length

    def get_object(self, Bucket: str, Key: str, Range: str | None = None) -> dict[str, Any]:
        got = super().get_object(Bucket=Bucket, Key=Key, Range=Range)
        if Key.endswith(MAC):
            got["ContentLength"] = self.length
        return got


@pytest.mark.parametrize("length", [-1, "12", 1.5, None, True])
def test_a_malformed_content_length_is_a_corrupt_step_naming_the_object(length: object) -> None:
    s3 = Lying(length)
    t = tier(s3)
    commit(t, 5)
    with pytest.raises(CorruptStep, match=f"step-{5:012d}/{MAC}"):
        t.read_manifest(5)
    with pytest.raises(CorruptStep, match=MAC):
        t.verify(5)
