"""The node's own health state: verdicts and pass counters in a root-owned directory,
written atomically, plus a node_exporter textfile."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import marshal
import os
import time
from dataclasses import dataclass
from typing import Any, TypeGuard

from gpuwarden.core import metrics
from gpuwarden.core.errors import GpuwardenError

# The files themselves are safefs's (shared with the prolog's fast gate and every other root
# writer); the names are looked up here at each call, so tests can fail a write.
from gpuwarden.core.safefs import (
    StateDirError,
    atomic_write,
    discard,
    ensure_private_dir,
    read_plain,
    read_private,
)
from gpuwarden.health.model import Status, Verdict

log = logging.getLogger(__name__)

# The stored verdict's flag: true only for one that covered every check and GPU (the prolog's
# fast path, gpuwarden.health.fastgate, reads it by this name).
COMPLETE = "complete"
FAKE_GPU_FP = "fake_gpu_fp"  # the fake GPU file as the checks found it (fastgate)
BOOT_ID, MONO = "boot_id", "mono"
# When the verdict's checks started (this boot's monotonic clock; MONO is when they ended):
# which of two verdicts saved side by side is the later look at the node (Store._newer_stored).
STARTED = "started_mono"
_SAVE_LAG_MAX_S = 600.0
# The fast path's own copy of the stored verdict: only the fields it checks, in marshal, which
# it reads without importing json (re, enum...: ~7 ms per job start). Never newer than the JSON
# beside it (see Store.save_verdict); FAST_FORMAT changes whenever its fields do.
FAST_SUMMARY = "verdict-fast.marshal"
FAST_FORMAT = 1
_BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str:
    """This boot's id ("" when the kernel does not say)."""
    try:
        with open(_BOOT_ID_FILE, "rb") as f:
            return f.read(64).decode("ascii", errors="replace").strip()
    except OSError:
        return ""


class StateWriteError(GpuwardenError):
    """A state or metrics file could not be written (full disk, read-only filesystem...)."""


def fast_summary(doc: dict[str, Any]) -> dict[str, Any]:
    """What the prolog's fast path (gpuwarden.health.fastgate) needs of a stored verdict
    document: marshal-able builtins only."""
    return {"format": FAST_FORMAT, "node": doc["node"], COMPLETE: doc[COMPLETE],
            "at": doc["at"], MONO: doc[MONO], BOOT_ID: doc[BOOT_ID], "status": doc["status"],
            "results": [r["status"] for r in doc["results"]],
            FAKE_GPU_FP: doc.get(FAKE_GPU_FP)}


@dataclass(frozen=True)
class Counters:
    passes: int = 0
    last_status: str = ""
    # The exact Slurm reason of the drain health gating made here: only that one it resumes.
    drained_reason: str = ""


def _number(value: object) -> TypeGuard[float]:
    return isinstance(value, float | int) and not isinstance(value, bool)


class Store:
    VERDICT = "verdict.json"
    FAST = FAST_SUMMARY
    LOCK = "verdict.lock"  # held while the verdict and its summary are written
    COUNTERS = "counters.json"
    PROM = "gpuwarden.prom"  # the names are gpuwarden.core.metrics.FILES'
    SELF_PROM = "gpuwarden_self.prom"

    def __init__(self, state_dir: str, prom_dir: str = "") -> None:
        self.dir = state_dir
        self.prom_dir = prom_dir

    def _ready(self) -> None:
        ensure_private_dir(self.dir)

    def save_verdict(self, verdict: Verdict, complete: bool = True,
                     gpus: set[int] | None = None, fake_fp: list[int] | None = None,
                     started_mono: float | None = None) -> bool:
        """The verdict file and the node_exporter textfile, each complete or left as it was;
        one failing does not stop the other. Raises StateWriteError naming what failed.

        ``started_mono`` is when the verdict's checks started (time.monotonic()). Verdicts
        save side by side, in any order: better news from checks that overlapped the stored
        verdict's (or came before them) does not replace it. An epilog or prolog that began
        before a fault and saves after the periodic check's CRITICAL must not put OK back.
        Returns False when so superseded (nothing written).

        ``complete`` is False for a verdict that is not the node's: one that checked only a
        job's ``gpus``, or holds results that still need a full check (the epilog's). It is
        stored marked so (the prolog's fast path and fresh path refuse it) and never reaches
        the textfile, whose node status it would misstate."""
        errors: list[str] = []
        doc = verdict.to_json()
        doc[COMPLETE] = complete
        # Clocks the wall clock's steps do not move (chrony, ntpd): the fast path ages the
        # verdict and dates kernel records by these.
        # MONO is the verdict's own moment: saved up to one run later (never minutes).
        doc[BOOT_ID] = boot_id()
        doc[MONO] = time.monotonic() - min(max(0.0, time.time() - verdict.at), _SAVE_LAG_MAX_S)
        if gpus is not None:
            doc["gpus"] = sorted(gpus)
        if fake_fp is not None:
            doc[FAKE_GPU_FP] = fake_fp
        if started_mono is not None:
            doc[STARTED] = started_mono
        written = True
        try:
            self._ready()
            written = self._write_verdict(doc)
        except StateWriteError as exc:
            errors.append(str(exc))
        except (OSError, StateDirError) as exc:
            errors.append(f"{os.path.join(self.dir, self.VERDICT)}: {exc}")
        if not written:
            return False
        if self.prom_dir and complete:
            try:
                self._write_prom(self.PROM, prometheus(verdict))
            except (OSError, GpuwardenError) as exc:
                errors.append(f"{os.path.join(self.prom_dir, self.PROM)}: {exc}")
        if errors:
            raise StateWriteError("cannot save the verdict: " + "; ".join(errors))
        return True

    def _write_verdict(self, doc: dict[str, Any]) -> bool:
        """The JSON, then the fast path's summary of it. The old summary goes first, so that
        a failure or a kill at any point leaves either no summary or the one of the JSON on
        disk: never one the fast path would trust over a newer (maybe CRITICAL) verdict."""
        # Prologs, epilogs and the periodic check save side by side: one writer at a time, so
        # that one's summary never lands after another's JSON. The old summary goes before the
        # lock is taken, so a save that cannot take it (the lock file a directory, a denied
        # open, the watchdog during the wait) leaves no summary to trust either; removing
        # another writer's summary only sends prologs the full way.
        name = self.FAST
        try:
            discard(self.dir, self.FAST)
            name = self.LOCK
            lock = os.open(os.path.join(self.dir, self.LOCK),
                           os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except (OSError, StateDirError) as exc:
            raise StateWriteError(f"{os.path.join(self.dir, name)}: {exc}") from None
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
            except OSError as exc:
                raise StateWriteError(f"{os.path.join(self.dir, self.LOCK)}: {exc}") from None
            newer = self._newer_stored(doc)
            if newer is not None:
                self._restore_summary(newer)
                return False
            self._write_pair(doc)
            return True
        finally:
            os.close(lock)

    def _newer_stored(self, doc: dict[str, Any]) -> dict[str, Any] | None:
        """The stored document when it must stay instead of ``doc``, else None (then ``doc``
        is written). It stays when it is the later look at the node:
        - better news (OK over CRITICAL, ...) whose checks started before the stored checks
          ended is no later a look than them;
        - equal news whose checks started before the stored checks started, when the stored
          verdict is as complete (a periodic check that drained the node and saves after the
          epilog that ran every check once the job ended must not hide the epilog's why).
        Worse news is always written, and so is news from checks that started after the
        stored ones ended (a repaired node). Anything unreadable, undated, of another boot
        or dated in the future counts as older."""
        ours = doc.get(STARTED)
        if not _number(ours) or not doc[BOOT_ID]:
            return None
        try:
            data = read_private(os.path.join(self.dir, self.VERDICT))
            stored = json.loads(data) if data else None
            if not isinstance(stored, dict):
                return None
            theirs, ours_status = Status[str(stored.get("status"))], Status[str(doc["status"])]
        except (OSError, StateDirError, ValueError, KeyError):
            return None
        theirs_end, theirs_start = stored.get(MONO), stored.get(STARTED)
        if stored.get(BOOT_ID) != doc[BOOT_ID] or not _number(theirs_end) or \
                theirs_end > time.monotonic():
            return None
        if theirs > ours_status and ours < theirs_end:
            why = "worse news from checks that were still running when these started"
        elif theirs == ours_status and _number(theirs_start) and ours < theirs_start <= \
                theirs_end and (stored.get(COMPLETE) is not False or not doc[COMPLETE]):
            why = "the same news from checks that started after these"
        else:
            return None
        log.info("verdict of %s (%s) not stored: %s (%s) is %s", doc.get("context"),
                 doc.get("status"), stored.get("context"), stored.get("status"), why)
        return stored

    def _restore_summary(self, stored: dict[str, Any]) -> None:
        """Put back the fast summary removed before the lock, of the verdict that stays; when
        that fails, prologs only go the full way."""
        with contextlib.suppress(OSError, StateDirError, KeyError, TypeError, ValueError):
            atomic_write(self.dir, self.FAST, marshal.dumps(fast_summary(stored)))

    def _write_pair(self, doc: dict[str, Any]) -> None:
        name = self.FAST
        try:
            discard(self.dir, self.FAST)
            name = self.VERDICT
            atomic_write(self.dir, self.VERDICT, json.dumps(doc, indent=1).encode())
            name = self.FAST
            atomic_write(self.dir, self.FAST, marshal.dumps(fast_summary(doc)))
        except (OSError, StateDirError) as exc:
            # best effort: the error is reported anyway
            with contextlib.suppress(OSError, StateDirError):
                discard(self.dir, self.FAST)
            raise StateWriteError(f"{os.path.join(self.dir, name)}: {exc}") from None

    def _write_prom(self, name: str, text: str) -> None:
        """node_exporter's textfile: root writes it, node_exporter only reads it, so its
        directory (made 0755 if missing) is root's alone, reached without a user's link
        (metrics.write_textfile, with this module's names, which tests can fail)."""
        ensure_private_dir(self.prom_dir, mode=0o755)
        atomic_write(self.prom_dir, name, text.encode(), 0o644)

    def save_self(self, problems: dict[str, str], now: float) -> None:
        """gpuwarden's own health as node_exporter series (see self_prometheus)."""
        if not self.prom_dir:
            return
        last = 0.0 if problems else now
        try:
            if problems:
                last = _last_success(read_plain(os.path.join(self.prom_dir, self.SELF_PROM)))
            self._write_prom(self.SELF_PROM, self_prometheus(problems, last))
        except (OSError, GpuwardenError) as exc:
            raise StateWriteError(f"cannot write {os.path.join(self.prom_dir, self.SELF_PROM)}: "
                                  f"{exc}") from None

    def load_verdict(self) -> Verdict | None:
        """The stored verdict, or None when absent or unreadable (then checks run afresh)."""
        data = read_private(os.path.join(self.dir, self.VERDICT))
        if data is None:
            return None
        try:
            return Verdict.from_json(json.loads(data))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def load_stored(self) -> tuple[Verdict, bool] | None:
        """The stored verdict and whether it is complete (every check, every GPU, nothing left
        for a full check); None when absent or unreadable. Raises StateDirError."""
        data = read_private(os.path.join(self.dir, self.VERDICT))
        if data is None:
            return None
        try:
            doc = json.loads(data)
            return Verdict.from_json(doc), doc.get(COMPLETE) is True
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def load_counters(self) -> Counters:
        data = read_private(os.path.join(self.dir, self.COUNTERS))
        try:
            doc: dict[str, Any] = json.loads(data) if data else {}
            return Counters(int(doc.get("passes", 0)), str(doc.get("last_status", "")),
                            str(doc.get("drained_reason", "")))
        except (ValueError, TypeError, AttributeError):
            return Counters()

    def save_counters(self, counters: Counters) -> None:
        try:
            self._ready()
            atomic_write(self.dir, self.COUNTERS, json.dumps(
                {"passes": counters.passes, "last_status": counters.last_status,
                 "drained_reason": counters.drained_reason}).encode())
        except OSError as exc:
            raise StateWriteError(f"cannot save {os.path.join(self.dir, self.COUNTERS)}: "
                                  f"{exc}") from None


# What gpuwarden's own failures are filed under: a fixed set, so the series stay few.
SELF_REASONS = metrics.SELF_REASONS


def self_prometheus(problems: dict[str, str], last_success: float) -> str:
    """1 per reason gpuwarden itself failed on in its last run (0 otherwise), and when a run
    last ended without any such failure (0: never seen)."""
    return metrics.render(Store.SELF_PROM, {
        metrics.SELF_ERROR: [((r,), 1 if r in problems else 0) for r in SELF_REASONS],
        metrics.LAST_SUCCESS: [((), last_success)],
    }).decode()


def _last_success(text: bytes) -> float:
    return metrics.value_of(text, metrics.LAST_SUCCESS) or 0.0


def prometheus(v: Verdict) -> str:
    """node_exporter textfile: overall status, one gauge per check, and when it ran."""
    return metrics.render(Store.PROM, {
        metrics.HEALTH_STATUS: [((v.node,), v.status.exit_code)],
        metrics.CHECK_STATUS: [((r.check, "" if r.gpu is None else str(r.gpu)),
                                r.status.exit_code) for r in v.results],
        metrics.HEALTH_TIMESTAMP: [((), v.at)],
    }).decode()
