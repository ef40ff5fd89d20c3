"""Issue 37, step 7 (docs/design/object-store-sites.md 4.2): a shard comes down from S3 as
parallel ranged GETs written into their place (a buffer, or a file by pwrite), hashed in order
as the prefix of parts completes, and verified against the manifest's size and xxh3 at the end;
whatever S3 answers that does not fit the manifest is a CorruptStep."""

from __future__ import annotations

import io
import os
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from botocore.exceptions import EndpointConnectionError

from gpuwarden.ckpt import codec, s3fetch
from gpuwarden.ckpt.build import tiers
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.s3fetch import FetchTimeout, fetch
from gpuwarden.ckpt.s3tier import S3Settings, S3Tier
from gpuwarden.ckpt.tier import CorruptStep, TierError
from gpuwarden.config.ckpt import CkptConfig
from gpuwarden.core.configload import FieldError

from .fake_s3 import FakeS3

PART = 1024
KEY = "p/job-1/rank-00000/step-000000000001/w"


def blob(size: int) -> bytes:
    return np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()


def put(s3: FakeS3, data: bytes) -> tuple[int, str]:
    s3.objects[KEY] = data
    return len(data), codec.checksum(data)


def ranges(s3: FakeS3) -> list[tuple[int, int] | None]:
    seen: list[tuple[int, int] | None] = []
    s3.on_get = lambda _key, span: seen.append(span)
    return seen


def get(s3: FakeS3, size: int, digest: str, dest: Any, concurrency: int = 4,
        **kw: Any) -> None:
    fetch(s3, "b", KEY, size, digest, dest, part_size=PART, concurrency=concurrency, **kw)


SIZES = [0, 1, PART - 1, PART, PART + 1, 7 * PART + 3]


@pytest.mark.parametrize("size", SIZES)
def test_a_buffer_is_filled_bit_identical_by_ranged_gets(size: int) -> None:
    s3, data = FakeS3(), blob(size)
    n, digest = put(s3, data)
    seen = ranges(s3)
    out = bytearray(n)
    get(s3, n, digest, out)
    assert bytes(out) == data
    parts = -(-size // PART)
    if size:
        assert sorted(s for s in seen if s) == [(i * PART, min(size, (i + 1) * PART) - 1)
                                                for i in range(parts)]
        assert None not in seen
    else:  # nothing to range over: one GET, which must be empty
        assert seen == [None]


@pytest.mark.parametrize("size", SIZES)
def test_a_file_is_written_bit_identical_by_pwrite(size: int, tmp_path: Path) -> None:
    s3, data = FakeS3(), blob(size)
    n, digest = put(s3, data)
    fd = os.open(tmp_path / "shard", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        get(s3, n, digest, fd)
    finally:
        os.close(fd)
    assert (tmp_path / "shard").read_bytes() == data


def test_parts_that_complete_out_of_order_are_hashed_in_order() -> None:
    """Part 0 answers last: the hasher waits for it, then takes every part in order (a hash
    fed in completion order would not match the manifest)."""
    s3, data = FakeS3(), blob(6 * PART)
    n, digest = put(s3, data)
    others_done = threading.Event()
    served: list[int] = []
    lock = threading.Lock()

    def slow_first(_key: str, span: tuple[int, int] | None) -> None:
        assert span is not None
        if span[0] == 0:
            assert others_done.wait(10), "the other parts were not fetched while part 0 waited"
        with lock:
            served.append(span[0] // PART)
            if len(served) == 5:
                others_done.set()
    s3.on_get = slow_first
    out = bytearray(n)
    get(s3, n, digest, out, concurrency=6)
    assert served[-1] == 0 and bytes(out) == data


def test_memory_in_flight_is_bounded_by_concurrency_times_part(tmp_path: Path) -> None:
    """Into a file, parts done ahead of a slow first part wait in memory to be hashed: no more
    than ``concurrency`` of them at once, however big the shard (here 64 parts, 4 at a time;
    an unbounded fetcher holds all 63 while part 0 is slow)."""
    part, conc, parts = 64 << 10, 4, 64
    s3, data = FakeS3(), blob(part * parts)
    n, digest = put(s3, data)
    active, most, started = [0], [0], threading.Event()
    lock = threading.Lock()

    def count(_key: str, span: tuple[int, int] | None) -> None:
        assert span is not None
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        if span[0] == 0:  # slow until the window behind it is full
            started.wait(5)
        elif span[0] // part == conc - 1:
            started.set()
        with lock:
            active[0] -= 1
    s3.on_get = count
    fd = os.open(tmp_path / "shard", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    tracemalloc.start()
    try:
        fetch(s3, "b", KEY, n, digest, fd, part_size=part, concurrency=conc)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        os.close(fd)
    assert (tmp_path / "shard").read_bytes() == data
    assert most[0] <= conc
    # Each part in flight: its buffer here and the fake's slice of the object; and some slack.
    assert peak < (2 * conc + 4) * part, f"peak {peak / part:.1f} parts in memory"


def test_gets_run_in_parallel_up_to_the_concurrency() -> None:
    s3, data = FakeS3(), blob(16 * PART)
    n, digest = put(s3, data)
    barrier = threading.Barrier(4, timeout=10)

    def meet(_key: str, span: tuple[int, int] | None) -> None:
        if span is not None and span[0] < 4 * PART:
            barrier.wait()  # four GETs at once, or this times out
    s3.on_get = meet
    out = bytearray(n)
    get(s3, n, digest, out, concurrency=4)
    assert bytes(out) == data


# ---- what S3 answers that does not fit the manifest -----------------------------------------
class Lying(FakeS3):
    """Answers ranges with a body or Content-Range of its choosing."""

    def __init__(self, body: Any = None, content_range: Any = None) -> None:
        super().__init__()
        self.body, self.content_range = body, content_range

    def get_object(self, Bucket: str, Key: str, Range: str | None = None) -> dict[str, Any]:
        got = super().get_object(Bucket, Key, Range)
        first, last, total = s3fetch.parse_content_range(got["ContentRange"]) or (0, 0, 0)
        if self.body is not None:
            got["Body"] = io.BytesIO(self.body(got["Body"].read(), first))
        if self.content_range is not None:
            got["ContentRange"] = self.content_range(first, last, total)
        return got


@pytest.mark.parametrize("s3, match", [
    (Lying(body=lambda b, first: b[:-1] if first == PART else b), "short"),
    (Lying(body=lambda b, first: b + b"x" if first == PART else b), "long"),
    (Lying(content_range=lambda a, b, t: f"bytes {a}-{b}/{t + 1}"), "larger than the manifest"),
    (Lying(content_range=lambda a, b, t: f"bytes {a}-{b}/{t - 1}"), "smaller than the manifest"),
    (Lying(content_range=lambda a, b, t: f"bytes {a + 1}-{b}/{t}"), "asked for"),
    (Lying(content_range=lambda a, b, t: "bytes */9"), "Content-Range"),
    (Lying(content_range=lambda a, b, t: None), "Content-Range"),
], ids=["short-body", "long-body", "total-larger", "total-smaller", "other-range", "malformed",
        "missing"])
def test_an_answer_that_does_not_fit_the_manifest_is_a_corrupt_step(s3: Lying,
                                                                       match: str) -> None:
    n, digest = put(s3, blob(3 * PART))
    with pytest.raises(CorruptStep, match=match):
        get(s3, n, digest, bytearray(n))


def test_an_object_shorter_than_a_range_416_is_a_corrupt_step() -> None:
    s3, data = FakeS3(), blob(3 * PART)
    _n, digest = put(s3, data[:PART])  # parts 1 and 2 start past its end: 416
    with pytest.raises(CorruptStep, match="smaller than the manifest says"):
        get(s3, 3 * PART, digest, bytearray(3 * PART))


@pytest.mark.parametrize("stored", [b"", b"x"])
def test_sizes_that_differ_from_the_manifest_are_corrupt(stored: bytes) -> None:
    s3 = FakeS3()
    s3.objects[KEY] = stored
    size = 1 - len(stored)  # 1 expected and the object is empty; 0 expected and it is not
    with pytest.raises(CorruptStep, match="than the manifest says"):
        get(s3, size, codec.checksum(b"y" * size), bytearray(size))


def test_the_same_size_with_other_bytes_is_a_checksum_mismatch() -> None:
    s3, data = FakeS3(), blob(3 * PART)
    n, digest = put(s3, data)
    s3.objects[KEY] = data[:-1] + bytes([data[-1] ^ 1])
    with pytest.raises(CorruptStep, match="checksum mismatch"):
        get(s3, n, digest, bytearray(n), where="s3 step 1: shard w")


@pytest.mark.parametrize("fail", [
    lambda: (_ for _ in ()).throw(EndpointConnectionError(endpoint_url="http://s3")),
    None,  # the object is not there
])
def test_a_get_that_fails_is_a_corrupt_step_naming_the_key(fail: Any) -> None:
    s3, data = FakeS3(), blob(3 * PART)
    n, digest = put(s3, data)
    if fail is None:
        del s3.objects[KEY]
    else:
        s3.on_get = lambda _k, span: next(fail()) if span and span[0] == PART else None
    with pytest.raises(CorruptStep, match=f"{KEY}: cannot read"):
        get(s3, n, digest, bytearray(n))


def test_a_fetch_past_its_deadline_stops_with_the_time_it_had() -> None:
    s3, data = FakeS3(), blob(3 * PART)
    n, digest = put(s3, data)
    release = threading.Event()
    s3.on_get = lambda _k, span: release.wait(30) if span and span[0] == PART else None
    start = time.monotonic()
    try:
        with pytest.raises(FetchTimeout, match="not done within 0.2 s"):
            get(s3, n, digest, bytearray(n), deadline=start + 0.2)
    finally:
        release.set()
    assert time.monotonic() - start < 5 and issubclass(FetchTimeout, TierError)


def test_a_destination_of_another_size_is_refused() -> None:
    s3, data = FakeS3(), blob(PART)
    n, digest = put(s3, data)
    with pytest.raises(ValueError, match="destination"):
        get(s3, n, digest, bytearray(n - 1))


# ---- S3Tier restores through it; the [ckpt] keys -------------------------------------------
def test_the_s3_tier_restores_each_shard_by_ranged_gets() -> None:
    s3 = FakeS3()
    settings = S3Settings("b", get_part_size=1 << 20, get_concurrency=3)
    tier = S3Tier("s3", settings, "job-1", 0, s3=s3, key=b"k" * 32)
    w = np.arange(7 << 18, dtype=np.float32)  # 7 MiB: 7 parts
    shards, data = codec.encode({"w": w, "tag": b"x"})
    tier.commit(Manifest("job-1", 3, 1, 0, tuple(shards), time.time(), {}), data)
    seen = ranges(s3)
    m, got = tier.load(3)
    assert len([s for s in seen if s]) == 7 + 1 and bytes(got["w"]) == w.tobytes()
    assert isinstance(got["w"], bytearray) and got["tag"] == b"x" and m.step == 3


def test_the_ckpt_keys_reach_the_tier_and_are_checked() -> None:
    cfg = CkptConfig(s3_bucket="b", shared_root="/fsx", s3_get_part_mb=4, s3_get_concurrency=2)
    s3 = next(t for t in tiers(cfg, "job-1", 0, s3_key=b"k" * 32) if t.name == "s3")
    assert (s3.s.get_part_size, s3.s.get_concurrency) == (4 << 20, 2)
    assert (CkptConfig().s3_get_part_mb, CkptConfig().s3_get_concurrency) == (16, 16)
    for bad in ({"s3_get_part_mb": 0}, {"s3_get_part_mb": 65}, {"s3_get_concurrency": 0},
                {"s3_get_concurrency": 65}):
        with pytest.raises(FieldError, match=next(iter(bad)) + ".*1 to 64"):
            CkptConfig(**bad)  # type: ignore[arg-type]
