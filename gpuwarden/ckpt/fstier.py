"""A checkpoint tier on a filesystem: node memory (/dev/shm), local NVMe, or the shared parallel
filesystem (the FSx tier). Commit is atomic: shards and then the manifest go into a private temp
directory, each fsynced, and one rename makes the step visible; a crash at any point leaves
either the whole step or nothing under its name.

Names from the job are validated before they touch a path; files are created exclusively and
never through links, in a job directory that must be ours alone (shared filesystems are
writable by other users).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Mapping

from gpuwarden.ckpt.codec import Buf, checksum
from gpuwarden.ckpt.manifest import Manifest, ManifestError, Shard, from_json
from gpuwarden.ckpt.names import check_name, parse_step_dir, step_dir
from gpuwarden.errors import GpuwardenError
from gpuwarden.health.store import unsafe_dir_problem

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
_READ = os.O_RDONLY | os.O_NOFOLLOW
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW


class TierError(GpuwardenError):
    """A tier that cannot be used (unsafe directory, I/O error)."""


class TierFull(TierError):
    """Out of space: the step was not committed; the previous ones are intact."""


class CorruptStep(GpuwardenError):
    """A committed step whose bytes do not match its manifest."""


def check_shard(tier: str, step: int, shard: Shard,
                data: Buf) -> None:
    """Every tier's rule: nothing read back is used before size and checksum match."""
    if memoryview(data).nbytes != shard.size or checksum(data) != shard.checksum:
        raise CorruptStep(f"{tier} step {step}: shard {shard.name}: checksum mismatch")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, data: Buf) -> None:
    fd = os.open(path, _CREATE, 0o600)
    try:
        view = memoryview(data).cast("B")
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_spool(tier: str, root: str) -> None:
    """The spool holding every job's directory: a real directory of root's (or ours), and if
    others may write to it, sticky, so that no other user can rename or delete our job's."""
    try:
        st = os.lstat(root)
    except OSError as exc:
        raise TierError(f"{tier}: cannot use {root} ({exc.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise TierError(f"{tier}: {root} is not a directory (a link?): refusing it")
    if st.st_uid not in (0, os.geteuid()):
        raise TierError(f"{tier}: {root} belongs to uid {st.st_uid}, not root: refusing it; "
                        "an admin should recreate it as root, mode 1777")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise TierError(f"{tier}: {root} is writable by others without the sticky bit: "
                        "refusing it; chmod 1777 it")


def _read_file(path: str, limit: int, exact: bool = False) -> bytearray:
    """The whole file, read once into one buffer (restores are read-bound), never through a
    link; at most ``limit`` bytes, or exactly that many when ``exact``."""
    fd = os.open(path, _READ)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptStep(f"{path}: not a regular file")
        if st.st_size > limit or (exact and st.st_size != limit):
            raise CorruptStep(f"{path}: {st.st_size} bytes, the manifest says {limit}")
        buf = bytearray(st.st_size)
        view = memoryview(buf)
        while view:
            n = os.readv(fd, [view])
            if n == 0:
                raise CorruptStep(f"{path}: shorter than the manifest says")
            view = view[n:]
        return buf
    finally:
        os.close(fd)


class FsTier:
    def __init__(self, name: str, root: str, job: str, rank: int = 0) -> None:
        self.name = name
        self.dir = os.path.join(root, check_name(job, "job"), f"rank-{int(rank):05d}")
        self._ready = False

    def ensure_dir(self) -> None:
        """Create (or check) this rank's directory and the job's; idempotent."""
        if self._ready:
            return
        parent = os.path.dirname(self.dir)
        root = os.path.dirname(parent)
        if not os.path.lexists(root):
            # A spool shared by every user's jobs, like /tmp: sticky and world-writable; each
            # job's own directory inside it is private.
            try:
                os.makedirs(root, exist_ok=True)
                fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                try:
                    os.fchmod(fd, 0o1777)  # sticky, like /tmp; job dirs are 0700
                finally:
                    os.close(fd)
            except OSError as exc:
                raise TierError(f"{self.name}: cannot create {root} ({exc.strerror})") from None
        _check_spool(self.name, root)
        for path in (parent, self.dir):
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
            except OSError as exc:
                raise TierError(f"{self.name}: cannot create {path} ({exc.strerror})") from None
            problem = unsafe_dir_problem(path, os.lstat(path))
            if problem:
                raise TierError(f"{self.name}: {problem}: refusing to keep checkpoints there")
        self._ready = True

    def commit(self, manifest: Manifest, data: Mapping[str, Buf]) -> None:
        """Write the step and make it visible at once, or raise and leave nothing behind."""
        self.ensure_dir()
        final = os.path.join(self.dir, step_dir(manifest.step))
        stale = None
        if os.path.lexists(final):
            if self._same(manifest):
                return  # already committed here (a retry after a crash past the rename)
            # A step of the same number from another run (a replica pushed before a requeue):
            # replaced whole, never mixed.
            stale = tempfile.mkdtemp(prefix=f".{step_dir(manifest.step)}.stale.", dir=self.dir)
        tmp = tempfile.mkdtemp(prefix=f".{step_dir(manifest.step)}.", dir=self.dir)
        try:
            for shard in manifest.shards:
                _write_file(os.path.join(tmp, shard.name), data[shard.name])
            _write_file(os.path.join(tmp, MANIFEST), manifest.to_json().encode())
            _fsync_dir(tmp)
            if stale is not None:
                os.rename(final, os.path.join(stale, "old"))
            os.rename(tmp, final)
            _fsync_dir(self.dir)
            if stale is not None:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if stale is not None:
                shutil.rmtree(stale, ignore_errors=True)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                free = shutil.disk_usage(self.dir).free
                raise TierFull(f"{self.name}: out of space writing step {manifest.step} "
                               f"({manifest.total_bytes} bytes, {free} free in {self.dir}); "
                               "the previous steps are intact") from None
            raise TierError(f"{self.name}: cannot write step {manifest.step} "
                            f"({exc.strerror})") from None

    def _same(self, manifest: Manifest) -> bool:
        try:
            held = self.manifest(manifest.step)
        except CorruptStep:
            return False
        return (held.shards, held.world_size, held.rank) == (manifest.shards,
                                                             manifest.world_size, manifest.rank)

    def steps(self) -> list[int]:
        """Committed steps (those whose manifest is in place), oldest first."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            step = parse_step_dir(n)
            if step is None:
                continue
            try:
                st = os.lstat(os.path.join(self.dir, n, MANIFEST))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                out.append(step)
        return sorted(out)

    def manifest(self, step: int) -> Manifest:
        path = os.path.join(self.dir, step_dir(step), MANIFEST)
        try:
            text = _read_file(path, 16 << 20).decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CorruptStep(f"{self.name} step {step}: cannot read the manifest ({exc})") \
                from None
        try:
            return from_json(text, path)
        except ManifestError as exc:
            raise CorruptStep(f"{self.name} step {step}: {exc}") from None

    def load(self, step: int) -> tuple[Manifest, dict[str, Buf]]:
        """Every shard, each checked against the manifest; CorruptStep names the first bad one."""
        m = self.manifest(step)
        out: dict[str, Buf] = {}
        for shard in m.shards:
            path = os.path.join(self.dir, step_dir(step), shard.name)
            try:
                data = _read_file(path, shard.size, exact=True)
            except OSError as exc:
                raise CorruptStep(f"{self.name} step {step}: shard {shard.name}: "
                                  f"{exc.strerror}") from None
            check_shard(self.name, step, shard, data)
            out[shard.name] = data
        return m, out

    def delete(self, step: int) -> None:
        """The manifest goes first, so a step half deleted is never taken for a whole one."""
        path = os.path.join(self.dir, step_dir(step))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, MANIFEST))
        shutil.rmtree(path, ignore_errors=True)

    def gc_temp(self, older_than_s: float = 3600.0, now: float | None = None) -> int:
        """Remove temp directories of commits that crashed; returns how many."""
        now = time.time() if now is None else now
        removed = 0
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return 0
        for n in names:
            p = os.path.join(self.dir, n)
            if n.startswith(".step-") and now - os.lstat(p).st_mtime > older_than_s:
                shutil.rmtree(p, ignore_errors=True)
                removed += 1
        return removed
