"""The per-job checkpoint key on sites without a shared filesystem (issue 37; design:
docs/design/object-store-sites.md, section 3).

S3 cannot tell who wrote an object, so every S3 manifest carries a MAC under a key only the
job's user can read. Where there is no shared filesystem to keep a random key in
(`peer.job_key`), the root-run prolog *derives* it on every node of the job:

    job_key(kid) = HMAC-SHA256(site_secret[kid],
                               "gpuwarden-ckpt-job-key\\0v1\\0" cluster \\0 job_id \\0 uid)

from the site secret file (``[ckpt] key_file``, root's, ``0600``, the same on every node, one
``<kid> <64 hex>`` line per key: the first signs, all verify, so a secret can be rotated). The
cluster name, job id and uid do not change across requeues and the user cannot change them, so a
requeued job on other nodes derives the same key and verifies its old S3 steps; another job or
another user's job N (ids reset) derives another.

The prolog writes the job's keys to ``<job_key_dir>/job-N.key`` (tmpfs, never on disk): the
directory root's ``0711`` (users open a file by name; nobody but root can list it, create in it
or plant a link there), the file the job's user's, ``0400``, one ``<kid> <64 hex>`` line per key,
signing key first; an entry already there is replaced (never followed). The epilog removes it
(a requeue onto this node derives it again); ``gpuwarden ckpt tidy`` removes what no epilog saw.
The job reads it with `read_job_keys`, which refuses anything but its own private regular file
of well-formed lines.

Root's files go through gpuwarden.core.safefs (each directory reached from / by descriptor,
nothing followed through a link, owners and modes checked). The prolog and epilog hooks never
raise and run in a child killed at `KEY_S`. Nothing here logs a secret or a key: only key ids
and `fingerprint`s.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from gpuwarden.core import safefs
from gpuwarden.core.errors import GpuwardenError
from gpuwarden.slurm import jobenv

if TYPE_CHECKING:
    from gpuwarden.ckpt.sharedspool import Tidied
    from gpuwarden.config import Config
    from gpuwarden.slurm.models import Job

log = logging.getLogger(__name__)

LABEL = b"gpuwarden-ckpt-job-key\0v1\0"
KEY_BYTES = 32
MAX_KEYS = 8
MAX_JOB_FILE = 1024  # 8 lines of at most 32 + 1 + 64 + 1 bytes
MAX_SITE_FILE = 16 << 10  # room for an admin's comments
DIR_MODE = 0o711
KEY_S = 5.0  # the prolog's and epilog's child is killed after this
LEGACY = ""  # the key id of a shared tier's peer.key: its MACs carry no key id
_KID = r"[A-Za-z0-9_-]{1,32}"
_LINE = re.compile(rf"({_KID}) ([0-9a-f]{{{2 * KEY_BYTES}}})")
# A job's key file, and the temp file of a write that was killed (safefs.write_at's name).
_FILE = re.compile(r"job-([0-9]{1,12})\.key|\.job-([0-9]{1,12})\.key\.[0-9a-f]{12}\.tmp")
KID = re.compile(_KID)


class JobKeyError(GpuwardenError):
    """A site secret or job key file that cannot be used (the message names it and why; never
    its contents)."""


def fingerprint(key: bytes) -> str:
    """8 hex characters that tell keys apart in logs (node A and node B derived the same?)
    and give nothing of the key away."""
    return hashlib.sha256(b"gpuwarden-ckpt-key-fingerprint\0" + key).hexdigest()[:8]


@dataclass(frozen=True)
class JobKeys:
    """A job's keys: ``signing`` (key id, key) MACs what the job writes; ``by_kid`` holds every
    key a MAC may be verified with, the signing one included. Shown only as key ids and
    fingerprints."""

    signing: tuple[str, bytes] = field(repr=False)
    by_kid: Mapping[str, bytes] = field(repr=False)

    def __post_init__(self) -> None:
        if self.by_kid.get(self.signing[0]) != self.signing[1]:
            raise ValueError("the signing key must be one of by_kid")

    @classmethod
    def of(cls, keys: Sequence[tuple[str, bytes]]) -> JobKeys:
        """From (kid, key) pairs, the signing one first (as `derive` and the key file give
        them)."""
        if not keys:
            raise JobKeyError("no keys")
        return cls(keys[0], MappingProxyType(dict(keys)))

    @classmethod
    def shared(cls, key: bytes) -> JobKeys:
        """A shared tier's ``peer.key``: its MACs are plain hex, without a key id."""
        return cls((LEGACY, key), MappingProxyType({LEGACY: key}))

    def with_shared(self, key: bytes) -> JobKeys:
        """These keys, and a shared tier's ``peer.key`` to verify (never sign) the plain-hex
        MACs a job wrote before its site set ``key_file``."""
        return JobKeys(self.signing, MappingProxyType({**self.by_kid, LEGACY: key}))

    def __repr__(self) -> str:
        def shown(kid: str, key: bytes) -> str:
            return f"{kid or 'shared-tier'}:{fingerprint(key)}"
        others = ", ".join(shown(k, v) for k, v in self.by_kid.items() if k != self.signing[0])
        return f"JobKeys(signing={shown(*self.signing)}, verify=[{others}])"

    __str__ = __repr__


# ---- derivation (pure) ------------------------------------------------------------------------
def derive(site_keys: Sequence[tuple[str, bytes]], cluster: str, job_id: str,
           uid: int) -> list[tuple[str, bytes]]:
    """The job's key under each site key, in the site file's order (the first signs)."""
    if not cluster or "\0" in cluster:
        raise JobKeyError("the cluster name must be non-empty, without NUL ([cluster] name)")
    if not jobenv.digits(job_id, jobenv.JOB_ID_DIGITS):
        raise JobKeyError(f"job id {job_id[:20]!r}: expected digits")
    if uid < 0:
        raise JobKeyError(f"uid {uid}: expected >= 0")
    message = LABEL + b"\0".join((cluster.encode(), job_id.encode(), str(uid).encode()))
    return [(kid, hmac.new(secret, message, hashlib.sha256).digest()) for kid, secret in site_keys]


def parse_keys(data: bytes, where: str, comments: bool) -> list[tuple[str, bytes]]:
    """Strictly: ``<kid> <64 lowercase hex>`` lines, each ending in a newline; 1 to `MAX_KEYS`,
    no key id twice, no all-zero key; with ``comments``, also blank and ``#`` lines (the site
    file, which admins edit). JobKeyError naming ``where`` and the line, never its contents."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise JobKeyError(f"{where}: not ASCII text: refused") from None
    if text and not text.endswith("\n"):
        raise JobKeyError(f"{where}: the last line has no newline (truncated?): refused")
    keys: dict[str, bytes] = {}
    for n, line in enumerate(text.split("\n")[:-1], 1):
        if comments and (not line.strip() or line.startswith("#")):
            continue
        m = _LINE.fullmatch(line)
        if m is None:
            raise JobKeyError(f"{where} line {n}: expected '<key id> <{2 * KEY_BYTES} lowercase "
                              "hex digits>' (key id: letters, digits, _ or -, 1-32): refused")
        kid, key = m.group(1), bytes.fromhex(m.group(2))
        if kid in keys:
            raise JobKeyError(f"{where} line {n}: key id {kid} given twice: refused")
        if not any(key):
            raise JobKeyError(f"{where} line {n}: key id {kid} is all zeros: refused")
        keys[kid] = key
    if not keys:
        raise JobKeyError(f"{where}: no keys in it: refused")
    if len(keys) > MAX_KEYS:
        raise JobKeyError(f"{where}: {len(keys)} keys, at most {MAX_KEYS}: retire old ones")
    return list(keys.items())


def format_keys(keys: Iterable[tuple[str, bytes]]) -> bytes:
    return b"".join(f"{kid} {key.hex()}\n".encode() for kid, key in keys)


def file_name(job_id: str) -> str:
    return f"job-{job_id}.key"


# ---- the site secret (root) -------------------------------------------------------------------
def load_site_keys(path: str) -> list[tuple[str, bytes]]:
    """The site's keys, signing first, from ``path``: only when it is a regular file of ours
    (root's), neither readable nor writable by anyone else, in a directory nobody else can
    write, reached without a link; JobKeyError saying what is wrong otherwise."""
    data = read_root_file(path, MAX_SITE_FILE, "site key file ",
                          "it must be root's alone: chown root, chmod 600")
    return parse_keys(data, path, comments=True)


def read_root_file(path: str, limit: int, what: str, fix: str) -> bytes:
    """A secret of root's (the site key file, stage-in's credentials): a regular file of ours,
    neither readable nor writable by anyone else, in a directory nobody else can write,
    reached without a link, at most ``limit`` bytes; JobKeyError starting with ``what``, saying
    what is wrong and ``fix``, never the contents."""
    directory, name = os.path.split(os.path.abspath(path))
    try:
        dfd = safefs.open_trusted_dir(directory)
    except safefs.StateDirError as exc:
        raise JobKeyError(f"{what}{path}: {exc}") from None
    if dfd is None:
        raise JobKeyError(f"{what}{path}: its directory {directory} is missing")
    with safefs.closing(dfd):
        return _read_private(dfd, name, path, os.geteuid(), limit, what, fix)


def _read_private(dfd: int, name: str, path: str, owner: int, limit: int, what: str,
                  fix: str) -> bytes:
    """The regular file ``name`` in ``dfd``, ``owner``'s, mode ``0?00``, at most ``limit``
    bytes; never through a link, never waiting on a FIFO."""
    try:
        fd = os.open(name, safefs.FILE_FLAGS, dir_fd=dfd)
    except FileNotFoundError:
        raise JobKeyError(f"{what}{path} is missing") from None
    except OSError as exc:
        link = exc.errno in (errno.ELOOP, errno.EMLINK)
        why = "a symbolic link (never followed)" if link else f"cannot open ({exc.strerror})"
        raise JobKeyError(f"{what}{path}: {why}: refused") from None
    with safefs.closing(fd):
        st = os.fstat(fd)
        mode = stat.S_IMODE(st.st_mode)
        if not stat.S_ISREG(st.st_mode):
            problem = "not a regular file"
        elif st.st_uid != owner:
            problem = f"belongs to uid {st.st_uid}, not to uid {owner}; {fix}"
        elif mode & 0o077:
            problem = f"readable or writable by group or others (mode {mode:o}); {fix}"
        elif st.st_size > limit:
            problem = f"{st.st_size} bytes, at most {limit}"
        else:
            data = os.read(fd, limit + 1)
            if len(data) <= limit:
                return data
            problem = f"larger than {limit} bytes"
    raise JobKeyError(f"{what}{path}: {problem}: refused")


# ---- the job's key file -----------------------------------------------------------------------
def _key_dir(key_dir: str, create: bool, refusing: str) -> int | None:
    """Root's descriptor of ``key_dir``: ours alone, reached without a link (``create``: made
    ``0711``, or set back to it)."""
    try:
        fd = safefs.open_private_dir(key_dir, refusing, create=DIR_MODE if create else None)
    except safefs.StateDirError as exc:
        raise JobKeyError(str(exc)) from None
    if fd is not None and create and stat.S_IMODE(os.fstat(fd).st_mode) != DIR_MODE:
        try:
            os.fchmod(fd, DIR_MODE)  # 0700: the job cannot reach its key; 0755: lists job ids
        except OSError:
            os.close(fd)
            raise
    return fd


def write_job_keys(key_dir: str, job_id: str, uid: int, gid: int,
                   keys: Sequence[tuple[str, bytes]]) -> str:
    """Root's: ``<key_dir>/job-<job_id>.key`` holding ``keys``, the job user's (``uid``;
    ``gid`` -1: root's group), ``0400``, replacing whatever entry had that name (a link is
    replaced, never followed); its path."""
    if not jobenv.digits(job_id, jobenv.JOB_ID_DIGITS):
        raise JobKeyError(f"job id {job_id[:20]!r}: expected digits")
    data = format_keys(keys)
    parse_keys(data, "the keys to write", comments=False)  # never write what no job can read
    name = file_name(job_id)
    path = os.path.join(key_dir, name)
    dfd = _key_dir(key_dir, create=True, refusing="refusing to write job keys in it")
    if dfd is None:  # made when missing: only a race with its removal gets here
        raise JobKeyError(f"{key_dir}: vanished while being made")
    with safefs.closing(dfd):
        st = safefs.lstat_at(dfd, name)
        if st is not None and stat.S_ISDIR(st.st_mode):
            # Only root can create here: its own leftover. A rename cannot replace it.
            safefs.remove_at(dfd, name, max_entries=1000, deadline_s=KEY_S / 2)
        safefs.write_at(dfd, name, data, mode=0o400)
        try:
            # By name in root's 0711 directory: nobody else can have swapped the entry.
            os.chown(name, uid, gid, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            os.unlink(name, dir_fd=dfd)
            raise
    return path


def read_job_keys(key_dir: str, job_id: str) -> JobKeys:
    """The job's keys, for the job's own processes: ``<key_dir>/job-<job_id>.key`` read only
    when it is a regular file of ours, ``0400``/``0600``, in a directory of root's (or ours)
    nobody else can write, reached without a link; every line well formed. JobKeyError naming
    the file and why otherwise.

    The directory is ``0711`` (no read permission for the job): it is reached with ``O_PATH``
    from its parent, which the one walk of safefs vets."""
    if not jobenv.digits(job_id, jobenv.JOB_ID_DIGITS):
        raise JobKeyError(f"job id {job_id[:20]!r}: expected digits")
    key_dir = os.path.abspath(key_dir)
    path = os.path.join(key_dir, file_name(job_id))
    absent = (f"{path} is missing: the prolog writes it when [ckpt] key_file is set (is it, "
              "and readable by root, on this node? the prolog's log says why not)")
    parent, base = os.path.split(key_dir)
    try:
        pfd = safefs.open_trusted_dir(parent)
    except safefs.StateDirError as exc:
        raise JobKeyError(f"{path}: {exc}") from None
    if pfd is None:
        raise JobKeyError(absent)
    with safefs.closing(pfd):
        try:
            dfd = os.open(base, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=pfd)
        except FileNotFoundError:
            raise JobKeyError(absent) from None
        except OSError as exc:
            raise JobKeyError(f"{key_dir}: not a directory (a link?): refused "
                              f"({exc.strerror})") from None
    with safefs.closing(dfd):
        st = os.fstat(dfd)
        if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
            raise JobKeyError(f"{key_dir}: uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}: "
                              "not a directory only root can write: refused")
        try:
            data = _read_private(dfd, file_name(job_id), path, os.geteuid(), MAX_JOB_FILE, "",
                                 "only the prolog's 0400 file of the job's user is read")
        except JobKeyError as exc:
            if str(exc).startswith(f"{path} is missing"):
                raise JobKeyError(absent) from None
            raise
    return JobKeys.of(parse_keys(data, path, comments=False))


def remove_job_keys(key_dir: str, job_id: str) -> bool:
    """Root's: remove ``<key_dir>/job-<job_id>.key`` (a link itself, never its target); False
    when it (or the directory) was not there."""
    dfd = _key_dir(key_dir, create=False, refusing="refusing to remove job keys from it")
    if dfd is None:
        return False
    with safefs.closing(dfd):
        return safefs.remove_at(dfd, file_name(job_id), max_entries=1000, deadline_s=KEY_S / 2)


# ---- the prolog's and epilog's hooks ----------------------------------------------------------
def _ids(environ: Mapping[str, str]) -> tuple[str, int, int]:
    return jobenv.job_ids(environ, JobKeyError)


def _prolog_child(key_file: str, key_dir: str, cluster: str, job_id: str, uid: int,
                  gid: int) -> dict[str, Any]:
    keys = derive(load_site_keys(key_file), cluster, job_id, uid)
    path = write_job_keys(key_dir, job_id, uid, gid, keys)
    return {"path": path, "kid": keys[0][0], "fp": fingerprint(keys[0][1]), "n": len(keys)}


def for_prolog(config: Config, environ: Mapping[str, str]) -> None:
    """The prolog's hook (root, before the job), when ``[ckpt] key_file`` is set: the job's
    keys derived and written for its user. Never raises (logged), never takes longer than
    about `KEY_S`."""
    cfg = config.ckpt
    if not cfg.key_file:
        return
    from gpuwarden.ckpt import childcall  # noqa: PLC0415 - light, prolog only

    shown = jobenv.job_id(environ, "?")[:20]
    try:
        job_id, uid, gid = _ids(environ)
        cluster = config.cluster.name
        done = childcall.call(lambda: _prolog_child(cfg.key_file, cfg.job_key_dir, cluster,
                                                    job_id, uid, gid), KEY_S)
        # The key id and a fingerprint (never the key): a node whose [cluster] name or site
        # file differs shows another fingerprint for the same job.
        log.info("checkpoint job key: %s written for uid %d (cluster %s, site key id %s signs, "
                 "fingerprint %s; %d key(s))", done["path"], uid, cluster, done["kid"],
                 done["fp"], done["n"])
    except (GpuwardenError, OSError) as exc:
        log.error("checkpoint job key for job %s: %s (its S3 steps cannot be authenticated)",
                  shown, exc)
    except Exception:  # a prolog that raises drains the node: log, never raise
        log.exception("checkpoint job key for job %s: unexpected error", shown)


def for_epilog(config: Config, environ: Mapping[str, str]) -> None:
    """The epilog's hook (root, after the job), when ``[ckpt] key_file`` is set: the job's key
    file removed, always (the job is over on this node; a requeue here derives it again).
    Never raises (logged), never takes longer than about `KEY_S`."""
    cfg = config.ckpt
    if not cfg.key_file:
        return
    from gpuwarden.ckpt import childcall  # noqa: PLC0415 - light, epilog only

    shown = jobenv.job_id(environ, "?")[:20]
    try:
        job_id = _ids(environ)[0]
        if childcall.call(lambda: remove_job_keys(cfg.job_key_dir, job_id), KEY_S):
            log.info("checkpoint job key: removed %s",
                     os.path.join(cfg.job_key_dir, file_name(job_id)))
    except (GpuwardenError, OSError) as exc:
        log.error("checkpoint job key for job %s: cannot remove it: %s", shown, exc)
    except Exception:  # an epilog that raises drains the node: log, never raise
        log.exception("checkpoint job key for job %s: unexpected error", shown)


# ---- what no epilog saw -----------------------------------------------------------------------
def tidy(key_dir: str, jobs: Callable[[], Iterable[Job]]) -> Tidied:
    """Remove this node's key files (and a crashed write's temp files) of jobs Slurm says are
    over, or no longer knows while their id is below the newest it knows: the rule of
    `sharedspool.tidy` (a node that died, a job cancelled while requeued: no epilog ran).
    ``jobs`` is asked once, and only when there is a candidate."""
    from gpuwarden.ckpt.sharedspool import Tidied, finished  # noqa: PLC0415 - tidy only

    out = Tidied()
    dfd = _key_dir(key_dir, create=False, refusing="refusing to tidy it")
    if dfd is None:
        return out
    with safefs.closing(dfd):
        found = sorted((int(m.group(1) or m.group(2)), n) for n in os.listdir(dfd)
                       if (m := _FILE.fullmatch(n)) is not None)
        if not found:
            return out
        known = {j.job_id: j for j in jobs()}
        newest = max(known, default=None)
        for job_id, name in found:
            job = known.get(job_id)
            if job is not None and not finished(job):
                out.kept[name] = f"job {job_id} is {'+'.join(job.state) or 'in no state'}"
                continue
            if job is None and (newest is None or job_id > newest):
                out.kept[name] = f"Slurm does not know job {job_id}: cannot tell it is over"
                continue
            try:
                if safefs.remove_at(dfd, name, max_entries=1000, deadline_s=KEY_S):
                    out.removed.append(name)
            except (GpuwardenError, OSError) as exc:
                out.kept[name] = f"kept: cannot remove it ({exc})"
    return out
