"""One S3 object (a shard) downloaded by parallel ranged GETs and verified as it lands (issue 37;
docs/design/object-store-sites.md 4.2). Shared by the job's S3 restore and, later, the prolog's
stage-in.

The object is cut into parts of ``part_size`` bytes, fetched by ``concurrency`` threads with
``Range: bytes=a-b``. Into a buffer, each part is read straight into its place; into a file
descriptor, each part is read into its own buffer and written with ``pwrite`` by the calling
thread (so no worker ever touches the descriptor, even one still stuck after a deadline). One
xxh3 (the manifests' hash, `codec.checksum`) is fed each part as soon as every part before it
is in, so the check at the end costs nothing more, and parts done early wait for it in memory:
at most ``concurrency`` parts ahead of the hasher are ever started into a file, which bounds the
memory in flight to ``concurrency x part_size``.

With ``keyed`` (every step written since the keyed digests, `s3mac`), each worker also hashes
its own part's 1 MiB leaves as soon as the part is in (parts are then whole leaves: the part
size is rounded up to one), and the in-order hasher only strings their 32-byte digests
together, so the keyed check, which xxh3 cannot stand in for against a person, runs in
``concurrency`` threads and does not hold a fast download back. It is checked first.

Nothing S3 answers is trusted: a part whose ``Content-Range`` is not the range asked for within
an object of the manifest's size, a 416 (the object is shorter), a body shorter or longer than
its range, a read that fails, and a size, keyed digest or checksum that differs at the end are all
`CorruptStep` (restore then walks on). Every GET has the client's connect and read timeouts;
``deadline`` (a `time.monotonic` time) bounds the whole fetch: `FetchTimeout`.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import xxhash
from botocore.exceptions import BotoCoreError, ClientError

from gpuwarden.ckpt.s3mac import LEAF, MISMATCH, Keyed
from gpuwarden.ckpt.tier import CorruptStep, TierError

CHUNK = 1 << 20  # a worker reads at most this much at once: a cancelled fetch stops within one
_CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,20})-([0-9]{1,20})/([0-9]{1,20})")

Dest = bytearray | memoryview | int
Part = tuple[memoryview | None, bytes]  # a part's own buffer (into a file) and its leaves' digests


class FetchTimeout(TierError):
    """The fetch did not finish by its deadline (S3 too slow, or stuck)."""


class Stopped(TierError):
    """The caller's ``stop`` was set: another shard of the step was refused."""


class _Cancelled(Exception):
    """A worker's part, abandoned because the fetch already failed or ran out of time."""


def parse_content_range(text: object) -> tuple[int, int, int] | None:
    """``bytes a-b/total`` as (a, b, total); None for anything else."""
    m = _CONTENT_RANGE.fullmatch(text) if isinstance(text, str) else None
    return None if m is None else (int(m.group(1)), int(m.group(2)), int(m.group(3)))


def parts(size: int, part_size: int) -> list[tuple[int, int]]:
    """The inclusive byte ranges of an object of ``size`` bytes, in order."""
    return [(a, min(a + part_size, size) - 1) for a in range(0, size, part_size)]


def _sized(where: str, key: str, total: int, size: int) -> CorruptStep:
    relation = "larger" if total > size else "smaller"
    return CorruptStep(f"{where}: {key}: {relation} than the manifest says ({total} bytes in S3, "
                       f"{size} in the manifest)")


def _read_error(where: str, key: str, size: int, exc: Exception) -> CorruptStep:
    meta = exc.response.get("ResponseMetadata", {}) if isinstance(exc, ClientError) else {}
    code = exc.response.get("Error", {}).get("Code") if isinstance(exc, ClientError) else None
    if meta.get("HTTPStatusCode") == 416 or code == "InvalidRange":
        return CorruptStep(f"{where}: {key}: smaller than the manifest says ({size} bytes): S3 "
                           "answered a range within them with 416")
    return CorruptStep(f"{where}: {key}: cannot read ({exc})")


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class _Fetch:
    """One object's fetch: its parts, the workers' job, the caller's loop."""

    def __init__(self, s3: Any, bucket: str, key: str, size: int, dest: Dest,
                 progress: Callable[[int], None] | None, where: str,
                 keyed: Keyed | None = None, stop: threading.Event | None = None) -> None:
        self.s3, self.bucket, self.key, self.size = s3, bucket, key, size
        self.fd = dest if isinstance(dest, int) else -1
        self.view = None if isinstance(dest, int) else memoryview(dest).cast("B")
        if self.view is not None and (self.view.readonly or self.view.nbytes != size):
            raise ValueError(f"destination of {self.view.nbytes} bytes"
                             f"{' (read-only)' if self.view.readonly else ''} for {size}")
        self.progress, self.where, self.keyed = progress, where, keyed
        self.cancel = threading.Event()
        # The caller's: set when a fetch beside this one failed (`S3Tier.load`'s lanes).
        self.stop = stop

    def stopped(self) -> bool:
        return self.cancel.is_set() or (self.stop is not None and self.stop.is_set())

    def _get(self, **kw: Any) -> dict[str, Any]:
        try:
            obj: dict[str, Any] = self.s3.get_object(Bucket=self.bucket, Key=self.key, **kw)
        except (BotoCoreError, ClientError) as exc:
            raise _read_error(self.where, self.key, self.size, exc) from None
        return obj

    def empty(self) -> None:
        """A shard of 0 bytes: one plain GET (there is no range to ask for), which must be
        empty."""
        obj = self._get()
        try:
            extra = len(obj["Body"].read(1))
        except (BotoCoreError, ClientError) as exc:
            raise _read_error(self.where, self.key, 0, exc) from None
        finally:
            _close(obj["Body"])
        total = obj.get("ContentLength", extra)
        if type(total) is not int or total < 0:  # a bool is no length either
            raise CorruptStep(f"{self.where}: {self.key}: a Content-Length of "
                              f"{str(total)[:40]!r}")
        if total or extra:
            raise _sized(self.where, self.key, max(total, extra), 0)

    def part(self, first: int, last: int) -> Part:
        """Bytes ``first``-``last``: into their place in the buffer (None), or into a buffer
        of their own for the caller to write to the file; and, with ``keyed``, the digests of
        their leaves (``first`` is a leaf's start), hashed here, in this worker's thread, as
        the bytes arrive: a step's parts share a remote link and land together at its end, so
        a part hashed only once whole would put the step's hashing after its last byte."""
        if self.stopped():
            raise _Cancelled
        obj = self._get(Range=f"bytes={first}-{last}")
        body, n = obj["Body"], last - first + 1
        try:
            got = parse_content_range(obj.get("ContentRange"))
            if got is None:
                raise CorruptStep(f"{self.where}: {self.key}: asked for bytes {first}-{last}, "
                                  "and the answer has no valid Content-Range "
                                  f"({str(obj.get('ContentRange'))[:60]!r})")
            if got[2] != self.size:
                raise _sized(self.where, self.key, got[2], self.size)
            if got[:2] != (first, last):
                raise CorruptStep(f"{self.where}: {self.key}: answered bytes {got[0]}-{got[1]} "
                                  f"when asked for {first}-{last}")
            out = memoryview(bytearray(n)) if self.view is None else self.view[first:last + 1]
            stream = None if self.keyed is None else self.keyed.stream()
            done = 0
            while done < n:
                if self.stopped():
                    raise _Cancelled
                k = _read_into(body, out[done:min(n, done + CHUNK)])
                if not k:
                    raise CorruptStep(f"{self.where}: {self.key}: short body: bytes "
                                      f"{first}-{last} ended after {done} of {n}")
                if stream is not None:
                    stream.update(out[done:done + k])
                done += k
                if self.progress is not None:
                    self.progress(k)
            if body.read(1):
                raise CorruptStep(f"{self.where}: {self.key}: long body: more than the bytes "
                                  f"{first}-{last} asked for")
        except (BotoCoreError, ClientError) as exc:
            raise _read_error(self.where, self.key, self.size, exc) from None
        finally:
            _close(body)
        if self.stopped():
            raise _Cancelled
        return (out if self.view is None else None), b"" if stream is None else stream.leaves()


def _read_into(body: Any, view: memoryview) -> int:
    """Bytes of ``body`` into ``view``: its own readinto where it has one (botocore 1.38+),
    else read and copy (Debian's botocore 1.37 has only read: found in the test cluster)."""
    readinto = getattr(body, "readinto", None)
    if readinto is not None:
        return int(readinto(view))
    data = body.read(len(view))
    view[:len(data)] = data
    return len(data)


def _close(body: Any) -> None:
    close = getattr(body, "close", None)
    if close is not None:
        close()


def fetch(s3: Any, bucket: str, key: str, size: int, checksum: str, dest: Dest, *,
          part_size: int, concurrency: int, deadline: float | None = None,
          progress: Callable[[int], None] | None = None, where: str = "s3",
          keyed: Keyed | None = None, stop: threading.Event | None = None) -> None:
    """Fill ``dest`` (a writable buffer of ``size`` bytes, or a file descriptor open for
    writing, written at offsets 0 to ``size``) with the object ``key``, verified against the
    manifest's ``size`` and ``checksum`` and, with ``keyed``, the shard's keyed digest (checked
    first: a mismatch says so). ``where`` starts every message (the tier, step and shard).
    CorruptStep, FetchTimeout; ValueError for a destination of another size. After a
    FetchTimeout, a worker still blocked in a read may yet write into a buffer ``dest``: the
    caller discards it (never a descriptor: only this thread writes those). ``stop``: once
    set (by the caller, from another thread), the workers stop within one chunk and this
    raises `Stopped`."""
    if part_size < 1 or concurrency < 1:
        raise ValueError(f"part size {part_size} and concurrency {concurrency}: expected >= 1")
    if keyed is not None:
        part_size = -(-part_size // LEAF) * LEAF  # whole leaves: each worker hashes its own
    job = _Fetch(s3, bucket, key, size, dest, progress, where, keyed, stop)
    start = time.monotonic()
    digest = xxhash.xxh3_64()
    leaves: list[bytes] = []
    if size == 0:
        job.empty()
    else:
        _run(job, parts(size, part_size), concurrency, digest, leaves, start, deadline)
    if keyed is not None and not keyed.matches(b"".join(leaves)):
        raise CorruptStep(f"{where}: {MISMATCH}")
    if digest.hexdigest() != checksum:
        raise CorruptStep(f"{where}: checksum mismatch")


def _run(job: _Fetch, spans: list[tuple[int, int]], concurrency: int,
         digest: Any, leaves: list[bytes], start: float, deadline: float | None) -> None:
    # Into a file, parts done ahead of the hasher are held in memory: start at most
    # `concurrency` ahead of it. Into a buffer they are already in place: start them all (the
    # pool still runs `concurrency` at once).
    window = concurrency if job.view is None else len(spans)
    pool = ThreadPoolExecutor(max_workers=min(concurrency, len(spans)),
                              thread_name_prefix="s3fetch")
    running: dict[Future[Part], int] = {}
    ready: dict[int, Part] = {}
    started = hashed = 0
    timed_out = False
    try:
        while hashed < len(spans):
            while started < len(spans) and started < hashed + window:
                running[pool.submit(job.part, *spans[started])] = started
                started += 1
            left = None if deadline is None else deadline - time.monotonic()
            finished = wait(running, timeout=left, return_when=FIRST_COMPLETED)[0] \
                if left is None or left > 0 else set()
            if not finished:
                timed_out = True
                raise FetchTimeout(f"{job.where}: {job.key}: not done within "
                                   f"{(deadline or start) - start:.1f} s ({hashed} of "
                                   f"{len(spans)} parts in)")
            for f in finished:
                try:
                    ready[running.pop(f)] = f.result()  # a worker's CorruptStep is raised here
                except _Cancelled:  # only `stop` sets `cancel` before the finally below
                    raise Stopped(f"{job.where}: {job.key}: stopped ({hashed} of "
                                  f"{len(spans)} parts in)") from None
            while hashed in ready:  # the contiguous prefix, in order
                buf, part_leaves = ready.pop(hashed)
                leaves.append(part_leaves)
                first, last = spans[hashed]
                if job.view is not None:
                    digest.update(job.view[first:last + 1])
                elif buf is not None:
                    _pwrite_all(job.fd, buf, first)
                    digest.update(buf)
                hashed += 1
    finally:
        job.cancel.set()
        # The workers see `cancel` within one chunk; after a timeout one may be stuck in a read
        # (bounded by the client's read timeout), which the caller does not wait for.
        pool.shutdown(wait=not timed_out, cancel_futures=True)
