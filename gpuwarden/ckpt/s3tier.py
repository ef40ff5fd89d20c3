"""A checkpoint tier in S3 (boto3): the durable copy.

Shards go up first (multipart for big ones, with bounded part size and concurrency, retries with
jitter and hard timeouts), the manifest last: a step is visible only once its manifest object
exists, so an upload killed at any point leaves no step behind. Nothing read back is trusted
before its checksum matches the manifest. Leftover multipart uploads of crashed writers are
aborted by `gc`.

Keys: <prefix>/<job>/rank-NNNNN/step-NNNNNNNNNNNN/<shard>, .../MANIFEST.mac, .../MANIFEST.json.

A bucket and prefix are site-wide and nodes' credentials (an instance role) are shared by every
user's jobs, so S3 cannot tell who wrote an object, and a manifest's digest proves nothing: anyone
can compute one. So every manifest is authenticated: ``MANIFEST.mac`` holds HMAC-SHA256 of the
manifest's bytes under the job's key, uploaded before the manifest. The job's keys
(`jobkey.JobKeys`) are either derived from the site secret by the prolog (`jobkey`; the MAC
reads ``<kid>:<hex>``, naming the site key it was made under, so the secret can be rotated: an
old kid keeps verifying until it is retired) or, on a shared-filesystem site without
``key_file``, the random key in a 0600 file in the job's private directory on the shared tier
(`peer.job_key`; the MAC is plain ``<hex>``, and only such a key verifies it). A step whose MAC
is missing, malformed or wrong, or read without the key it names, is refused (CorruptStep) and
restore walks on.

A shard's checksum in the manifest (xxh3_64) is no defence against someone with the bucket's
credentials: it can be collided. So ``MANIFEST.mac`` also holds a keyed digest of every shard
(`s3mac`), which every read checks before a byte is used: `load` and the prolog's stage-in as
the ranged GETs land (`s3fetch`), `verify` as it streams. A step written before that (a MAC
without digests) still restores, logged once as legacy: its shards are bound by xxh3 alone.

A manifest's name is anyone's to write too, and each one a restore tries costs a GET: so the
steps a rank holds (`held`) are those whose index marker (`s3index`, HMAC-tagged) verifies, and
at most `MAX_UNMARKED` without one (from before the index, or a marker whose PUT failed).
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import boto3
import xxhash
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from gpuwarden.ckpt import s3mac
from gpuwarden.ckpt.codec import Buf
from gpuwarden.ckpt.jobkey import JobKeys
from gpuwarden.ckpt.manifest import (
    MAX_BYTES,
    Manifest,
    ManifestError,
    Shard,
    check_identity,
    from_json,
)
from gpuwarden.ckpt.names import check_name, parse_step_dir, step_dir
from gpuwarden.ckpt.progress import Progress
from gpuwarden.ckpt.s3fetch import Stopped, fetch
from gpuwarden.ckpt.s3index import INDEX, Index, marker_name, rank_prefix
from gpuwarden.ckpt.s3mac import MAC, Keyed, manifest_mac
from gpuwarden.ckpt.tier import MANIFEST, CorruptStep, TierError, check_writable

log = logging.getLogger(__name__)

__all__ = ["MAC", "MAX_UNMARKED", "Held", "S3Settings", "S3Step", "S3Tier", "client", "manifest_mac"]

# A shard restored from S3 gets at least this many of `s3_get_concurrency`'s parts in flight
# (`load` spreads the rest over more shards at once).
SHARD_PARTS_MIN = 4

# A step is held when its index marker verifies under the job's keys; a manifest listed without
# one (a step from before the index, or whose marker's PUT failed) may still be the job's, and
# costs a restore a GET to refuse when it is not. Anyone with the bucket's credentials can write
# such names, so no more than this many per rank are taken (an honest rank has `keep` or so).
MAX_UNMARKED = 64

_LEGACY_SEEN: set[str] = set()
_LEGACY_SEEN_MAX = 100_000  # bounded: a long job reading many legacy steps


@dataclass(frozen=True)
class S3Step:
    """A step's manifest, verified with its MAC where it was found, its bytes as stored (stage-in
    copies them byte for byte), and each shard's keyed digest (None: a legacy step, its shards
    bound by their xxh3 alone)."""

    manifest: Manifest
    raw: bytes
    keyed: Mapping[str, Keyed] | None

    def keyed_for(self, name: str) -> Keyed | None:
        return None if self.keyed is None else self.keyed[name]


@dataclass(frozen=True)
class Held:
    """A rank's steps in S3 (`S3Tier.held`): ``steps``, sorted; ``marked``, those of them
    whose index marker verifies under the job's keys; ``left_out``, how many names without a
    marker were not taken (more than `MAX_UNMARKED`)."""

    steps: tuple[int, ...]
    marked: frozenset[int]
    left_out: int = 0


@dataclass(frozen=True)
class S3Settings:
    bucket: str
    prefix: str = "gpuwarden-ckpt"
    endpoint_url: str | None = None
    part_size: int = 64 << 20
    concurrency: int = 8
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    retries: int = 5
    # Restores: each shard by ranged GETs of this size, this many at once (s3fetch).
    get_part_size: int = 16 << 20
    get_concurrency: int = 16
    # Steps without keyed shard digests: "restore" (warned once each) or "refuse".
    legacy_steps: str = "restore"


def client(settings: S3Settings, credentials: Mapping[str, str] | None = None,
           session: Any = None) -> Any:
    """A boto3 S3 client with bounded timeouts and jittered ("adaptive") retries; with
    ``credentials`` (boto3.client's keyword arguments: the prolog's stage-in), those instead of
    boto3's default chain; ``session``: a boto3 Session of the caller's (default: boto3's)."""
    cfg = Config(connect_timeout=settings.connect_timeout_s,
                 read_timeout=settings.read_timeout_s,
                 retries={"max_attempts": settings.retries, "mode": "adaptive"},
                 max_pool_connections=max(10, settings.concurrency * 2,
                                          settings.get_concurrency))
    return (session or boto3).client("s3", endpoint_url=settings.endpoint_url, config=cfg,
                                     **dict(credentials or {}))


class S3Tier:
    def __init__(self, name: str, settings: S3Settings, job: str, rank: int = 0,
                 s3: Any = None, key: bytes | None = None, keys: JobKeys | None = None) -> None:
        self.name = name
        # The job's keys; None: nothing can be written, nothing is trusted. ``key``: a shared
        # tier's peer.key alone.
        self.keys = keys if keys is not None else None if key is None else JobKeys.shared(key)
        self.s = settings
        check_name(settings.prefix, "S3 prefix")
        self.job, self.rank = check_name(job, "job"), int(rank)
        self.base = f"{settings.prefix}/{self.job}/rank-{self.rank:05d}"
        self.index_base = f"{settings.prefix}/{self.job}/{INDEX}/"
        self.s3 = s3 if s3 is not None else client(settings)
        self._transfer = TransferConfig(multipart_threshold=settings.part_size,
                                        multipart_chunksize=settings.part_size,
                                        max_concurrency=settings.concurrency, use_threads=True)

    @property
    def key(self) -> bytes | None:
        """The signing key (None: none)."""
        return None if self.keys is None else self.keys.signing[1]

    @key.setter
    def key(self, key: bytes | None) -> None:
        """A shared tier's peer.key as the job's only key (JobCheckpointer on a shared-tier
        site)."""
        self.keys = None if key is None else JobKeys.shared(key)

    def _key(self, step: int, name: str) -> str:
        return f"{self.base}/{step_dir(step)}/{name}"

    def commit(self, manifest: Manifest, data: Mapping[str, Buf],
               progress: Callable[[int], None] | None = None) -> None:
        if (manifest.job, manifest.rank) != (self.job, self.rank):
            raise TierError(f"{self.name}: a step of {manifest.job} rank {manifest.rank} does not "
                            f"belong under s3://{self.s.bucket}/{self.base}")
        check_writable(self.name, manifest)
        if self.keys is None:
            raise TierError(f"{self.name}: no job key to authenticate step {manifest.step} "
                            "with (set [ckpt] key_file, or shared_root: docs/checkpointing.md)")
        raw = manifest.to_json().encode()
        if progress is None:
            progress = Progress(f"{self.name}: uploading step {manifest.step}",
                                manifest.total_bytes)
        dkey = s3mac.digest_key(self.keys.signing[1])
        views = {s.name: memoryview(data[s.name]).cast("B") for s in manifest.shards}
        # Each shard's keyed digest, hashed by a few threads while the shards go up (the
        # bytes hashed are the bytes uploaded: both read the same buffers).
        hashing = s3mac.Hashing(
            [(Keyed(dkey, s3mac.context(self.job, self.rank, manifest.step, s.name, s.size)),
              views[s.name]) for s in manifest.shards], s3mac.threads())
        try:
            for shard in manifest.shards:
                self.s3.upload_fileobj(io.BytesIO(views[shard.name]), self.s.bucket,
                                       self._key(manifest.step, shard.name),
                                       Config=self._transfer, Callback=progress)
            mac = s3mac.body(self.keys.signing, raw, hashing.result())
            if len(mac) > s3mac.MAX_SIZE:  # never write what no reader takes
                raise TierError(f"{self.name}: step {manifest.step}: {len(manifest.shards)} "
                                f"shards: their digests do not fit in {MAC}")
            # The MAC (with the digests) before the manifest: a step is visible only whole.
            self.s3.put_object(Bucket=self.s.bucket, Key=self._key(manifest.step, MAC),
                               Body=mac)
            self.s3.put_object(Bucket=self.s.bucket, Key=self._key(manifest.step, MANIFEST),
                               Body=raw)
        except (BotoCoreError, ClientError) as exc:
            raise TierError(f"{self.name}: cannot upload step {manifest.step} to "
                            f"s3://{self.s.bucket}/{self.base} ({exc})") from None
        finally:
            hashing.close()
        self._mark(manifest)

    def _mark(self, manifest: Manifest) -> None:
        """The step's marker in the job's index, after its manifest (a marker never names a
        step that is not whole). It only spares the prolog's stage-in a LIST per rank: the
        step is committed without it, so a failure is a warning."""
        assert self.keys is not None  # commit checked it
        try:
            marker = self.index_base + marker_name(self.keys.signing, self.job, self.rank,
                                                   manifest.step, manifest.world_size)
            self.s3.put_object(Bucket=self.s.bucket, Key=marker, Body=b"")
        except (BotoCoreError, ClientError, ValueError) as exc:
            log.warning("%s: step %d is stored, but its index marker is not (%s): stage-in on "
                        "a requeue will not see it", self.name, manifest.step, exc)

    def index(self) -> Index:
        """The job's index (every rank's), from one paginated LIST: the markers this job's
        keys verify, and how many names were refused. TierError if it cannot be listed."""
        try:
            pages = self.s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.s.bucket, Prefix=self.index_base)
            names = [obj["Key"][len(self.index_base):]
                     for page in pages for obj in page.get("Contents", [])]
        except (BotoCoreError, ClientError) as exc:
            raise TierError(f"{self.name}: cannot list s3://{self.s.bucket}/{self.index_base} "
                            f"({exc})") from None
        return Index.read(names, self.keys, self.job)

    def steps(self) -> list[int]:
        return list(self.held().steps)

    def held(self, index: Index | None = None) -> Held:
        """This rank's steps: each manifest listed under its prefix whose index marker verifies
        under the job's keys, and those without one (see `MAX_UNMARKED`). ``index``: the job's,
        read once for many ranks (root's `ckpt ls` and `gc`); without it, the markers of the
        listed steps alone are listed (a LIST per step, not the whole job's index), or the
        whole index when there are more than `MAX_UNMARKED` of them. TierError when they
        cannot be listed, or when only names no marker vouches for are there, too many to
        try (they may hide this rank's steps from before the index: not "none")."""
        listed = set(self._manifests())
        if index is None and self.keys is not None and listed:
            index = self._markers(sorted(listed)) if len(listed) <= MAX_UNMARKED else \
                self.index()
        marked = listed.intersection(m.step for m in (index.markers if index else ())
                                     if m.rank == self.rank)
        unmarked = len(listed) - len(marked)
        if unmarked <= MAX_UNMARKED:
            return self._without_legacy(Held(tuple(sorted(listed)), frozenset(marked), 0))
        where = f"s3://{self.s.bucket}/{self.base}"
        if not marked:
            raise TierError(f"{self.name}: {where}: {unmarked} step names and no index marker "
                            f"of this job's: more than {MAX_UNMARKED} to try (someone with the "
                            "bucket's credentials planted them?)")
        log.warning("%s: %s: %d step names without an index marker of this job's left out "
                    "(more than %d: planted?); its %d marked steps are used", self.name, where,
                    unmarked, MAX_UNMARKED, len(marked))
        return self._without_legacy(Held(tuple(sorted(marked)), frozenset(marked), unmarked))

    def _manifests(self) -> list[int]:
        """The steps with a manifest listed under this rank's prefix: names anyone can write."""
        out = []
        try:
            pages = self.s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.s.bucket, Prefix=f"{self.base}/")
            for page in pages:
                for obj in page.get("Contents", []):
                    rest = obj["Key"][len(self.base) + 1:]
                    parts = rest.split("/")
                    if len(parts) == 2 and parts[1] == MANIFEST:
                        step = parse_step_dir(parts[0])
                        if step is not None:
                            out.append(step)
        except (BotoCoreError, ClientError) as exc:
            raise TierError(f"{self.name}: cannot list s3://{self.s.bucket}/{self.base} "
                            f"({exc})") from None
        return sorted(out)

    def _markers(self, steps: list[int]) -> Index:
        """This rank's markers of ``steps``: a LIST each (a rank holds a few steps, a job's
        index a few per rank: the whole of it would be every rank's LISTs at a restart)."""
        names: list[str] = []
        try:
            for step in steps:
                prefix = self.index_base + rank_prefix(step, self.rank)
                pages = self.s3.get_paginator("list_objects_v2").paginate(
                    Bucket=self.s.bucket, Prefix=prefix)
                names += [obj["Key"][len(self.index_base):]
                          for page in pages for obj in page.get("Contents", [])]
        except (BotoCoreError, ClientError) as exc:
            raise TierError(f"{self.name}: cannot list s3://{self.s.bucket}/{self.index_base} "
                            f"({exc})") from None
        return Index.read(names, self.keys, self.job)

    def _get(self, key: str, limit: int, what: str) -> Buf:
        """A small object (a manifest, its MAC), at most ``limit`` bytes, read in chunks into
        one buffer: a larger one is refused (``what``: the limit, as the message says it)
        before it is read, or as soon as it says more than it is."""
        try:
            obj = self.s3.get_object(Bucket=self.s.bucket, Key=key)
            size = obj.get("ContentLength", limit)
            if type(size) is not int or size < 0:  # a bool is no length either
                raise CorruptStep(f"{self.name}: {key}: a Content-Length of {str(size)[:40]!r}")
            too_big = CorruptStep(f"{self.name}: {key}: larger than {what}")
            if size > limit:
                raise too_big
            buf = bytearray(size)
            pos = 0
            while chunk := obj["Body"].read(min(8 << 20, size - pos + 1)):
                if pos + len(chunk) > size:
                    raise too_big
                buf[pos:pos + len(chunk)] = chunk
                pos += len(chunk)
        except (BotoCoreError, ClientError) as exc:
            raise CorruptStep(f"{self.name}: {key}: cannot read ({exc})") from None
        return buf if pos == size else buf[:pos]

    def manifest(self, step: int) -> Manifest:
        """The step's manifest, authenticated with the job's key, verified and used only where
        it was found; CorruptStep if not."""
        return self.read_manifest(step).manifest

    def read_manifest(self, step: int) -> S3Step:
        """The step's manifest, its bytes as stored and its shards' keyed digests, all
        authenticated with the job's key (CorruptStep if not). The MAC is read first, so a step
        without one costs one small GET, not a manifest's."""
        source = f"s3://{self.s.bucket}/{self._key(step, MANIFEST)}"
        if self.keys is None:
            raise CorruptStep(f"{self.name} step {step}: {source}: no job key to authenticate "
                              "it with (S3 cannot tell who wrote it): refused")
        where = f"{self.name} step {step}: {source}"
        try:
            mac = self._mac(step)
        except CorruptStep as exc:
            raise CorruptStep(f"{exc}: refused") from None
        if self.s.legacy_steps == "refuse" and s3mac.is_legacy(mac):
            # Before the manifest's GET: it cannot count. (So `_legacy` below only warns.)
            raise CorruptStep(f"{where}: a legacy step (its {MAC} has no keyed shard "
                              "digests): refused ([ckpt] s3_legacy_steps = \"refuse\"; "
                              "\"restore\" takes it, bound by its xxh3_64 checksums alone)")
        raw = bytes(self._get(self._key(step, MANIFEST), MAX_BYTES,
                              f"{MAX_BYTES} bytes (a manifest)"))
        checked = s3mac.check(self.keys, mac, raw, where)
        try:
            m = from_json(raw, source)
            check_identity(m, self.job, self.rank, step, source)
        except ManifestError as exc:
            raise CorruptStep(f"{self.name} step {step}: {exc}") from None
        keyed = s3mac.bind(checked, m, where)
        if keyed is None:
            self._legacy(step, source)
        return S3Step(m, raw, keyed)

    def _mac(self, step: int) -> bytes:
        """The step's ``MANIFEST.mac`` object, bounded (`_get`)."""
        return bytes(self._get(self._key(step, MAC), s3mac.MAX_SIZE,
                               f"{s3mac.MAX_SIZE} bytes (a MAC and its shards' digests)"))

    def _legacy(self, step: int, source: str) -> None:
        """Warned once per step in this process (restore, retention and listing each read it)."""
        if source in _LEGACY_SEEN:
            return
        if len(_LEGACY_SEEN) < _LEGACY_SEEN_MAX:
            _LEGACY_SEEN.add(source)
        log.warning("%s step %d: %s: a legacy step (its %s, from before keyed shard digests, "
                    "has none): its shards are bound to it only by their xxh3_64 checksums, "
                    "which someone with the bucket's credentials can forge; restored all the "
                    "same (the job's next steps are written with digests)", self.name, step,
                    source, MAC)

    def _without_legacy(self, held: Held) -> Held:
        """``held`` less the steps whose MAC object has the legacy form, where the site refuses
        them: a marker (from a release with markers and no digests, or a replayed step) must
        not make one count, for root's gc floor or retention. One small GET per step."""
        if self.s.legacy_steps != "refuse":
            return held
        legacy = set()
        for step in held.steps:
            try:
                if s3mac.is_legacy(self._mac(step)):
                    legacy.add(step)
            except CorruptStep:
                continue  # unreadable or too big: every read of the step refuses it anyway
        if not legacy:
            return held
        return Held(tuple(s for s in held.steps if s not in legacy), held.marked - legacy,
                    held.left_out)

    def verify(self, step: int) -> Manifest:
        """The manifest and every shard's keyed digest (a legacy step: its checksum), streamed:
        memory stays bounded whatever the manifest declares (root's `ckpt verify`)."""
        got = self.read_manifest(step)
        m = got.manifest
        for shard in m.shards:
            key = self._key(step, shard.name)
            keyed = got.keyed_for(shard.name)
            stream = None if keyed is None else keyed.stream()
            digest, size = xxhash.xxh3_64(), 0
            try:
                body = self.s3.get_object(Bucket=self.s.bucket, Key=key)["Body"]
                while chunk := body.read(8 << 20):
                    size += len(chunk)
                    if size > shard.size:
                        break
                    digest.update(chunk)
                    if stream is not None:
                        stream.update(chunk)
            except (BotoCoreError, ClientError) as exc:
                raise CorruptStep(f"{self.name}: {key}: cannot read ({exc})") from None
            where = f"{self.name} step {step}: shard {shard.name}"
            if size != shard.size:
                relation = "larger" if size > shard.size else "smaller"
                raise CorruptStep(f"{where}: {relation} than the manifest says")
            if stream is not None and not stream.keyed.matches(stream.leaves()):
                raise CorruptStep(f"{where}: {s3mac.MISMATCH}")
            if digest.hexdigest() != shard.checksum:
                raise CorruptStep(f"{where}: checksum mismatch")
        return m

    def load(self, step: int) -> tuple[Manifest, dict[str, Buf]]:
        """Each shard by parallel ranged GETs into a buffer the restored array then owns,
        verified (its keyed digest, and its checksum) as it lands (s3fetch)."""
        got = self.read_manifest(step)
        m = got.manifest
        progress = Progress(f"{self.name}: downloading step {step}", m.total_bytes)
        # Several shards at once, the parts in flight shared among them (get_concurrency in
        # all): one shard after another, each one's last parts leave a remote link idle while
        # the next one's first requests travel (a round trip or two per shard).
        lanes = max(1, min(len(m.shards), self.s.get_concurrency // SHARD_PARTS_MIN))
        per_lane = max(1, self.s.get_concurrency // lanes)

        # One refused shard makes the step unusable: the other lanes stop within a chunk.
        stop = threading.Event()

        def one(shard: Shard) -> bytearray:
            data = bytearray(shard.size)
            try:
                fetch(self.s3, self.s.bucket, self._key(step, shard.name), shard.size,
                      shard.checksum, data, part_size=self.s.get_part_size,
                      concurrency=per_lane, progress=progress,
                      where=f"{self.name} step {step}: shard {shard.name}",
                      keyed=got.keyed_for(shard.name), stop=stop)
            except BaseException:
                stop.set()
                raise
            return data
        if lanes == 1:
            return m, {shard.name: one(shard) for shard in m.shards}
        with ThreadPoolExecutor(max_workers=lanes, thread_name_prefix="s3load") as pool:
            futures = [(shard.name, pool.submit(one, shard)) for shard in m.shards]
            wait([f for _, f in futures], return_when=FIRST_EXCEPTION)
            if stop.is_set():
                for _, f in futures:  # not started yet: never started
                    f.cancel()
        # Every lane is done: raise the refusal itself, not a lane it stopped.
        errors = [f.exception() for _, f in futures if not f.cancelled()]
        failed = [e for e in errors if e is not None]
        if failed:
            raise next((e for e in failed if not isinstance(e, Stopped)), failed[0])
        return m, {name: f.result() for name, f in futures}

    def delete(self, step: int) -> None:
        """The index marker first, then the manifest: a step half deleted is never taken for
        a whole one, by the prolog or the job. Every marker of this rank's step goes, whatever
        key made it (one from before a rotation too)."""
        pages = self.s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.s.bucket, Prefix=self.index_base + rank_prefix(step, self.rank))
        for key in [obj["Key"] for page in pages for obj in page.get("Contents", [])]:
            self.s3.delete_object(Bucket=self.s.bucket, Key=key)
        self.s3.delete_object(Bucket=self.s.bucket, Key=self._key(step, MANIFEST))
        pages = self.s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.s.bucket, Prefix=f"{self.base}/{step_dir(step)}/")
        for page in pages:
            for obj in page.get("Contents", []):
                self.s3.delete_object(Bucket=self.s.bucket, Key=obj["Key"])

    def gc_uploads(self, older_than_s: float = 3600.0, now: float | None = None) -> int:
        """Abort multipart uploads that crashed writers left under this rank's keys."""
        now = time.time() if now is None else now
        resp = self.s3.list_multipart_uploads(Bucket=self.s.bucket, Prefix=f"{self.base}/")
        aborted = 0
        for up in resp.get("Uploads", []):
            started = up["Initiated"].timestamp()
            if now - started > older_than_s:
                self.s3.abort_multipart_upload(Bucket=self.s.bucket, Key=up["Key"],
                                               UploadId=up["UploadId"])
                aborted += 1
        return aborted
