"""A checkpoint tier on a filesystem: node memory (/dev/shm), local NVMe, or the shared parallel
filesystem (the FSx tier). Commit is atomic: shards and then the manifest go into a private temp
directory, each fsynced, and one rename makes the step visible; a crash at any point leaves
either the whole step or nothing under its name.

Layout: ``<spool>/<job>/rank-NNNNN/step-NNNNNNNNNNNN/{<shard>..., MANIFEST.json}``; replicas
held for other ranks use the namespace ``<job>.peer``. The spool is root's and sticky, each
job's directory is its user's.

Every use, read or write, opens the job's directory, the rank's and the step's by descriptor
from the spool, never through a link (`safeio`), and checks that each is the job's user's and
writable by that user alone; files are created exclusively, read only when they are regular
files of that user (opened non-blocking: a FIFO is refused, never waited on), and a manifest is
used only for the job, rank and step where it was found. So another user can neither plant a
step nor hand root a link to follow. ``owner`` is the job's user: by default whoever runs this
(the job itself); root's commands pass `ANY_JOB_USER`, which takes the job directory's owner and
then holds everything below to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import mmap
import os
import secrets
import stat
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import xxhash

from gpuwarden.ckpt.codec import Buf, checksum
from gpuwarden.ckpt.manifest import (
    MAX_BYTES,
    Manifest,
    ManifestError,
    Shard,
    check_identity,
    from_json,
)
from gpuwarden.ckpt.names import check_name, job_of, parse_step_dir, step_dir
from gpuwarden.ckpt.tier import MANIFEST, CorruptStep, TierError, TierFull, check_writable
from gpuwarden.core import safefs as safeio
from gpuwarden.core.safefs import Refused, closing

log = logging.getLogger(__name__)

MAX_MANIFEST = MAX_BYTES
REFUSED_PREFIX = ".refused."  # a refused entry moved aside for a new commit: never removed here
ANY_JOB_USER = -1  # root's commands: the job directory's owner is the job's user
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


# What to do about a job directory that is not the job's user's (job ids are sequential, spools
# world-writable: another user can make job-N before job N starts).
_SQUAT_HINT = (": another user made it before this job could (squatting its job id?); an admin "
               "should move it aside (the gpuwarden prolog does so when it may create job "
               "directories as root there; see docs/checkpointing.md, Security)")


def _write_file(dir_fd: int, name: str, data: Buf) -> None:
    fd = os.open(name, _CREATE, 0o600, dir_fd=dir_fd)
    with closing(fd):
        view = memoryview(data).cast("B")
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)


def _with_checksums(manifest: Manifest, sums: list[str]) -> Manifest:
    return dataclasses.replace(manifest, shards=tuple(
        dataclasses.replace(s, checksum=c) for s, c in zip(manifest.shards, sums, strict=True)))


def _write_hashing(dir_fd: int, manifest: Manifest, data: Mapping[str, Buf]) -> Manifest:
    """Write every shard in a second thread while this one hashes them; the manifest with the
    checksums. A write error is raised after both are done (the caller removes the temp dir)."""
    with ThreadPoolExecutor(1, thread_name_prefix="gpuwarden-ckpt-write") as pool:
        writes = [pool.submit(_write_file, dir_fd, s.name, data[s.name]) for s in manifest.shards]
        try:
            sums = [checksum(data[s.name]) for s in manifest.shards]
        finally:
            for w in writes:
                w.exception()  # wait for every write before the caller cleans up
        for w in writes:
            w.result()
    return _with_checksums(manifest, sums)


def _same(held: Manifest, new: Manifest) -> bool:
    """``held`` is ``new`` already committed (a retry), not another save of its step."""
    return ((held.shards, held.world_size, held.rank, held.version)
            == (new.shards, new.world_size, new.rank, new.version))


def _why(exc: BaseException) -> str:
    return exc.strerror or str(exc) if isinstance(exc, OSError) else str(exc)


class Staged:
    """A step half written by `FsTier.stage`: `commit` it or `abort` it, once."""

    def __init__(self, tier: FsTier, fd: int, owner: int, tmp: str, manifest: Manifest) -> None:
        self._tmp: str | None = tmp
        self.tier, self._fd, self._owner = tier, fd, owner
        self.manifest = manifest  # the shards written so far, with their checksums

    def commit(self, shards: Sequence[Shard], data: Mapping[str, Buf]) -> Manifest:
        """Add ``shards`` (checksummed: `codec.encode`) and the manifest, and make the step
        visible; the manifest written. Raises TierError and leaves nothing behind."""
        if self._tmp is None:
            raise TierError(f"{self.tier.name}: step {self.manifest.step} was already "
                            "committed or aborted")
        names = [s.name for s in (*self.manifest.shards, *shards)]
        if len(set(names)) != len(names) or MANIFEST in names:
            self.abort()
            raise TierError(f"{self.tier.name}: step {self.manifest.step}: a shard name is "
                            f"given twice, or is {MANIFEST}")
        lacking = [s.name for s in shards if s.name not in data]
        if lacking:
            self.abort()
            raise TierError(f"{self.tier.name}: step {self.manifest.step}: no bytes for "
                            f"shards {lacking}")
        tmp, self._tmp = self._tmp, None
        try:
            manifest = dataclasses.replace(self.manifest,
                                           shards=(*self.manifest.shards, *shards))
            return self.tier._publish_at(self._fd, self._owner, tmp, manifest,
                                         {s.name: data[s.name] for s in shards})
        finally:
            os.close(self._fd)

    def __del__(self) -> None:
        # A save abandoned half way (another rank's DCP write failed, so no `finish`): its
        # bytes in node memory go as the writer does, not at the end of the job.
        self.abort()

    def abort(self) -> None:
        """Remove what was written; the step stays as it was (absent, or the older copy)."""
        tmp, self._tmp = self._tmp, None
        if tmp is None:
            return
        try:
            with contextlib.suppress(OSError):
                safeio.remove_at(self._fd, tmp)
        finally:
            os.close(self._fd)


class FsTier:
    def __init__(self, name: str, root: str, job: str, rank: int = 0,
                 owner: int | None = None, map_reads: bool = False) -> None:
        self.name = name
        # Node memory (tmpfs): `load(mapped=True)` may map the shards' pages copy-on-write
        # instead of copying them (safeio.map_file). Never on a network filesystem, whose
        # pages another node's unlink could take away under the mapping.
        self.map_reads = map_reads
        self.root = root
        self.namespace = check_name(job, "job")
        self.job = job_of(self.namespace)  # what its manifests must name
        self.rank = int(rank)
        self._rank_dir = f"rank-{self.rank:05d}"
        self.dir = os.path.join(root, self.namespace, self._rank_dir)
        self.owner = os.geteuid() if owner is None else owner

    # ---- the directories -------------------------------------------------------------------
    def _open(self, create: bool) -> tuple[int, int]:
        """This rank's directory (a descriptor) and its owner, every component checked.
        FileNotFoundError when a component is missing and not ``create``; TierError when one
        is unfit."""
        try:
            try:
                spool = safeio.open_spool(self.root)
            except FileNotFoundError:
                if not create:
                    raise
                self._make_spool()
                spool = safeio.open_spool(self.root)
            owner = None if self.owner == ANY_JOB_USER else self.owner
            with closing(spool):
                try:
                    job_fd, st = self._child(spool, self.namespace, owner, create)
                except Refused as exc:
                    held = safeio.lstat_at(spool, self.namespace)
                    if owner is None or held is None or held.st_uid == owner:
                        raise
                    raise Refused(f"{exc}{_SQUAT_HINT}") from None
            owner = st.st_uid if owner is None else owner
            with closing(job_fd):
                rank_fd, _ = self._child(job_fd, self._rank_dir, owner, create)
            return rank_fd, owner
        except Refused as exc:
            raise TierError(f"{self.name}: {exc}: refusing it") from None
        except FileNotFoundError:
            if create:
                raise TierError(f"{self.name}: {self.dir} vanished while being created") from None
            raise
        except OSError as exc:
            raise TierError(f"{self.name}: cannot use {self.dir} ({_why(exc)})") from None

    def _child(self, parent: int, name: str, owner: int | None,
               create: bool) -> tuple[int, os.stat_result]:
        where = self.dir if name == self._rank_dir else os.path.dirname(self.dir)
        try:
            return safeio.open_dir(parent, name, owner, where)
        except FileNotFoundError:
            if not create:
                raise
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent)
        return safeio.open_dir(parent, name, owner, where)

    def _make_spool(self) -> None:
        # A spool shared by every user's jobs, like /tmp: sticky and world-writable; each job's
        # own directory inside it is private. On nodes the prolog makes tier 0's as root.
        os.makedirs(os.path.dirname(self.root), exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.root, 0o700)
        fd = os.open(self.root, safeio.DIR_FLAGS)
        with closing(fd):
            if os.fstat(fd).st_uid == os.geteuid():
                os.fchmod(fd, 0o1777)

    def ensure_dir(self) -> None:
        """Create (or check) this rank's directory and the job's."""
        fd, _ = self._open(create=True)
        os.close(fd)

    # ---- writing ---------------------------------------------------------------------------
    def commit(self, manifest: Manifest, data: Mapping[str, Buf],
               hash_while_writing: bool = False) -> Manifest:
        """Write the step and make it visible at once, or raise and leave nothing behind;
        return the manifest written. ``hash_while_writing``: the shards' checksums are empty
        (`codec.encode(hashed=False)`) and are computed here while another thread writes the
        same bytes (the write releases Python's GIL, the hash does not), so a save costs about
        the longer of the two instead of their sum."""
        held = self._held_same(manifest, data, hash_while_writing)
        if held is not None:
            return held  # already committed (a retry after a crash past the rename)
        return self.stage(manifest, data, hash_while_writing).commit((), {})

    def _held_same(self, manifest: Manifest, data: Mapping[str, Buf],
                   hash_while_writing: bool) -> Manifest | None:
        """The step already committed, when it is this very one (verified, every shard):
        a retry then writes nothing, and needs no room for a second copy."""
        if (manifest.job, manifest.rank) != (self.job, self.rank):
            return None  # `stage` names the mismatch
        try:
            fd, owner = self._open(create=False)
        except (FileNotFoundError, TierError):
            return None
        with closing(fd):
            if safeio.lstat_at(fd, step_dir(manifest.step)) is None:
                return None
            if hash_while_writing:
                manifest = _with_checksums(
                    manifest, [checksum(data[s.name]) for s in manifest.shards])
            try:
                held = self._verify_at(fd, owner, manifest.step)
            except CorruptStep:
                return None  # set aside by the commit
        return held if _same(held, manifest) else None

    def stage(self, manifest: Manifest, data: Mapping[str, Buf],
              hash_while_writing: bool = False) -> Staged:
        """The first half of a commit: ``manifest``'s shards written into a private temp
        directory, nothing visible yet. `Staged.commit` adds the last shards (a value known
        only once the first ones are written: DCP's metadata) and the manifest; until then the
        step is invisible, and a crash leaves only a temp directory (`gc_temp`)."""
        if (manifest.job, manifest.rank) != (self.job, self.rank):
            raise TierError(f"{self.name}: a step of {manifest.job} rank {manifest.rank} does not "
                            f"belong in {self.dir}")
        check_writable(self.name, manifest)
        fd, owner = self._open(create=True)
        tmp = None
        try:
            tmp = self._mkdtemp(fd, f".{step_dir(manifest.step)}.")
            with closing(os.open(tmp, safeio.DIR_FLAGS, dir_fd=fd)) as tfd:
                if hash_while_writing:
                    manifest = _write_hashing(tfd, manifest, data)
                else:
                    for shard in manifest.shards:
                        _write_file(tfd, shard.name, data[shard.name])
        except BaseException as exc:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    safeio.remove_at(fd, tmp)
            err = self._write_error(fd, manifest, exc) if isinstance(exc, OSError) else None
            os.close(fd)
            if err is not None:
                raise err from None
            raise
        return Staged(self, fd, owner, tmp, manifest)

    def _write_error(self, fd: int, manifest: Manifest, exc: OSError) -> TierError:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            vfs = os.fstatvfs(fd)
            inodes = ", no free inodes" if vfs.f_favail == 0 else ""
            return TierFull(f"{self.name}: out of space writing step {manifest.step} "
                            f"({manifest.total_bytes} bytes, {vfs.f_bavail * vfs.f_frsize} "
                            f"free{inodes} in {self.dir}); the previous steps are intact")
        return TierError(f"{self.name}: cannot write step {manifest.step} ({_why(exc)})")

    def _publish_at(self, fd: int, owner: int, staged: str, manifest: Manifest,
                    more: Mapping[str, Buf]) -> Manifest:
        """The second half: the last shards and the manifest into ``staged``, then one
        rename. ``staged`` is gone afterwards, whatever happens."""
        final = step_dir(manifest.step)
        tmp: str | None = staged
        stale = None
        try:
            with closing(os.open(staged, safeio.DIR_FLAGS, dir_fd=fd)) as tfd:
                for name, buf in more.items():
                    _write_file(tfd, name, buf)
                _write_file(tfd, MANIFEST, manifest.to_json().encode())
                os.fsync(tfd)
            if safeio.lstat_at(fd, final) is not None:
                try:
                    # Every shard, not only the manifest: a damaged copy that restore refused
                    # must not pass for "already committed" when the job saves it again.
                    held = self._verify_at(fd, owner, manifest.step)
                except CorruptStep as exc:
                    self._set_aside(fd, final, exc)  # not ours to delete, or an operator's to mend
                else:
                    if _same(held, manifest):
                        return held  # already committed (a retry after a crash past the rename)
                    # A step of the same number from another run (a replica pushed before a
                    # requeue): replaced whole, never mixed.
                    stale = self._mkdtemp(fd, f".{final}.stale.")
            if stale is not None:
                os.rename(final, f"{stale}/old", src_dir_fd=fd, dst_dir_fd=fd)
            os.rename(staged, final, src_dir_fd=fd, dst_dir_fd=fd)
            tmp = None
            os.fsync(fd)
        except OSError as exc:
            raise self._write_error(fd, manifest, exc) from None
        finally:
            for leftover in (tmp, stale):
                if leftover is not None:
                    with contextlib.suppress(OSError):
                        safeio.remove_at(fd, leftover)
        return manifest

    @staticmethod
    def _mkdtemp(fd: int, prefix: str) -> str:
        for _ in range(100):
            name = prefix + secrets.token_hex(6)
            try:
                os.mkdir(name, 0o700, dir_fd=fd)
            except FileExistsError:
                continue
            return name
        raise FileExistsError(errno.EEXIST, f"no free temp name {prefix}*")

    def _set_aside(self, fd: int, final: str, why: CorruptStep) -> None:
        """Rename a refused entry out of the way of a new commit, never deleting it: it may be
        another user's, or damage an operator can still recover. Nothing lists or removes
        ``.refused.*`` (the epilog's removal of a finished job's tier 0 aside)."""
        aside = f"{REFUSED_PREFIX}{final}.{time.time_ns()}.{secrets.token_hex(3)}"
        os.rename(final, aside, src_dir_fd=fd, dst_dir_fd=fd)
        log.warning("%s: %s was refused (%s): moved aside to %s, not deleted", self.name,
                    os.path.join(self.dir, final), why, aside)

    # ---- reading ---------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps (a step directory of the job's user holding that user's regular
        manifest), oldest first; TierError when the job's or rank's directory is unfit."""
        try:
            fd, owner = self._open(create=False)
        except FileNotFoundError:
            return []
        with closing(fd):
            return sorted(s for n in os.listdir(fd)
                          if (s := parse_step_dir(n)) is not None and self._visible(fd, n, owner))

    def _visible(self, fd: int, name: str, owner: int) -> bool:
        where = os.path.join(self.dir, name)
        try:
            sfd, _ = safeio.open_dir(fd, name, owner, where)
        except (Refused, OSError) as exc:
            log.warning("%s: ignoring %s: %s", self.name, where, _why(exc))
            return False
        with closing(sfd):
            st = safeio.lstat_at(sfd, MANIFEST)
        return st is not None and stat.S_ISREG(st.st_mode) and st.st_uid == owner

    def manifest(self, step: int) -> Manifest:
        return self._read(step, shards=False)[0]

    def load(self, step: int, mapped: bool = False) -> tuple[Manifest, dict[str, Buf]]:
        """Every shard, each checked against the manifest; CorruptStep names the first bad one."""
        return self._read(step, shards=True, mapped=mapped and self.map_reads)

    def _read(self, step: int, shards: bool,
              mapped: bool = False) -> tuple[Manifest, dict[str, Buf]]:
        try:
            fd, owner = self._open(create=False)
        except FileNotFoundError:
            raise CorruptStep(f"{self.name} step {step}: {self.dir} is not there") from None
        with closing(fd):
            return self._read_at(fd, owner, step, shards, mapped)

    def _step_dir_at(self, fd: int, owner: int, step: int) -> tuple[int, str]:
        """The step's directory, opened as its owner's (CorruptStep otherwise), and its path."""
        where = os.path.join(self.dir, step_dir(step))
        try:
            sfd, _ = safeio.open_dir(fd, step_dir(step), owner, where)
        except (Refused, OSError) as exc:
            raise CorruptStep(f"{self.name} step {step}: {_why(exc)}") from None
        return sfd, where

    def _read_at(self, fd: int, owner: int, step: int, shards: bool,
                 mapped: bool = False) -> tuple[Manifest, dict[str, Buf]]:
        sfd, where = self._step_dir_at(fd, owner, step)
        with closing(sfd):
            m = self._manifest_at(sfd, owner, step, os.path.join(where, MANIFEST))
            mapped = mapped and safeio.mappable(len(m.shards))
            out: dict[str, Buf] = {}
            for shard in m.shards if shards else ():
                digest = xxhash.xxh3_64()
                try:
                    path = os.path.join(where, shard.name)
                    data: Buf = (safeio.map_file if mapped else safeio.copy_file)(
                        sfd, shard.name, owner, shard.size, path, digest.update)
                except (Refused, OSError) as exc:
                    raise CorruptStep(f"{self.name} step {step}: shard {shard.name}: "
                                      f"{_why(exc)}") from None
                if digest.hexdigest() != shard.checksum:
                    # A mapping is of the bytes just hashed (the same open file), as a
                    # mapping hashed in place would be.
                    if isinstance(data, mmap.mmap):
                        data.close()
                    raise CorruptStep(f"{self.name} step {step}: shard {shard.name}: "
                                      "checksum mismatch")
                out[shard.name] = data
            return m, out

    def verify(self, step: int) -> Manifest:
        """Check the step's manifest and every shard's checksum, streaming: memory stays
        bounded whatever sizes the manifest declares (root's `ckpt verify`). CorruptStep names
        the first bad shard."""
        try:
            fd, owner = self._open(create=False)
        except FileNotFoundError:
            raise CorruptStep(f"{self.name} step {step}: {self.dir} is not there") from None
        with closing(fd):
            return self._verify_at(fd, owner, step)

    def _verify_at(self, fd: int, owner: int, step: int) -> Manifest:
        sfd, where = self._step_dir_at(fd, owner, step)
        with closing(sfd):
            m = self._manifest_at(sfd, owner, step, os.path.join(where, MANIFEST))
            for shard in m.shards:
                digest = xxhash.xxh3_64()
                try:
                    safeio.stream_file(sfd, shard.name, owner, shard.size,
                                       os.path.join(where, shard.name), digest.update)
                except (Refused, OSError) as exc:
                    raise CorruptStep(f"{self.name} step {step}: shard {shard.name}: "
                                      f"{_why(exc)}") from None
                if digest.hexdigest() != shard.checksum:
                    raise CorruptStep(f"{self.name} step {step}: shard {shard.name}: "
                                      "checksum mismatch")
            return m

    def _manifest_at(self, sfd: int, owner: int, step: int, where: str) -> Manifest:
        try:
            raw = bytes(safeio.read_file(sfd, MANIFEST, owner, MAX_MANIFEST, where))
        except (Refused, OSError) as exc:
            raise CorruptStep(f"{self.name} step {step}: cannot read the manifest "
                              f"({_why(exc)})") from None
        try:
            m = from_json(raw, where)
            check_identity(m, self.job, self.rank, step, where)
        except ManifestError as exc:
            raise CorruptStep(f"{self.name} step {step}: {exc}") from None
        return m

    # ---- removing --------------------------------------------------------------------------
    def delete(self, step: int) -> None:
        """The manifest goes first, so a step half deleted is never taken for a whole one.
        Links are removed, never followed."""
        name = step_dir(step)
        try:
            fd, _ = self._open(create=False)
        except FileNotFoundError:
            return
        with closing(fd):
            try:
                st = safeio.lstat_at(fd, name)
                if st is not None and stat.S_ISDIR(st.st_mode):
                    with closing(os.open(name, safeio.DIR_FLAGS, dir_fd=fd)) as sfd, \
                            contextlib.suppress(FileNotFoundError):
                        os.unlink(MANIFEST, dir_fd=sfd)
                safeio.remove_at(fd, name)
            except (OSError, Refused) as exc:
                raise TierError(f"{self.name}: cannot delete step {step} ({_why(exc)})") from None

    def gc_temp(self, older_than_s: float = 3600.0, now: float | None = None) -> int:
        """Remove temp directories of commits that crashed; returns how many. Only the job's
        user's own directories go: anything else under such a name (a link, a file, another
        user's) is not ours to delete, and is logged and left."""
        now = time.time() if now is None else now
        try:
            fd, owner = self._open(create=False)
        except FileNotFoundError:
            return 0
        removed = 0
        with closing(fd):
            for n in os.listdir(fd):
                st = safeio.lstat_at(fd, n) if n.startswith(".step-") else None
                if st is None or now - st.st_mtime <= older_than_s:
                    continue
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != owner:
                    log.warning("%s: leaving %s: not a directory of the job's user (uid %d)",
                                self.name, os.path.join(self.dir, n), owner)
                    continue
                safeio.remove_at(fd, n)
                removed += 1
        return removed
