"""The prolog's fast path: let a job start on a node whose stored verdict is fresh and good,
after re-checking what can change between two health checks, within milliseconds.

It imports only builtin modules and four small gpuwarden ones (no click, no TOML, no
dataclasses: each costs about 10 ms per job start; and no json, contextlib or signal, which
bring re, enum, functools and collections: 5-10 ms more). So it reads what the full path leaves
for it in marshal, not JSON (see _load). It decides nothing bad on its own: whenever it cannot
say "fine" it answers why, and the caller runs the full prolog (gpuwarden.hooks.entry.prolog),
which has every check, the drain and the checkpoint stage-in.

The fast path lets the job start when all of these hold (docs/health.md lists them):
* the settings derived from the config by an earlier full prolog are there and the config file
  has not changed since (same inode, size, mtime and ctime), for this node and this gpuwarden;
* the stored verdict is this node's, complete (it checked every GPU and every check: not a
  prolog's verdict on a job's GPUs, not an epilog's with results left for a full check), at
  most ``verdict_max_age_s`` old, and no result in it is CRITICAL or UNKNOWN;
* the job is not a requeued one needing checkpoint stage-in, nor one whose checkpoint key the
  full path derives (`[ckpt] key_file`), and tier 0's spool is already as
  the full prolog leaves it (a root-owned directory, mode 1777);
* the kernel log has no record from the NVIDIA driver since shortly before the verdict (a
  kernel record starting with one of the driver's own prefixes, ``NVRM: ``,
  ``nvidia-nvswitchN: `` ..., fatal or not: the full path judges it);
* with the fake GPU probe, its file has not changed since the verdict;
* every configured mount is mounted and answers (and its canary reads), as in the full checks.
The kernel-log and mount checks run in a child process that gets FAST_ANSWER_S (1 s, or the
per-check deadline when shorter); one that does not answer by then sends the job to the full
path, which runs every check again under the prolog's own deadlines and judges the timeout.
So the worst case is the full prolog's plus 1 s.
"""

from __future__ import annotations

import marshal
import os
import select
import stat
import time

from gpuwarden import __version__
from gpuwarden.core.safefs import StateDirError, open_private_dir, read_private
from gpuwarden.core.stdio import quiet_stdio
from gpuwarden.health import mountprobe
from gpuwarden.slurm import jobenv

TYPE_CHECKING = False  # typing and collections.abc cost milliseconds the fast path has not got
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any

# The same rules as gpuwarden.config.config_path (a test holds them equal): importing that
# module costs tomllib and every config dataclass.
CONFIG_ENV = "GPUWARDEN_CONFIG"
DEFAULT_CONFIG = "/etc/gpuwarden/gpuwarden.toml"
# Where the full prolog leaves the settings the fast path needs: root's, cleared at boot.
RUN_DIR_ENV = "GPUWARDEN_RUN_DIR"
DEFAULT_RUN_DIR = "/run/gpuwarden"
SETTINGS = "prolog-gate.marshal"
FORMAT = 3
# The stored verdict's summary for this path, beside the JSON (gpuwarden.health.store
# FAST_SUMMARY, FAST_FORMAT: a test holds them equal).
VERDICT = "verdict-fast.marshal"
VERDICT_FORMAT = 1
# Kernel records up to a budget plus this much older than the verdict still count as new: the
# verdict's time is taken after its checks, and kmsg's clock drifts from the wall clock.
CLOCK_SLACK_S = 60.0
_TAIL_BYTES = 4 << 20
FAST_ANSWER_S = 1.0
_GOOD = ("OK", "WARNING")
_SIGKILL = 9  # POSIX's number; the signal module would import enum (~1.5 ms)


def config_file(environ: Mapping[str, str]) -> str:
    return environ.get(CONFIG_ENV) or DEFAULT_CONFIG


def run_dir(environ: Mapping[str, str]) -> str:
    return environ.get(RUN_DIR_ENV) or DEFAULT_RUN_DIR


def node_name(environ: Mapping[str, str]) -> str:
    return jobenv.node_name(environ)


def fingerprint(path: str) -> list[int] | None:
    """What changes whenever the file does; None when it is absent (all defaults)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


# ---- the fast path ---------------------------------------------------------------------------
def check(environ: Mapping[str, str], now: float | None = None) -> str:
    """"" when the job may start now; else why the full prolog must run."""
    try:
        return _check(environ, time.time() if now is None else now)
    except (OSError, ValueError, TypeError, KeyError, EOFError, StateDirError) as exc:
        return f"fast path unavailable ({exc.__class__.__name__}: {exc})"


def _check(environ: Mapping[str, str], now: float) -> str:
    node = node_name(environ)
    s = _settings(environ, node)
    if isinstance(s, str):
        return s
    why = _ckpt_work(s, environ)
    if why:
        return why
    v = _verdict(s, node, now)
    if isinstance(v, str):
        return v
    at = float(v["at"])
    if not _spool_ready(str(s["memory_root"])):
        return f"tier 0 spool {s['memory_root']} needs preparing"
    # The fake probe's file as the verdict's checks found it (gpuwarden.health.store
    # FAKE_GPU_FP): any write since, however close to the verdict, is seen.
    if s["gpu_probe"] == "fake" and fingerprint(str(s["fake_gpu_file"])) != v.get("fake_gpu_fp"):
        return "the fake GPU file changed since the verdict"
    since = at - float(s["budget_s"]) - CLOCK_SLACK_S
    # The same moment on the monotonic clock kmsg records are dated by: steps of the wall
    # clock cannot hide a record.
    since_up = float(v["mono"]) - float(s["budget_s"]) - CLOCK_SLACK_S
    # Healthy, these take milliseconds. Slower, the full path runs them again under the real
    # per-check deadline and judges them: waiting longer here would only add to its time.
    deadline = min(FAST_ANSWER_S, float(s["check_deadline_s"]))
    return in_child(lambda: _live_checks(s, node, since, since_up, environ), deadline)


def _ckpt_work(s: Mapping[str, Any], environ: Mapping[str, str]) -> str:
    """The checkpoint work only the full path does for this job, if any."""
    if s["stage_in"] and jobenv.job_restart_count(environ) != "0":
        return "a requeued job: checkpoint stage-in"
    if s["key_file"]:
        return "the job's checkpoint key: the full path derives it from the site secret"
    return ""


def _load(path: str) -> dict[str, Any] | None:
    """The dict root's full path left at ``path`` in marshal; None when absent.

    marshal, not JSON: it is builtin, so reading costs no import. Unmarshalling is unsafe on
    data others control (it can crash the interpreter; it runs no code), so only a file only
    root can have written is read: read_private refuses a file that is not ours alone, in a
    directory that is not ours alone, a link or a FIFO. What it holds is then checked like
    any input (its format, and each value's type where used)."""
    data = read_private(path)
    if data is None:
        return None
    doc = marshal.loads(data)  # noqa: S302 - root's own file, checked above
    if not isinstance(doc, dict):
        raise ValueError(f"{path} does not hold a mapping")
    return doc


def _settings(environ: Mapping[str, str], node: str) -> dict[str, Any] | str:
    s = _load(os.path.join(run_dir(environ), SETTINGS))
    if s is None:
        return "no fast-path settings yet"
    if s.get("format") != FORMAT or s.get("version") != __version__:
        return "fast-path settings from another gpuwarden"
    path = config_file(environ)
    if s.get("node") != node or s.get("config") != path or \
            s.get("fingerprint") != fingerprint(path):
        return f"the config ({path}) or node changed since the settings were made"
    return s


def _summary(s: Mapping[str, Any]) -> dict[str, Any] | str:
    """The stored verdict's summary (gpuwarden.health.store.fast_summary), or why not."""
    v = _load(os.path.join(str(s["state_dir"]), VERDICT))
    if v is None:
        return "no stored verdict (or its summary for the fast path)"
    if v.get("format") != VERDICT_FORMAT:
        return "the stored verdict's summary is from another gpuwarden"
    return v


def _verdict(s: Mapping[str, Any], node: str, now: float) -> dict[str, Any] | str:
    v = _summary(s)
    if isinstance(v, str):
        return v
    if v.get("node") != node:
        return "the stored verdict is not this node's"
    if v.get("complete") is not True:  # gpuwarden.health.store.COMPLETE
        return "the stored verdict did not check every GPU and check (a job's GPUs only, " \
               "or results that need a full check)"
    stale = _stale(v, float(s["verdict_max_age_s"]), now)
    if stale:
        return stale
    results = v.get("results")  # each result's status (gpuwarden.health.store.fast_summary)
    if v.get("status") not in _GOOD or not isinstance(results, list) or \
            any(status not in _GOOD for status in results):
        return "the stored verdict is not OK"
    return v


def _stale(v: Mapping[str, Any], max_age: float, now: float) -> str:
    age = now - float(v["at"])
    if not 0 <= age <= max_age:
        return f"the stored verdict is {age:.0f} s old"
    # The wall clock can be stepped back (chrony, ntpd) and make an old verdict look fresh:
    # it must be fresh by this boot's monotonic clock too.
    mono = v.get("mono")  # gpuwarden.health.store.MONO, BOOT_ID
    if not isinstance(mono, (int, float)) or v.get("boot_id") != _boot_id() or \
            not 0 <= time.monotonic() - mono <= max_age:
        return "the stored verdict is not from this boot's last verdict_max_age_s"
    return ""


def _spool_ready(path: str) -> bool:
    """Already as gpuwarden.ckpt.stagein.prepare_memory_root leaves it (else that runs)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and \
        stat.S_IMODE(st.st_mode) == 0o1777


# ---- what runs under the deadline --------------------------------------------------------------
def _live_checks(s: Mapping[str, Any], node: str, since: float, since_up: float,
                 environ: Mapping[str, str]) -> str:
    why = driver_records_since(str(s["kernel_log"]), since, since_up)
    if why:
        return why
    mounts = s["mounts"]
    points = mountprobe.read_mountinfo_points() if mounts else set()
    for path, canary in mounts:
        try:
            problem = mountprobe.probe(str(path), str(canary), node, points)
        except OSError as exc:
            problem = f"{path}: {exc}"
        if problem:
            return f"mount check: {problem}"
    return job_dirs(s, environ)


# ---- the job's checkpoint directories --------------------------------------------------------
def job_dirs(s: Mapping[str, Any], environ: Mapping[str, str]) -> str:
    """Root makes the job's own checkpoint directories before the job can (job ids are
    sequential and the spools world-writable: gpuwarden.ckpt.jobdirs). Here only the common
    case: each name absent (made, 0700, the job user's) or already the job user's private
    directory. Anything else (a squatter's entry, a link, an odd id) goes the full way, which
    moves it aside and logs it."""
    job, uid, gid = jobenv.valid_job_id(environ), jobenv.job_uid(environ), \
        jobenv.job_gid(environ) or ""
    if not (job and jobenv.digits(uid, jobenv.ID_DIGITS)):
        return "the job's id or user is not plain digits: the full path decides"
    g = int(gid) if jobenv.digits(gid, jobenv.ID_DIGITS) else -1
    wanted = [(str(s["memory_root"]), f"job-{job}"), (str(s["memory_root"]), f"job-{job}.peer")]
    if s.get("shared_root"):
        wanted.append((str(s["shared_root"]), f"job-{job}"))
    for root, name in wanted:
        try:
            why = _own_dir(root, name, int(uid), g)
        except OSError as exc:  # a link (ELOOP), not a directory, the spool missing...
            why = f"{exc.__class__.__name__}: {exc.strerror or exc}"
        if why:
            return f"checkpoint directory {root}/{name}: {why}"
    if s["held_dir"]:
        try:
            _note_held(str(s["held_dir"]), job, int(uid))
        except (OSError, StateDirError) as exc:
            return f"the job's record for the checkpoint scan: {exc}"
    return ""


def _note_held(directory: str, job: str, uid: int) -> None:
    """`ckpt.jobsheld.record` without its imports (json, re, dataclasses; safefs.atomic's
    secrets and contextlib: milliseconds): the same file, byte for byte (a test holds them
    equal), so the periodic check's scan sees the jobs this path started as the full path's.
    Written complete or not at all (a private temp name, then a rename), by the directory's
    descriptor, which the one walk from / reaches (made 0700 when missing)."""
    fd = open_private_dir(directory, "the full path records the job", create=0o700)
    assert fd is not None  # made when missing
    try:
        tmp = f".job-{job}.{os.urandom(6).hex()}.tmp"
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                      dir_fd=fd)
        try:
            os.write(out, f'{{"uid": {uid}, "since": {time.time()!r}}}'.encode())
        finally:
            os.close(out)
        os.rename(tmp, f"job-{job}", src_dir_fd=fd, dst_dir_fd=fd)
    finally:
        os.close(fd)


def _own_dir(root: str, name: str, uid: int, gid: int) -> str:
    spool = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        try:  # noqa: SIM105 - contextlib costs the fast path ~3 ms of imports
            os.mkdir(name, 0o700, dir_fd=spool)
        except FileExistsError:
            pass
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=spool)
        try:
            st = os.fstat(fd)
            if st.st_uid == os.geteuid() and st.st_uid != uid and stat.S_IMODE(st.st_mode) == 0o700:
                os.fchown(fd, uid, gid)  # ours, just made: the job user's now
                st = os.fstat(fd)
            if st.st_uid != uid or st.st_mode & 0o077:
                return f"owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}"
        finally:
            os.close(fd)
    finally:
        os.close(spool)
    return ""


def driver_records_since(path: str, since: float, since_up: float | None = None) -> str:
    """"" unless the kernel log holds a record from the NVIDIA driver at or after ``since``
    (wall clock) or, when given, ``since_up`` (seconds of this boot's monotonic clock, which
    kmsg records are dated by): whichever is earlier, so a step of the wall clock either way
    never hides a record."""
    boot_up = since - _boot_time()
    since_up = boot_up if since_up is None else min(since_up, boot_up)
    if path == "/dev/kmsg":
        return _scan(kmsg_records(), since_up)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return f"{path} is not a regular file"
        if max(st.st_mtime, st.st_ctime) < since:
            return ""  # nothing written to it since the verdict
        f.seek(max(0, st.st_size - _TAIL_BYTES))
        return _scan(f.read().split(b"\n"), since_up)


def kmsg_records(path: str = "/dev/kmsg") -> list[bytes]:
    """Every record the kernel's ring buffer holds, without waiting for more. Shared with the
    full checks (gpuwarden.health.gather), which the fast path cannot afford to import."""
    records: list[bytes] = []
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISCHR(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a character device")
        while True:
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:  # records overwritten while reading: go on
                continue
            if not rec:
                break
            records.append(rec)
    finally:
        os.close(fd)
    return records


def _scan(lines: list[bytes], since_up: float) -> str:
    since_us = since_up * 1e6
    for line in lines:
        head, sep, msg = line.partition(b";")
        fields = head.split(b",")
        if sep and len(fields) >= 3 and fields[0].isdigit() and fields[2].isdigit():
            # A kmsg record: only the kernel's own facility (0), only since the verdict.
            if int(fields[0]) >> 3 == 0 and int(fields[2]) >= since_us and _driver(msg):
                return f"an NVIDIA driver kernel record since the verdict: {_show(msg)}"
        elif b"NVRM" in line or b"SXid" in line:
            # Another rendering (dmesg, syslog): its time cannot be compared cheaply.
            return f"a driver line in the kernel log file: {_show(line)}"
    return ""


# The driver's own record prefixes. Not just "nvidia": a user's crashing nvidia-smi reports
# "nvidia-smi[1234]: segfault ..." and would send every job the full way.
_DRIVER_PREFIXES = (b"NVRM: ", b"nvidia-modeset: ", b"nvidia-uvm: ", b"nvidia-nvlink: ",
                    b"nvidia-drm: ", b"nvidia-peermem: ")
_PCI_CHARS = frozenset(b"0123456789abcdefABCDEF:.")


def _driver(msg: bytes) -> bool:
    if msg.startswith(_DRIVER_PREFIXES):
        return True
    if msg.startswith(b"nvidia-nvswitch"):  # "nvidia-nvswitch3: SXid ..."
        num, sep, _ = msg[15:].partition(b": ")
        return bool(sep) and num.isdigit() and len(num) <= 3
    if msg.startswith(b"nvidia "):  # dev_printk: "nvidia 0000:3b:00.0: ..."
        dev, sep, _ = msg[7:].partition(b": ")
        return bool(sep) and dev.count(b":") == 2 and set(dev) <= _PCI_CHARS
    return False


def _show(text: bytes) -> str:
    return text[:120].decode("utf-8", errors="replace").strip()


def _boot_time() -> float:
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime "):
                return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


def _boot_id() -> str:
    """gpuwarden.health.store.boot_id, without that module's imports."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return f.read(64).decode("ascii", errors="replace").strip()
    except OSError:
        return ""


def in_child(fn: Callable[[], str], deadline_s: float) -> str:
    """``fn()`` (returning a short str) in a forked child; its answer, or why there is none.

    The same rule as gpuwarden.core.deadline (whose Outcome dataclass the fast path cannot
    afford): a child stuck in the kernel is killed and abandoned, never waited for."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child leaves through os._exit
        os.close(r)
        code = 0
        try:
            quiet_stdio()  # an abandoned child must not hold the hook's stdout/stderr
            answer = fn().encode()
        except BaseException as exc:  # everything must reach the parent
            answer = f"check failed: {exc.__class__.__name__}: {exc}".encode()
        try:
            os.write(w, b"=" + answer[:1000])
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], deadline_s)
        data = os.read(r, 2048) if ready else b""
    finally:
        os.close(r)
        if not ready:
            os.kill(pid, _SIGKILL)
        try:  # noqa: SIM105 - as in _own_dir
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    if not ready:
        return f"the kernel-log and mount checks did not answer within {deadline_s:g} s"
    if not data.startswith(b"="):
        return "the kernel-log and mount checks died without an answer"
    return data[1:].decode("utf-8", errors="replace")


# ---- the full path leaves the settings here --------------------------------------------------
def settings_for(config: Any, node: str, environ: Mapping[str, str]) -> dict[str, Any]:
    """What the fast path needs from ``config`` (a gpuwarden.config.Config) on ``node``."""
    h = config.health
    exp = h.expected_for(node)
    path = config_file(environ)
    return {
        "format": FORMAT, "version": __version__, "node": node, "config": path,
        "fingerprint": fingerprint(path), "state_dir": h.state_dir,
        "verdict_max_age_s": h.verdict_max_age_s,
        "check_deadline_s": min(h.check_timeout_s, h.prolog_budget_s),
        "budget_s": max(h.prolog_budget_s, h.epilog_budget_s, h.periodic_budget_s),
        "kernel_log": h.kernel_log, "gpu_probe": h.gpu_probe, "fake_gpu_file": h.fake_gpu_file,
        "mounts": [[m.path, m.canary] for m in exp.mounts],
        "memory_root": config.ckpt.memory_root, "shared_root": config.ckpt.shared_root,
        "stage_in": bool(config.ckpt.stage_in_source()),
        # A site secret: each job's key is derived by the full path (ckpt.jobkey).
        "key_file": config.ckpt.key_file,
        # Where the full path records a job for the checkpoint scan (ckpt.jobsheld), "" where
        # the scan does not run ([health] prom_dir unset: ckpt.jobdirs._note_held).
        "held_dir": os.path.join(h.state_dir, "ckpt-jobs") if h.prom_dir else "",
    }


def remember(environ: Mapping[str, str]) -> str:
    """On the full path: store the settings the next prologs need; "" or why not (the fast
    path then stays off, which costs time, never safety)."""
    # Imported here: the slow path pays for them, the fast one never does.
    from gpuwarden import config as configmod  # noqa: PLC0415
    from gpuwarden.core.errors import GpuwardenError  # noqa: PLC0415
    from gpuwarden.core.safefs import atomic_write, ensure_private_dir  # noqa: PLC0415

    try:
        before = fingerprint(config_file(environ))
        if before is None:  # the full path refuses to run on defaults: so does the fast one
            return f"no config file {config_file(environ)}"
        cfg = configmod.load(config_file(environ) if environ.get(CONFIG_ENV) else None)
        settings = settings_for(cfg, node_name(environ), environ)
        if settings["fingerprint"] != before:
            return "the config changed while it was read"
        directory = run_dir(environ)
        ensure_private_dir(directory)
        atomic_write(directory, SETTINGS, marshal.dumps(settings))
    except (GpuwardenError, OSError) as exc:
        return str(exc)
    return ""
