"""Copy one rank's step from the shared tier (or S3) into tier 0, in bounded chunks.

Stage-in runs in the prolog, outside the job's cgroup: a whole step read into memory there
(tens of GiB per rank) would be charged to nobody and could take the node's memory. Each shard
is streamed through one fixed buffer and its checksum computed on the way; the copy becomes
visible only when every shard matched, with the same temp-directory-then-rename commit as
every tier. Sources are opened by directory descriptor, never through a link, and must be
regular files of the user this runs as (the job's user), so a FIFO cannot hang the copy.

From S3 (a site without a shared tier), each shard comes by parallel ranged GETs (`s3fetch`),
at most ``concurrency x s3_get_part_mb`` in memory ahead of the checksum, written with
``pwrite`` into the same temp directory and committed the same way (`_commit_step`); its keyed
digest (`s3mac`: the checksum can be collided by anyone with the bucket's credentials) is
checked as the parts land, before the step can become visible.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import xxhash

from gpuwarden.ckpt.fstier import MAX_MANIFEST, FsTier
from gpuwarden.ckpt.manifest import ALGO, Manifest, ManifestError, Shard, check_identity, from_json
from gpuwarden.ckpt.names import step_dir
from gpuwarden.ckpt.tier import MANIFEST, CorruptStep, TierError, TierFull
from gpuwarden.core import safefs as safeio
from gpuwarden.core.safefs import Refused, closing

if TYPE_CHECKING:
    from gpuwarden.ckpt.s3tier import S3Step, S3Tier

CHUNK = 1 << 20  # the most of a step held in memory at once, besides its manifest
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class FsStageSource:
    """``<shared_root>/<job>/rank-R/step-S`` of the job's user, read by descriptor: a context
    manager holding the step directory's descriptor while the step is copied."""

    def __init__(self, shared_root: str, job: str, rank: int, step: int) -> None:
        self.root, self.job, self.rank, self.step = shared_root, job, rank, step
        self.parts = [job, f"rank-{rank:05d}", step_dir(step)]
        self.shown = os.path.join(shared_root, *self.parts)
        self._fd = -1
        self._buf = bytearray(0)

    def __enter__(self) -> FsStageSource:
        try:
            self._fd = safeio.walk(self.root, self.parts, os.geteuid())
        except FileNotFoundError:
            raise CorruptStep(f"{self.shown}: not there") from None
        self._buf = bytearray(CHUNK)
        return self

    def __exit__(self, *_: object) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def manifest(self, world: int) -> tuple[Manifest, bytes]:
        return _manifest(self._fd, self, world)

    def write_shard(self, out: int, shard: Shard, progress: Callable[[int], None]) -> None:
        _stream(self._fd, shard, out, self._buf, os.path.join(self.shown, shard.name), progress)


StageSource = FsStageSource  # today's name


class S3StageSource:
    """One rank's step in S3, its manifest and shards' keyed digests already authenticated
    (`S3Tier.read_manifest`): each shard by parallel ranged GETs (`s3fetch`) written with
    ``pwrite`` into tier 0's temp file and verified (keyed digest, checksum) as it lands."""

    def __init__(self, tier: S3Tier, step: int, verified: S3Step, *,
                 concurrency: int, deadline: float | None = None) -> None:
        self.tier, self.step, self.verified = tier, step, verified
        self.concurrency, self.deadline = concurrency, deadline
        self.shown = f"s3://{tier.s.bucket}/{tier.base}/{step_dir(step)}"

    def __enter__(self) -> S3StageSource:
        return self

    def __exit__(self, *_: object) -> None:
        pass

    def manifest(self, world: int) -> tuple[Manifest, bytes]:
        m, raw = self.verified.manifest, self.verified.raw
        if m.world_size != world or m.algo != ALGO:
            raise CorruptStep(f"{self.shown}: a step of {m.world_size} ranks in {m.algo}, "
                              f"expected {world} ranks in {ALGO}")
        return m, raw

    def write_shard(self, out: int, shard: Shard, progress: Callable[[int], None]) -> None:
        from gpuwarden.ckpt.s3fetch import fetch  # noqa: PLC0415 - boto3 only for S3 sources

        t = self.tier
        fetch(t.s3, t.s.bucket, f"{t.base}/{step_dir(self.step)}/{shard.name}", shard.size,
              shard.checksum, out, part_size=t.s.get_part_size, concurrency=self.concurrency,
              deadline=self.deadline, progress=progress,
              where=f"{self.shown}: shard {shard.name}",
              keyed=self.verified.keyed_for(shard.name))
        os.fsync(out)


class Source(Protocol):
    """Where `copy_step` reads a rank's step from."""

    step: int
    shown: str

    def __enter__(self) -> Source: ...
    def __exit__(self, *_: object) -> None: ...
    def manifest(self, world: int) -> tuple[Manifest, bytes]: ...
    def write_shard(self, out: int, shard: Shard, progress: Callable[[int], None]) -> None: ...


def _open_file(fd: int, name: str, shown: str) -> tuple[int, os.stat_result]:
    """A regular file of ours, for streaming (safeio.read_file reads whole files)."""
    try:
        src = os.open(name, safeio.FILE_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        raise CorruptStep(f"{shown}: missing") from None
    except OSError as exc:
        raise Refused(f"{shown}: not a regular file (a link?) ({exc.strerror})") from None
    st = os.fstat(src)
    problem = ("not a regular file" if not stat.S_ISREG(st.st_mode)
               else f"belongs to uid {st.st_uid}, not to the job's user (uid {os.geteuid()})"
               if st.st_uid != os.geteuid() else "")
    if problem:
        os.close(src)
        raise Refused(f"{shown}: {problem}: refusing it")
    return src, st


def _manifest(fd: int, src: FsStageSource, world: int) -> tuple[Manifest, bytes]:
    shown = os.path.join(src.shown, MANIFEST)
    try:
        raw = bytes(safeio.read_file(fd, MANIFEST, os.geteuid(), MAX_MANIFEST, shown))
    except FileNotFoundError:
        raise CorruptStep(f"{shown}: missing") from None
    try:
        m = from_json(raw, shown)
        check_identity(m, src.job, src.rank, src.step, shown)
    except ManifestError as exc:
        raise CorruptStep(str(exc)) from None
    if m.world_size != world or m.algo != ALGO:
        raise CorruptStep(f"{shown}: a step of {m.world_size} ranks in {m.algo}, expected "
                          f"{world} ranks in {ALGO}")
    return m, raw


def _stream(fd: int, shard: Shard, out: int, buf: bytearray, shown: str,
            progress: Callable[[int], None]) -> None:
    src, st = _open_file(fd, shard.name, shown)
    with closing(src):
        if st.st_size != shard.size:
            raise CorruptStep(f"{shown}: {st.st_size} bytes, the manifest says {shard.size}")
        digest, left, view = xxhash.xxh3_64(), shard.size, memoryview(buf)
        while left:
            n = os.readv(src, [view[:min(left, len(buf))]])
            if n == 0:
                raise CorruptStep(f"{shown}: shorter than the manifest says")
            digest.update(view[:n])
            done = 0
            while done < n:
                done += os.write(out, view[done:n])
            left -= n
            progress(n)
        if os.read(src, 1):
            raise CorruptStep(f"{shown}: longer than the manifest says")
        if digest.hexdigest() != shard.checksum:
            raise CorruptStep(f"{shown}: checksum mismatch")
        os.fsync(out)


def _write_all(out_dir: int, name: str, data: bytes) -> None:
    with closing(os.open(name, _CREATE, 0o600, dir_fd=out_dir)) as out:
        view = memoryview(data)
        while view:
            view = view[os.write(out, view):]
        os.fsync(out)


def copy_step(src: Source, dst: FsTier, world: int,
              progress: Callable[[int], None] = lambda _n: None) -> Manifest:
    """Copy ``src`` into ``dst`` (the memory tier of the same rank); verified or nothing.

    CorruptStep: the source does not match its manifest; Refused: a source component is a
    link, not ours, or not a regular file or directory; TierError/TierFull: tier 0 cannot
    take it (FetchTimeout, a TierError, from an S3 source out of time)."""
    dst.ensure_dir()
    with src:
        m, raw = src.manifest(world)
        _commit_step(dst, src.step, m, raw,
                     lambda out, shard: src.write_shard(out, shard, progress))
    return m


def _commit_step(dst: FsTier, step: int, m: Manifest, raw: bytes,
                 write_shard: Callable[[int, Shard], None]) -> None:
    """Every shard of ``m`` through ``write_shard(fd, shard)`` into files of a private temp
    directory, then the manifest, byte for byte and last, then one ``rename``: the step is
    whole or not there. A copy killed on the way leaves only the temp directory (`ckpt gc`)."""
    final = step_dir(step)
    try:
        rank_fd = safeio.walk(dst.root, [dst.namespace, os.path.basename(dst.dir)],
                              os.geteuid())
    except (Refused, OSError) as exc:
        raise TierError(f"{dst.name}: {exc}") from None
    with closing(rank_fd):
        tmp = f".{final}.{secrets.token_hex(6)}"
        try:
            os.mkdir(tmp, 0o700, dir_fd=rank_fd)
            with closing(os.open(tmp, safeio.DIR_FLAGS, dir_fd=rank_fd)) as tmp_fd:
                for shard in m.shards:
                    with closing(os.open(shard.name, _CREATE, 0o600, dir_fd=tmp_fd)) as out:
                        write_shard(out, shard)
                _write_all(tmp_fd, MANIFEST, raw)
                os.fsync(tmp_fd)
            # Fails (ENOTEMPTY) if the step appeared meanwhile: never mixed with another.
            os.rename(tmp, final, src_dir_fd=rank_fd, dst_dir_fd=rank_fd)
            tmp = ""
            os.fsync(rank_fd)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFull(f"{dst.name}: out of space staging step {step} "
                               f"({m.total_bytes} bytes)") from None
            raise TierError(f"{dst.name}: cannot stage step {step} ({exc})") from None
        finally:
            if tmp:
                with contextlib.suppress(OSError):
                    safeio.remove_at(rank_fd, tmp)


__all__ = ["CHUNK", "FsStageSource", "Refused", "S3StageSource", "Source", "StageSource",
           "copy_step"]
