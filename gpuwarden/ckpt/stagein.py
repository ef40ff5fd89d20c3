"""Prolog stage-in: on a requeued job, copy the newest step every rank holds on the shared tier
(or, on a site without one, in S3) into this node's tier 0, so the job restores from node memory
instead of the parallel filesystem or the object store.

The prolog runs as root, but the shared tier's job directories belong to the user: every read of
them and every write into tier 0 happens in a forked child that has become the job's user, under
a deadline. Root itself only creates (or checks) the tier-0 spool and, for S3, derives the job's
keys and reads the optional credentials file (`stagein_s3`), which the child gets in memory.
Stage-in is an optimisation: whatever goes wrong is skipped, and the job's own restore falls
back to the durable tier; but never unseen. The child's stdio is /dev/null, so what it logs at
WARNING and above, and its plan and result, come back over a pipe (`stagereport`), and the
prolog logs one line per stage-in (`attempt`): at ERROR, which reaches syslog, whenever a
requeued job's ranks were not all staged, with the child's reasons; at INFO otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from gpuwarden.ckpt import childcall
from gpuwarden.ckpt.coord import newest_common
from gpuwarden.ckpt.progress import Progress
from gpuwarden.core.errors import GpuwardenError
from gpuwarden.slurm import jobenv
from gpuwarden.slurm.client import check_node_name
from gpuwarden.slurm.hostlist import HostlistError, expand

if TYPE_CHECKING:
    from gpuwarden.ckpt.jobkey import JobKeys
    from gpuwarden.ckpt.stagecopy import Source
    from gpuwarden.ckpt.stagereport import Channel, Report
    from gpuwarden.config import Config
    from gpuwarden.config.ckpt import CkptConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

_DIGITS = re.compile(r"^[0-9]{1,20}$")
_USER = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}\$?$")
_MAX_ID = 2**32 - 2  # (uid_t)-1 means "unchanged" to setuid
_RANK_DIR = re.compile(r"rank-([0-9]{5,9})")  # as fstier names them; fullmatch
PROGRESS_AFTER_S = 2.0  # a progress line at most this often, none for a quicker copy
_MIB = float(1 << 20)


@dataclass(frozen=True)
class S3Source:
    """Where a site without a shared tier stages from, and with what credentials (boto3.client
    arguments from ``stage_in_s3_env``; empty: boto3's default chain). Never shown."""

    bucket: str
    prefix: str
    endpoint: str
    get_part_mb: int
    get_concurrency: int
    legacy_steps: str = "restore"
    credentials: Mapping[str, str] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class Request:
    """A validated stage-in request for one node of one job."""

    job_id: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    node: str
    nodes: tuple[str, ...]
    memory_root: str
    shared_root: str
    budget_s: float
    source: str = "shared"  # or "s3" (CkptConfig.stage_in_source)
    s3: S3Source | None = None
    # S3's: derived by root before the fork (stagein_s3.with_secrets); in memory only.
    keys: JobKeys | None = field(default=None, repr=False)

    @property
    def job(self) -> str:
        return f"job-{self.job_id}"

    @property
    def origin(self) -> str:
        """Where the step comes from, as the log says it."""
        if self.source == "s3" and self.s3 is not None:
            return f"s3://{self.s3.bucket}/{self.s3.prefix}"
        return self.shared_root

    @property
    def durable(self) -> str:
        return "S3" if self.source == "s3" else "the shared tier"


@dataclass(frozen=True)
class Plan:
    """What a stage-in copies: ``todo`` {rank: bytes} of this node's ``ranks`` at ``step``,
    each read from ``source(rank)``; ``there`` ranks already in tier 0, ``failed`` refused."""

    step: int
    world: int
    ranks: range
    todo: Mapping[int, int]
    source: Callable[[int], Source]
    there: int = 0
    failed: int = 0


@dataclass(frozen=True)
class Outcome:
    """One stage-in, as the prolog logs it (``line`` at ``level``) and counts it: ``outcome``
    "staged", "partial" (some of this node's ranks not staged), "failed", "nothing" (a
    requeued job with nothing to stage), or "" (no stage-in: a first start, or off)."""

    outcome: str
    line: str = ""
    level: int = logging.INFO
    job_id: str = ""
    step: int | None = None
    ranks: str = ""
    said: tuple[str, ...] = ()  # the child's warnings and errors, escaped

    @property
    def coarse(self) -> str:
        """"staged", "failed" or "": did every rank stage (`stage_in`'s answer)."""
        return {"partial": "failed", "nothing": ""}.get(self.outcome, self.outcome)

    def record(self, now: float) -> dict[str, object]:
        """As ``nodemetrics.note_stagein`` keeps the last one."""
        return {"job": self.job_id, "outcome": self.outcome, "at": now, "step": self.step,
                "ranks": self.ranks, "line": self.line, "said": list(self.said)}


@dataclass(frozen=True)
class Selection:
    step: int | None  # newest step every rank holds; None: none
    ranks: range  # this node's ranks (a range: the world size comes from a user's manifest)
    why: str = ""  # non-empty: staging is impossible, and why


class Runner(Protocol):
    """Runs ``work`` as the job's user; its exit code, or None when it did not finish in time."""

    def __call__(self, work: Callable[[], int], req: Request) -> int | None: ...


# ---- pure ------------------------------------------------------------------------------------
def select(steps_by_rank: Mapping[int, Sequence[int]], world_size: int, nodes: Sequence[str],
           node: str) -> Selection:
    """The newest step held by all ``world_size`` ranks, and this node's block of ranks."""
    if node not in nodes:
        return Selection(None, range(0), f"node {node} is not in the job's nodelist")
    n = len(nodes)
    if world_size < 1 or world_size % n:
        why = f"{world_size} ranks do not divide evenly over {n} nodes: which run here is unknown"
        return Selection(None, range(0), why)
    i = nodes.index(node)
    per = world_size // n
    ranks = range(i * per, (i + 1) * per)
    # Checked before ranging over world_size: it comes from a manifest the user wrote.
    if len(steps_by_rank) < world_size:
        return Selection(None, ranks)
    return Selection(newest_common([steps_by_rank.get(r, ()) for r in range(world_size)]),
                     ranks)


def span(ranks: Sequence[int]) -> str:
    """``(2, 3)`` -> ``2-3``; ``(5,)`` -> ``5`` (ranks here are always one contiguous block)."""
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


# ---- the request, from the prolog's environment ------------------------------------------------
class _Malformed(Exception):
    """A variable of the prolog's environment that cannot be trusted; the message names it."""


def _field(name: str, raw: str, pattern: re.Pattern[str], expected: str) -> str:
    """``raw``, the value of the variable ``name``, when it matches ``pattern``."""
    if not pattern.match(raw):
        raise _Malformed(f"{name}={raw[:40]!r} is malformed (expected {expected})")
    return raw


def _id(name: str, raw: str) -> int:
    value = int(_field(name, raw, _DIGITS, "a numeric id"))
    if value > _MAX_ID:
        raise _Malformed(f"{name}={value} is out of range")
    return value


_NSS_S = 5.0


def _nss(fn: Callable[[], T], what: str) -> T:
    """A user database lookup (LDAP, SSSD...) with a deadline that holds: in a forked child
    killed after ``_NSS_S``. A thread cannot be given up on: NSS modules block in C holding
    the GIL (a hung LDAP held a thread's 5 s timeout for 20 s). KeyError: no such entry."""
    try:
        return childcall.call(fn, _NSS_S)  # type: ignore[no-any-return]
    except childcall.ChildTimeout:
        raise _Malformed(f"{what}: the user database did not answer within {_NSS_S:g} s "
                         "(the lookup was killed)") from None
    except childcall.ChildFailed as exc:
        raise _Malformed(f"{what}: the user database lookup failed ({exc})") from None


def _lookup(uid: int, gid: int | None, user: str) -> tuple[str | None, int | None, list[int]]:
    """uid's name and primary group (None: no passwd entry) and the groups of the job's user
    (``user``, else uid's name) with the job's group (``gid``, else the primary). In the child."""
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        pw = None
    gid = gid if gid is not None else (pw.pw_gid if pw else None)
    user = user or (pw.pw_name if pw else "")
    groups = os.getgrouplist(user, gid) if user and gid is not None else []
    return (pw.pw_name if pw else None), (pw.pw_gid if pw else None), groups


def _request(cfg: CkptConfig, environ: Mapping[str, str]) -> Request:
    job = _field(jobenv.JOB_ID, jobenv.job_id(environ), _DIGITS, "digits")
    uid = _id(jobenv.JOB_UID, jobenv.job_uid(environ))
    raw_gid = jobenv.job_gid(environ)
    given_gid = _id(jobenv.JOB_GID, raw_gid) if raw_gid is not None else None
    user = jobenv.job_user(environ)
    if user:
        _field(jobenv.JOB_USER, user, _USER, "a user name")
    # One child, one deadline, for every lookup.
    name, primary, found = _nss(lambda: _lookup(uid, given_gid, user), f"uid {uid}")
    if user and name is not None and name != user:
        raise _Malformed(f"SLURM_JOB_USER={user!r} is not uid {uid}'s name ({name!r})")
    gid = given_gid if given_gid is not None else primary
    if gid is None:
        raise _Malformed(f"SLURM_JOB_GID is not set and uid {uid} has no passwd entry to take "
                         "its primary group from")
    # The user's own groups, as the job will have them; none but the primary without a name.
    groups = tuple(int(g) for g in found) if (user or name) else (int(gid),)
    gid = int(gid)
    node = jobenv.node_name(environ, socket.gethostname)
    try:
        check_node_name(node)
    except GpuwardenError:
        raise _Malformed(f"{jobenv.NODENAME}={node[:40]!r} is malformed (expected a node name)") \
            from None
    raw_nodes = jobenv.job_nodelist(environ)
    try:
        nodes = tuple(expand(raw_nodes))
    except HostlistError:
        nodes = ()
    if not nodes:
        raise _Malformed(f"{jobenv.JOB_NODELIST}={raw_nodes[:40]!r} is malformed (expected a hostlist)")
    source = cfg.stage_in_source()
    s3 = S3Source(cfg.s3_bucket, cfg.s3_prefix, cfg.s3_endpoint, cfg.s3_get_part_mb,
                  cfg.s3_get_concurrency, cfg.s3_legacy_steps) if source == "s3" else None
    return Request(job, uid, gid, groups, node, nodes, cfg.memory_root, cfg.shared_root,
                   cfg.stage_in_budget_s, source, s3)


def parse_request(cfg: CkptConfig, environ: Mapping[str, str]) -> Request | None:
    """A request when stage-in applies and the environment is well-formed; else None (an
    unusable one logged)."""
    got = _parse(cfg, environ)
    if isinstance(got, Outcome):
        if got.outcome:
            log.warning("%s", got.line)
        return None
    return got


def _parse(cfg: CkptConfig, environ: Mapping[str, str]) -> Request | Outcome:
    """The request, or the outcome of a stage-in that cannot start: "" when it does not apply
    (off; a first start, with its line), "failed" when the environment is unusable."""
    source = cfg.stage_in_source()
    if not source:
        return Outcome("")
    raw = jobenv.job_id(environ)
    shown = raw if _DIGITS.match(raw) else "?"
    try:
        restarts = jobenv.job_restart_count(environ)
        if not _DIGITS.match(restarts):
            raise _Malformed(f"{jobenv.JOB_RESTART_COUNT}={restarts[:40]!r} is malformed "
                             "(expected an integer)")
        if int(restarts) == 0:
            # A first start: nothing of this job's is checkpointed anywhere yet.
            return Outcome("", f"stage-in job {shown}: nothing to stage: a first start "
                               f"({jobenv.JOB_RESTART_COUNT}={restarts})", job_id=shown)
        return _request(cfg, environ)
    except _Malformed as exc:
        return _failed(shown, "S3" if source == "s3" else "the shared tier", f"skipped: {exc}")


def _failed(job_id: str, durable: str, why: str) -> Outcome:
    """A requeued job's stage-in that could not start (root's side): ERROR."""
    return Outcome("failed", f"stage-in job {job_id}: NOT staged (the job will read its "
                             f"checkpoint from {durable}): {why}", logging.ERROR, job_id)


# ---- root's part: the tier-0 spool ---------------------------------------------------------------
def prepare_memory_root(path: str, owner: int | None = None) -> str:
    """Create ``path`` (sticky, world-writable, like /tmp) or check it; "" when usable, else why.

    safefs's spool (`ensure_spool`): only the last component is created, reached from / by
    safefs's walk (no user's link on the way, the directories above root's); checks and chmod
    go through one descriptor opened without following links, so a planted link or directory
    is refused, never changed. ``owner`` (tests): whose it must be, checked before any chmod."""
    from gpuwarden.core import safefs  # noqa: PLC0415 - prolog stays light

    owner = os.geteuid() if owner is None else owner
    try:
        # Only ours is created or chmod'ed; anyone else's is opened to say why it is refused.
        fd = safefs.ensure_spool(path) if owner == os.geteuid() else safefs.open_spool(path)
    except safefs.Refused as exc:
        return str(exc)
    except OSError as exc:
        return f"cannot create {path} ({exc.strerror})"
    with safefs.closing(fd):
        st = os.fstat(fd)
        if st.st_uid != owner:
            return f"{path} is owned by uid {st.st_uid}, not {owner}: someone else made it"
    return ""


def run_as(work: Callable[[], int], req: Request) -> int | None:
    """Fork, become the job's user in the child, run ``work`` there; kill it at the budget."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - measured in the child, which leaves through os._exit
        # A copier stuck in a hung filesystem must not hold the hook's stdout/stderr.
        from gpuwarden.core.logsetup import SyslogHandler  # noqa: PLC0415
        from gpuwarden.core.stdio import quiet_stdio  # noqa: PLC0415

        with contextlib.suppress(OSError):
            quiet_stdio()
        # Its errors reach syslog in the prolog's one line for this stage-in (stagereport).
        root = logging.getLogger()
        for h in [h for h in root.handlers if isinstance(h, SyslogHandler)]:
            root.removeHandler(h)
        _child(work, req)
    deadline = time.monotonic() + req.budget_s
    pause = 0.01
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() >= deadline:
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.2)
    except BaseException:
        # The prolog's watchdog (or any error) ends the wait: the copier it started goes too.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        raise
    # A killed commit leaves only its temp directory, which no reader sees as a step.
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    for _ in range(20):
        # Never block: a child stuck in a hung filesystem dies only once the kernel lets go;
        # then init reaps it.
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
        time.sleep(0.05)
    return None


def _child(work: Callable[[], int], req: Request) -> None:  # pragma: no cover - see run_as
    code = 3
    try:
        os.setgroups(list(req.groups))
        os.setgid(req.gid)
        os.setuid(req.uid)
        if os.getuid() != req.uid or os.geteuid() != req.uid or os.getegid() != req.gid:
            raise OSError("privileges were not dropped")
        os.umask(0o077)
        os.chdir("/")
        code = work()
    except BaseException:
        log.exception("stage-in job %s: the copy as uid %d failed", req.job_id, req.uid)
        code = 2
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


# ---- the user's part: read the shared tier, fill tier 0 ------------------------------------------
def _discover(req: Request) -> tuple[int, list[int]] | None:
    """World size from the newest manifest of the lowest rank that has one, and the ranks with a
    directory on the shared tier; None when there is no checkpoint at all."""
    from gpuwarden.ckpt.fstier import FsTier  # noqa: PLC0415
    from gpuwarden.ckpt.tier import CorruptStep  # noqa: PLC0415
    from gpuwarden.core import safefs as safeio  # noqa: PLC0415 - prolog stays light

    try:
        with safeio.closing(safeio.walk(req.shared_root, [req.job], os.geteuid())) as fd:
            names = os.listdir(fd)
    except FileNotFoundError:
        return None
    except (safeio.Refused, OSError) as exc:
        log.warning("stage-in job %s: %s", req.job_id, exc)
        return None
    ranks = sorted(int(m.group(1)) for m in map(_RANK_DIR.fullmatch, names) if m)
    for r in ranks:
        tier = FsTier("shared", req.shared_root, req.job, r)
        for step in reversed(_held(req, r)):
            try:
                return tier.manifest(step).world_size, ranks
            except CorruptStep as exc:
                log.warning("stage-in job %s: %s", req.job_id, exc)
    return None


def _held(req: Request, rank: int) -> list[int]:
    """A rank's steps on the shared tier; none when its directory is unfit (a link...)."""
    from gpuwarden.ckpt.fstier import FsTier  # noqa: PLC0415
    from gpuwarden.ckpt.tier import TierError  # noqa: PLC0415

    try:
        return FsTier("shared", req.shared_root, req.job, rank).steps()
    except TierError as exc:
        log.warning("stage-in job %s: rank %d: %s", req.job_id, rank, exc)
        return []


def _fail(req: Request, rank: int, step: int, exc: Exception) -> None:
    log.warning("stage-in job %s: rank %d step %d not staged (the job will read it from %s): "
                "%s", req.job_id, rank, step, req.durable, exc)


# `stage`'s exit codes when there was nothing to stage, and when some of this node's ranks
# were staged (or already there) and some not (counted apart: metrics); not 3, the child's
# code when its work never ran.
NOTHING = 4
PARTIAL = 5


def stage(req: Request, report: Channel | None = None) -> int:
    """Copy this node's ranks of the newest common step; 0 when all went well, NOTHING when
    there was nothing to do, PARTIAL when some ranks were not staged, else 1 or 2. The plan
    and the copy's result go to ``report`` (the prolog's summary), else to the log."""
    if (os.geteuid(), os.getegid()) != (req.uid, req.gid):
        # Root's privileges must never reach the user's files (see run_as).
        log.error("stage-in job %s: refusing to copy as uid %d gid %d: only as the job's user "
                  "(uid %d gid %d)", req.job_id, os.geteuid(), os.getegid(), req.uid, req.gid)
        return 2
    if req.source == "s3":
        from gpuwarden.ckpt import stagein_s3  # noqa: PLC0415 - boto3 only for S3 sites

        planned = stagein_s3.plan(req)
    else:
        planned = _plan_shared(req)
    if isinstance(planned, int):
        return planned
    if report is not None:
        report.plan(planned.step, planned.ranks, sum(planned.todo.values()))
    return _copy(req, planned, report)


def _plan_shared(req: Request) -> Plan | int:
    from gpuwarden.ckpt.fstier import FsTier  # noqa: PLC0415
    from gpuwarden.ckpt.stagecopy import FsStageSource  # noqa: PLC0415
    from gpuwarden.ckpt.tier import CorruptStep, TierError  # noqa: PLC0415

    found = _discover(req)
    if found is None:
        log.info("stage-in job %s: no checkpoint of %s in %s: nothing to stage", req.job_id,
                 req.job, req.shared_root)
        return NOTHING
    world, present = found
    held = {r: _held(req, r) for r in present if r < world}
    sel = select(held, world, req.nodes, req.node)
    if sel.why:
        log.warning("stage-in job %s: skipped: %s", req.job_id, sel.why)
        return NOTHING
    if sel.step is None:
        log.info("stage-in job %s: no step is held by all %d ranks in %s: nothing to stage",
                 req.job_id, world, req.shared_root)
        return NOTHING
    step, failed, there = sel.step, 0, 0
    todo: dict[int, int] = {}  # rank -> bytes, read from the manifests first for a total
    for r in sel.ranks:
        try:
            if step in FsTier("memory", req.memory_root, req.job, r).steps():
                there += 1
                continue
            todo[r] = FsTier("shared", req.shared_root, req.job, r).manifest(step).total_bytes
        except (CorruptStep, TierError, OSError) as exc:
            _fail(req, r, step, exc)
            failed += 1
    return Plan(step, world, sel.ranks, todo,
                lambda r: FsStageSource(req.shared_root, req.job, r, step), there, failed)


def _copy(req: Request, plan: Plan, report: Channel | None = None) -> int:
    """Each rank of ``plan`` into tier 0, verified; the result to ``report`` (else the summary
    line). 0; PARTIAL if a rank failed and another is in tier 0; 1 if none is."""
    from gpuwarden.ckpt.fstier import FsTier  # noqa: PLC0415
    from gpuwarden.ckpt.stagecopy import Refused, copy_step  # noqa: PLC0415
    from gpuwarden.ckpt.tier import CorruptStep, TierError  # noqa: PLC0415

    step, failed = plan.step, plan.failed
    start = time.monotonic()
    progress = Progress(f"stage-in job {req.job_id}: step {step}", sum(plan.todo.values()),
                        every_s=PROGRESS_AFTER_S)
    copied = 0
    for r in plan.todo:
        try:
            # Into a temp file through bounded buffers, verified on the way: never a whole
            # step in memory (the prolog is outside the job's cgroup).
            copy_step(plan.source(r), FsTier("memory", req.memory_root, req.job, r), plan.world,
                      progress)
            copied += 1
        except (CorruptStep, TierError, Refused, OSError) as exc:
            _fail(req, r, step, exc)
            failed += 1
    took = time.monotonic() - start
    if report is not None:
        report.copied(progress.done, took, plan.there, failed)
    else:
        notes = [f"{n} of {len(plan.ranks)} ranks {what}" for n, what in
                 ((plan.there, "already there"), (failed, "failed, see above")) if n]
        log.info("stage-in job %s: step %d of ranks %s into %s from %s: %.1f MiB in %.2f s%s",
                 req.job_id, step, span(plan.ranks), req.memory_root, req.origin,
                 progress.done / _MIB, took, f" ({'; '.join(notes)})" if notes else "")
    if not failed:
        return 0
    return PARTIAL if copied or plan.there else 1


# ---- the prolog's entry ------------------------------------------------------------------------
def stage_in(cfg: CkptConfig, environ: Mapping[str, str], runner: Runner | None = None,
             cluster: str = "") -> str:
    """`attempt`, answered "staged", "failed" (a rank not staged) or "" (nothing to stage)."""
    return attempt(cfg, environ, runner, cluster).coarse


def attempt(cfg: CkptConfig, environ: Mapping[str, str], runner: Runner | None = None,
            cluster: str = "") -> Outcome:
    """Stage in for the job in ``environ`` if it is a requeued one, and log one line for it
    (marked ``stagein_summary``); never raises on purpose. ``cluster``: ``[cluster] name``,
    which the job's key is derived from (S3 only)."""
    got = _attempt(cfg, environ, runner, cluster)
    if got.line:
        log.log(got.level, "%s", got.line, extra={"stagein_summary": True})
    return got


def _attempt(cfg: CkptConfig, environ: Mapping[str, str], runner: Runner | None,
             cluster: str) -> Outcome:
    req = _parse(cfg, environ)
    if isinstance(req, Outcome):
        return req
    problem = prepare_memory_root(req.memory_root)
    if problem:
        return _failed(req.job_id, req.durable, f"skipped: tier 0: {problem}")
    extra = "ckpt,s3" if req.source == "s3" else "ckpt"
    try:
        # Loaded by root before the fork: the child then needs nothing but the two tiers.
        import gpuwarden.ckpt.stagecopy  # noqa: PLC0415
        if req.source == "s3":
            import gpuwarden.ckpt.stagein_s3  # noqa: F401, PLC0415
    except ImportError as exc:
        return _failed(req.job_id, req.durable, "skipped: the checkpoint extra is not installed "
                       f"({exc}): pip install 'gpuwarden[{extra}]' into the hooks' interpreter")
    if req.source == "s3":
        from gpuwarden.ckpt.stagein_s3 import SetupError, with_secrets  # noqa: PLC0415

        try:
            req = with_secrets(cfg, req, cluster)
        except SetupError as exc:
            return _failed(req.job_id, req.durable, f"skipped: {exc}")
    from gpuwarden.ckpt.stagereport import Channel  # noqa: PLC0415 - light

    final = req
    # Set up before the fork: the child inherits the pipe and the handler that feeds it.
    with Channel(_secrets(final)) as channel:
        code = (runner or run_as)(lambda: _reported(final, channel), final)
        report = channel.collect()
    return summary(final, code, report)


def _reported(req: Request, report: Channel) -> int:
    """The child's work: `stage`, its last word sent whatever happens."""
    try:
        return stage(req, report)
    except Exception:
        log.exception("stage-in job %s: the copy failed", req.job_id)
        return 2
    finally:
        report.finish()


def _secrets(req: Request) -> list[str]:
    """What must never come back in the child's lines: the S3 credentials (not the region)
    and the job's keys."""
    out = [v for k, v in (req.s3.credentials if req.s3 else {}).items() if k != "region_name"]
    if req.keys is not None:
        out += [key.hex() for key in req.keys.by_kid.values()]
    return out


def summary(req: Request, code: int | None, report: Report) -> Outcome:
    """The one line for a stage-in whose child exited with ``code`` (None: killed at the
    budget) and sent ``report``. Pure."""
    from gpuwarden.ckpt.stagereport import LINE_MAX, bounded  # noqa: PLC0415 - light

    prefix = f"stage-in job {req.job_id}: "
    said = tuple(s.removeprefix(prefix) for s in report.said)
    where = f"from {req.origin}"
    step, ranks = None, ""
    if report.plan is not None:
        step, first, final, _ = report.plan
        ranks = span(range(first, final + 1))
        where = f"step {step} of ranks {ranks} into {req.memory_root} {where}"
    did = ""
    if report.copied is not None:
        c = report.copied
        n = report.plan[2] - report.plan[1] + 1 if report.plan else 0
        notes = [f"{k} of {n} ranks {what}" for k, what in
                 ((c.there, "already there"), (c.failed, "failed")) if k]
        did = f": {c.bytes / _MIB:.1f} MiB in {c.seconds:.2f} s" + \
            (f" ({'; '.join(notes)})" if notes else "")
    level = logging.ERROR
    if code == 0:
        outcome, level = "staged", logging.INFO
        line = prefix + where + did if report.plan else f"{prefix}staged into {req.memory_root} " \
            f"{where}"
    elif code == NOTHING:
        outcome, level = "nothing", logging.INFO
        last = report.last.removeprefix(prefix)
        said = tuple(s for s in said if s != last)
        why = last.removesuffix(": nothing to stage") or "(the copy gave no reason)"
        line = f"{prefix}nothing to stage from {req.origin}: {why}"
    elif code == PARTIAL:
        outcome = "partial"
        line = f"{prefix}{where}{did}: NOT every rank staged (the job will read the others " \
               f"from {req.durable})"
    else:
        outcome = "failed"
        if code is None:
            cause = f"not done within stage_in_budget_s = {req.budget_s:g} s: killed it"
        elif code < 0:
            cause = f"the copy was killed by signal {-code}"
        else:
            cause = f"the copy failed (exit {code})"
        head = f"{prefix}{where}{did}: NOT staged" if report.plan else \
            f"{prefix}NOT staged {where}"
        line = f"{head}: {cause} (the job will read its checkpoint from {req.durable})"
    line = bounded(_with_said(line, said, report.cut, LINE_MAX), LINE_MAX)
    return Outcome(outcome, line, level, req.job_id, step, ranks, said)


def _with_said(line: str, said: Sequence[str], cut: bool, limit: int) -> str:
    """``line`` and as many of the child's lines as fit in ``limit`` (syslog's), in order: the
    first is usually the cause. All of them are in the state record (`for_prolog`)."""
    if not said and not cut:
        return line
    line += "; the copy said: "
    shown = 0
    for s in said:
        piece = f"{' | ' if shown else ''}{s}"
        if len(line) + len(piece) > limit - 40:
            break
        line += piece
        shown += 1
    if shown < len(said) or cut:
        line += f" (+{len(said) - shown} more lines" + \
            (", and more cut at the child's bound)" if cut else ")")
    return line


def for_prolog(config: Config, environ: Mapping[str, str]) -> str:
    """The prolog's hook: stage-in must never change the prolog's exit status. What was done,
    for the node metric: "staged", "partial", "failed", "nothing" or "" (no stage-in); a
    requeued job's is also kept in the state directory (`nodemetrics.note_stagein`).

    Every job's prolog also makes sure tier 0's spool exists as root's, mode 1777: a spool
    created by the first user's job would belong to that user, and so would everyone's job
    directories in it (the tiers refuse such a spool).
    """
    try:
        problem = prepare_memory_root(config.ckpt.memory_root)
        if problem:
            log.error("checkpoint tier 0 %s: %s", config.ckpt.memory_root, problem)
            return ""
        got = attempt(config.ckpt, environ, cluster=config.cluster.name)
    except Exception:
        log.exception("stage-in: internal error: skipped")
        return "failed"
    if got.outcome:
        _note(config.health.state_dir, got)
    return got.outcome


def _note(state_dir: str, got: Outcome) -> None:
    """The last stage-in, for `cat` and the e2e tests; logged, never raised."""
    from gpuwarden.ckpt import nodemetrics  # noqa: PLC0415 - light

    try:
        nodemetrics.note_stagein(state_dir, got.record(time.time()))
    except (GpuwardenError, OSError, ValueError) as exc:
        log.error("stage-in job %s: outcome %s not recorded in %s/%s: %s", got.job_id,
                  got.outcome, state_dir, nodemetrics.LAST_STAGEIN, exc)
