"""``MANIFEST.mac``: what binds an S3 step to the job's key, the manifest and, since the hostile
review of issue 37, every shard's bytes (docs/design/object-store-sites.md 3.7). Pure, but for
the threads that hash a step's shards while the caller uploads them (`Hashing`).

A manifest's per-shard checksum is xxh3_64: enough against damage, not against a person. S3
cannot tell its writers apart, and xxh3's accumulators are sums of a shard's 8-byte lanes and of
products one can zero, so anyone with the bucket's credentials can make other bytes of the same
size and xxh3_64 in a few lines. So each shard of a step this release writes has a digest under
a key derived from the job's, which nobody without the job's key can compute:

    dkey   = HMAC-SHA256(job key, "gpuwarden-s3-shard-digest\\0v1")
    leaf_i = HMAC-SHA256(dkey, 0x00 | the shard's bytes [i MiB, (i+1) MiB))
    digest = HMAC-SHA256(dkey, 0x01 | job | rank | step | name | size | leaf_0 | leaf_1 | ...)

(job to size each length-prefixed: a digest holds for one shard of one step, no other). Leaves
of 1 MiB let the threads of a ranged download (`s3fetch`) hash their own parts, and the writer
its shards in several threads: one HMAC-SHA256 stream runs at about 1 GB/s, less than a fast
node's restore. HMAC-SHA256 rather than keyed BLAKE2b: with the SHA extensions of x86 CPUs since
about 2019 it is the faster (1.2 against 0.65 GB/s measured here).

``MANIFEST.mac`` of such a step (version 2), written after the shards and before the manifest:

    v2 <kid>:<64 hex>\\n      ("v2 <64 hex>" under a shared tier's peer.key, as version 1)
    <64 hex>\\n               one line per shard, in the manifest's order: its digest

the MAC being HMAC-SHA256(job key, "gpuwarden-s3-step\\0v2\\0" | the manifest's length in 8
bytes | the manifest | every line after the first): the digests are authenticated with the
manifest, so none can be swapped in from another step or object. Version 1 (``<kid>:<hex>`` or
``<hex>``: the MAC of the manifest alone, under another label) is what earlier releases wrote;
it is still read, so a job checkpointed before an upgrade restores after it, and the caller logs
such a step as legacy (bound by xxh3 only). A version-2 object cannot be made into a version-1
one: the labels differ, so a MAC stripped of its digests verifies as neither.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from gpuwarden.ckpt.codec import Buf
from gpuwarden.ckpt.jobkey import KID, LEGACY, JobKeys
from gpuwarden.ckpt.manifest import MAX_BYTES, Manifest
from gpuwarden.ckpt.tier import CorruptStep

MAC = "MANIFEST.mac"
V1_LABEL = b"gpuwarden-s3-manifest\0"
V2_LABEL = b"gpuwarden-s3-step\0v2\0"
DIGEST_LABEL = b"gpuwarden-s3-shard-digest\0v1"
LEAF = 1 << 20
SPAN = 64 * LEAF  # the writer's unit of work for one thread
V1_MAX = 128  # "<kid>:" (at most 33 bytes) and 64 hex digits
# A version-2 object: a first line and a 65-byte line per shard. A manifest of MAX_BYTES holds
# fewer than MAX_BYTES / 65 shards (each shard's JSON is longer than that), so this never
# refuses what a writer wrote, and bounds what is read of anyone else's object.
MAX_SIZE = MAX_BYTES
MISMATCH = ("content does not match its keyed digest: changed by someone without the job's key, "
            "or damaged")

_HEX = rb"([0-9a-f]{64})"
_V1 = re.compile(rb"(?:(" + KID.pattern.encode() + rb"):)?" + _HEX)
_V2 = re.compile(rb"v2 (?:(" + KID.pattern.encode() + rb"):)?" + _HEX)
_RECORDS = re.compile(rb"(?:[0-9a-f]{64}\n)*")
_RECORD = re.compile(rb"[0-9a-f]{64}")


# ---- the shards' digests ----------------------------------------------------------------------
def digest_key(job_key: bytes) -> bytes:
    """The key of the shards' digests, derived from the job's (never the job's key itself: a
    digest and a MAC are never made with one key)."""
    return hmac.new(job_key, DIGEST_LABEL, hashlib.sha256).digest()


def context(job: str, rank: int, step: int, name: str, size: int) -> bytes:
    """What a shard's digest is bound to besides its bytes, each field length-prefixed."""
    fields = (job.encode(), str(rank).encode(), str(step).encode(), name.encode(),
              str(size).encode())
    return b"".join(len(f).to_bytes(4, "big") + f for f in fields)


@dataclass(frozen=True)
class Keyed:
    """One shard's keyed digest: its key and context, and (read back) the value it must have."""

    key: bytes = field(repr=False)  # `digest_key`'s
    context: bytes
    want: str = ""

    @classmethod
    def of(cls, job_key: bytes, job: str, rank: int, step: int, name: str, size: int,
           want: str = "") -> Keyed:
        return cls(digest_key(job_key), context(job, rank, step, name, size), want)

    def leaves(self, data: Buf) -> bytes:
        """The digests of ``data``'s 1 MiB leaves, in order (``data`` starts at a leaf's
        start; the last may be short). Threads may call it at once: hashlib lets go of the
        GIL while it hashes."""
        view = memoryview(data).cast("B")
        base = hmac.new(self.key, b"\0", hashlib.sha256)
        out = []
        for a in range(0, len(view), LEAF):
            h = base.copy()
            h.update(view[a:a + LEAF])
            out.append(h.digest())
        return b"".join(out)

    def root(self, leaves: bytes) -> str:
        """The shard's digest (hex) from all its leaves' digests, in order."""
        return hmac.new(self.key, b"\1" + self.context + leaves, hashlib.sha256).hexdigest()

    def matches(self, leaves: bytes) -> bool:
        return hmac.compare_digest(self.root(leaves), self.want)

    def stream(self) -> Stream:
        return Stream(self)


class Stream:
    """A shard's keyed digest fed in order, in pieces of any size (a streamed read)."""

    def __init__(self, keyed: Keyed) -> None:
        self.keyed = keyed
        self._base = hmac.new(keyed.key, b"\0", hashlib.sha256)
        self._done: list[bytes] = []
        self._leaf: hmac.HMAC | None = None
        self._filled = 0

    def update(self, data: Buf) -> None:
        view = memoryview(data).cast("B")
        while view:
            if self._leaf is None:
                self._leaf, self._filled = self._base.copy(), 0
            take = min(LEAF - self._filled, len(view))
            self._leaf.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == LEAF:
                self._done.append(self._leaf.digest())
                self._leaf = None

    def leaves(self) -> bytes:
        last = [] if self._leaf is None else [self._leaf.digest()]
        return b"".join(self._done + last)


class Hashing:
    """A step's shards' digests, computed by ``threads`` threads while the caller uploads the
    shards (which only read the same buffers): `result` waits for them."""

    def __init__(self, shards: Sequence[tuple[Keyed, Buf]], threads: int) -> None:
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="s3digest")
        self._work: list[tuple[Keyed, list[Future[bytes]]]] = []
        try:
            for keyed, data in shards:
                view = memoryview(data).cast("B")
                spans = range(0, len(view), SPAN)
                self._work.append((keyed, [self._pool.submit(keyed.leaves, view[a:a + SPAN])
                                           for a in spans]))
        except BaseException:
            self.close()
            raise

    def result(self) -> list[str]:
        return [keyed.root(b"".join(f.result() for f in parts)) for keyed, parts in self._work]

    def close(self) -> None:
        """Drop what has not started; what has runs out in at most one span per thread."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def threads() -> int:
    """Threads the writer hashes with: a few, beside the training the job is doing."""
    return min(4, os.cpu_count() or 1)


# ---- MANIFEST.mac ------------------------------------------------------------------------------
def manifest_mac(key: bytes, raw: bytes) -> str:
    """A version-1 MAC (earlier releases'): of the manifest's bytes alone (hex)."""
    return hmac.new(key, V1_LABEL + raw, hashlib.sha256).hexdigest()


def step_mac(key: bytes, raw: bytes, records: bytes) -> str:
    """A version-2 MAC: of the manifest's bytes and the digests' lines (hex)."""
    message = V2_LABEL + len(raw).to_bytes(8, "big") + raw + records
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def body(signing: tuple[str, bytes], raw: bytes, digests: Sequence[str]) -> bytes:
    """``MANIFEST.mac``'s contents (version 2) for the manifest ``raw`` whose shards, in its
    order, have ``digests``."""
    kid, key = signing
    records = b"".join(d.encode() + b"\n" for d in digests)
    mac = step_mac(key, raw, records).encode()
    return b"v2 " + (mac if kid == LEGACY else kid.encode() + b":" + mac) + b"\n" + records


@dataclass(frozen=True)
class Checked:
    """A ``MANIFEST.mac`` verified: the job key that made it, and (version 2) the shards'
    digests in the manifest's order; None: a legacy (version-1) step."""

    key: bytes = field(repr=False)
    kid: str
    digests: tuple[str, ...] | None


def check(keys: JobKeys, mac: bytes, raw: bytes, where: str) -> Checked:
    """``mac`` verified as a MAC of the manifest ``raw`` (and, version 2, of its digests) under
    the key it names among ``keys``; CorruptStep, ``where`` first, naming what is wrong."""
    version, kid, value, records = _parse(mac, where)
    key = keys.by_kid.get(kid)
    if key is None and kid == LEGACY:
        raise CorruptStep(f"{where}: its MAC has no key id (written under a shared tier's "
                          "peer.key), and this job has no shared-tier key to check it with: "
                          "refused")
    if key is None:
        raise CorruptStep(f"{where}: signed with site key kid {kid}, which this node no longer "
                          "has (retired?): refused")
    want = manifest_mac(key, raw) if version == 1 else step_mac(key, raw, records)
    if not hmac.compare_digest(value, want.encode()):
        raise CorruptStep(f"{where}: not authenticated with this job's key (written by someone "
                          "else, or damaged): refused")
    if version == 1:
        return Checked(key, kid, None)
    return Checked(key, kid, tuple(line.decode() for line in records.split(b"\n")[:-1]))


def is_legacy(mac: bytes) -> bool:
    """Whether ``mac`` has the legacy (version 1) form: one line, no shard digests. Says
    nothing of whether it verifies: only which rule applies (`[ckpt] s3_legacy_steps`)."""
    return b"\n" not in mac


def _parse(mac: bytes, where: str) -> tuple[int, str, bytes, bytes]:
    """(version, key id, MAC in hex, the digests' lines); CorruptStep for anything else."""
    if is_legacy(mac):
        m = _V1.fullmatch(mac)
        if m is None:
            raise CorruptStep(f"{where}: {MAC} is not 'v2 <key id>:<64 hex>' with shard "
                              "digests, nor '<key id>:<64 hex>' or '<64 hex>' (legacy): refused")
        return 1, (m.group(1) or b"").decode(), m.group(2), b""
    head, records = mac.split(b"\n", 1)
    m = _V2.fullmatch(head)
    if m is None:
        raise CorruptStep(f"{where}: {MAC}: line 1 is not 'v2 <key id>:<64 hex>' nor "
                          "'v2 <64 hex>': refused")
    if _RECORDS.fullmatch(records) is None:
        raise CorruptStep(f"{where}: {MAC}: {_bad_record(records)}: refused")
    return 2, (m.group(1) or b"").decode(), m.group(2), records


def _bad_record(records: bytes) -> str:
    lines = records.split(b"\n")
    for n, line in enumerate(lines[:-1], 2):
        if _RECORD.fullmatch(line) is None:
            return f"line {n} is not a shard's digest (64 lowercase hex digits)"
    return f"line {len(lines) + 1} has no newline (cut short?)"


def bind(checked: Checked, m: Manifest, where: str) -> dict[str, Keyed] | None:
    """Each shard's `Keyed` (with the digest it must have) for the verified manifest ``m``;
    None for a legacy step. CorruptStep when the digests are not one per shard."""
    if checked.digests is None:
        return None
    if len(checked.digests) != len(m.shards):
        raise CorruptStep(f"{where}: {MAC} holds {len(checked.digests)} shard digests for "
                          f"{len(m.shards)} shards: refused")
    key = digest_key(checked.key)
    return {s.name: Keyed(key, context(m.job, m.rank, m.step, s.name, s.size), d)
            for s, d in zip(m.shards, checked.digests, strict=True)}
