"""How long restores took, per tier, as the jobs measured them: the figure the report's
"parallel filesystem vs object store" tradeoff needs, which accounting does not hold.

Each rank that restores a step writes one small record into its job's coordination directory
on the shared tier, ``<shared_root>/job-N/coord/restore-<run>.rank-R`` (`FileCoordinator.record`):
the tier it read, the step, its bytes and the seconds the verified read took (agreement
between ranks left out). A site without a shared tier keeps them in S3 instead
(`S3RecordSink`): the same JSON at ``<prefix>/job-N/coord/restore-<run>.rank-R`` and, since
anyone with the bucket's credentials could write there, its MAC under the job's key beside it
(``.mac``, ``<kid>:<hex>``, as the S3 manifests').
`read_records` is the admin's side: it reads every job's records under a shared root as
untrusted input (directories and files opened by descriptor, never through a link, owned by
the job directory's user, small, strictly parsed) and names each record it skips and why;
`restorelog_s3` reads the S3 ones back (each verified with its MAC under its job's key).
Records are not matched against accounting: a user can file records in job directories of
their own making, so the figures are the jobs' own word (docs/report.md)."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import math
import os
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from gpuwarden.ckpt.jobkey import KID, JobKeys
from gpuwarden.core import safefs as safeio
from gpuwarden.core import safejson
from gpuwarden.core.safefs import Refused, closing

log = logging.getLogger(__name__)

PREFIX = "restore-"
MAX_RECORD = 4096
MAX_ENTRIES = 100_000  # per job's coordination directory: a bigger one is skipped, named
MAX_RECORDS = 1_000_000  # in all: past it the rest are skipped, and the report says so
# Per owner of job directories: one user filing records in directories of their own making
# fills at most this much of MAX_RECORDS, never the whole of it (which would leave every
# other user's restores off the page).
MAX_PER_OWNER = 200_000
_FILE = re.compile(r"restore-r[0-9]{1,9}-s[0-9]{1,9}\.rank-[0-9]{1,9}")
_JOB = re.compile(r"job-[1-9][0-9]{0,11}")  # as Slurm numbers jobs: no leading zeros
# The names both readers take (restorelog_s3 reads S3's by the same rules).
RECORD_NAME, JOB_NAME = _FILE, _JOB
TIERS = ("memory", "peer", "shared", "s3")
_FIELDS = ("bytes", "job", "rank", "run", "seconds", "step", "tier", "at", "saved_at")
# Records written before `saved_at` was (the release that added restore records) lack it.
_FIELDS_V1 = _FIELDS[:-1]


@dataclass(frozen=True)
class RestoreRecord:
    job: str  # job-N
    rank: int
    run: str  # r<restarts>-s<step id>
    step: int
    tier: str
    bytes: int
    seconds: float
    at: float  # when the restore ended (epoch seconds)
    # When the restored step was saved (its manifest's created_at): the failure's lost work is
    # the failed run's end less this. None in a record from before it was written.
    saved_at: float | None = None
    # The uid owning the job directory the record was read from, or (from S3) whose job key
    # its MAC verified under (the reader sets it; not written): the report counts a record
    # for job N only when N's user owns it.
    owner: int | None = None

    @property
    def name(self) -> str:
        return f"{PREFIX}{self.run}.rank-{self.rank}"

    def doc(self) -> dict[str, object]:
        """The record as a rank writes it (`parse` reads it back)."""
        return {f: getattr(self, f) for f in (_FIELDS if self.saved_at is not None
                                              else _FIELDS_V1)}

    @property
    def job_id(self) -> int:
        return int(self.job[len("job-"):])

    @property
    def restarts(self) -> int:
        """SLURM_RESTART_COUNT of the run that restored: 0 for the job's first run."""
        return int(self.run[1:].split("-", 1)[0])


class BadRecord(ValueError):
    """A record that is not what a rank writes."""


def _int(doc: dict[str, object], key: str) -> int:
    v = doc[key]
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 62:
        raise BadRecord(f"{key}: expected a non-negative integer, got {str(v)[:40]!r}")
    return v


def _float(doc: dict[str, object], key: str) -> float:
    v = doc[key]
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
        raise BadRecord(f"{key}: expected a finite number >= 0, got {str(v)[:40]!r}")
    return float(v)


def parse(raw: bytes, job: str, name: str) -> RestoreRecord:
    """A record read from ``job``'s directory under the file name ``name``; BadRecord naming
    the field when it is anything else (a record naming another job, rank or run than its
    place says is refused: a user cannot file a record under someone else's job)."""
    try:
        doc = safejson.loads(raw, max_bytes=MAX_RECORD)
    except safejson.JsonError as exc:
        raise BadRecord(str(exc)) from None
    if not isinstance(doc, dict) or sorted(doc) not in (sorted(_FIELDS), sorted(_FIELDS_V1)):
        raise BadRecord(f"expected exactly the fields {', '.join(sorted(_FIELDS))}")
    tier = doc["tier"]
    if tier not in TIERS:
        raise BadRecord(f"tier: expected one of {', '.join(TIERS)}, got {str(tier)[:40]!r}")
    run = doc["run"]
    if not isinstance(run, str) or not re.fullmatch(r"r[0-9]{1,9}-s[0-9]{1,9}", run):
        raise BadRecord(f"run: expected r<restarts>-s<step id>, got {str(run)[:40]!r}")
    if doc["job"] != job:
        raise BadRecord(f"names job {str(doc['job'])[:40]!r}, but was found in {job}")
    rec = RestoreRecord(job, _int(doc, "rank"), run, _int(doc, "step"),
                        tier, _int(doc, "bytes"), _float(doc, "seconds"), _float(doc, "at"),
                        _float(doc, "saved_at") if "saved_at" in doc else None)
    if rec.name != name:
        raise BadRecord(f"names {rec.name!r}, but was found as {name!r}")
    return rec


# ---- where a rank's record goes ---------------------------------------------------------------
class RecordSink(Protocol):
    """Where restore records are kept: the shared tier's coordination directory
    (`coord.FileCoordinator`) or S3 (`S3RecordSink`)."""

    def record(self, name: str, value: Any) -> None: ...


MAC_SUFFIX = ".mac"
_MAC_LABEL = b"gpuwarden-ckpt-restore-record\0"  # never valid as a manifest's MAC
_MAC = re.compile(rf"(?:({KID.pattern}):)?([0-9a-f]{{64}})")


def record_mac(signing: tuple[str, bytes], raw: bytes) -> bytes:
    """The MAC body of a record's bytes: ``<kid>:<hex>`` (plain hex under a shared tier's key,
    whose key id is empty). Pure."""
    kid, key = signing
    mac = hmac.new(key, _MAC_LABEL + raw, hashlib.sha256).hexdigest()
    return f"{kid}:{mac}".encode() if kid else mac.encode()


def mac_ok(keys: JobKeys, raw: bytes, body: bytes) -> bool:
    """Whether ``body`` is a MAC of ``raw`` under the key it names among ``keys``. Pure."""
    m = _MAC.fullmatch(body.decode("ascii", "replace"))
    if m is None:
        return False
    key = keys.by_kid.get(m.group(1) or "")
    return key is not None and hmac.compare_digest(
        record_mac((m.group(1) or "", key), raw), body)


class S3RecordSink:
    """Records in the job's S3 prefix, each with its MAC, for sites without a shared tier.
    ``s3`` is the S3 tier's client (bounded timeouts and retries); its errors are the
    caller's to log (a record costs the job nothing but a warning)."""

    def __init__(self, s3: Any, bucket: str, prefix: str, job: str, keys: JobKeys) -> None:
        if not _JOB.fullmatch(job):
            raise ValueError(f"{job[:40]!r}: not a job-N name")
        self.s3, self.bucket, self.keys = s3, bucket, keys
        self.base = f"{prefix}/{job}/coord"

    def __repr__(self) -> str:  # never the key
        return f"S3RecordSink(s3://{self.bucket}/{self.base})"

    def record(self, name: str, value: Any) -> None:
        if not _FILE.fullmatch(name):
            raise ValueError(f"{name[:60]!r}: not a restore record's name")
        raw = json.dumps(value, sort_keys=True).encode()
        # The MAC first: a record seen without one is an upload cut short, never trusted.
        self.s3.put_object(Bucket=self.bucket, Key=f"{self.base}/{name}{MAC_SUFFIX}",
                           Body=record_mac(self.keys.signing, raw))
        self.s3.put_object(Bucket=self.bucket, Key=f"{self.base}/{name}", Body=raw)


@dataclass(frozen=True)
class Skipped:
    where: str
    why: str
    records: int = 1  # the record files it stands for (0: directories, not counted in records)
    capped: bool = False  # left out by a cap (MAX_PER_OWNER, MAX_RECORDS), not for what it is


# What one owner's files may put in the log before the rest is only counted: a user filling
# their directories with junk must not bury everyone else's lines.
LINES_PER_OWNER = 20


class Reading:
    """One read's caps: record files opened per owner of job directories (well-formed or not:
    junk costs a user's share as much as records do), records kept in all, log lines per
    owner."""

    def __init__(self, per_owner: int, in_all: int) -> None:
        self.per_owner, self.in_all = per_owner, in_all
        self.opened: dict[int, int] = {}
        self.lines: dict[int, int] = {}
        self.quiet: dict[int, int] = {}  # left out, not listed: past LINES_PER_OWNER
        self.dirs_past: dict[int, int] = {}  # directories not read: the owner's share is used
        self.skipped: list[Skipped] = []

    def room(self, uid: int) -> int:
        return self.per_owner - self.opened.get(uid, 0)

    def left_out(self, uid: int, item: Skipped) -> None:
        if self.lines.get(uid, 0) < LINES_PER_OWNER:
            self.lines[uid] = self.lines.get(uid, 0) + 1
            self.skipped.append(item)
        else:
            self.quiet[uid] = self.quiet.get(uid, 0) + 1

    def summary(self, root: str, dirs_are: str = "job directories") -> None:
        """``dirs_are``: what a job's records are kept in, in words (S3: job prefixes)."""
        for uid, n in sorted(self.quiet.items()):
            self.skipped.append(Skipped(root, f"{n} more records of uid {uid} left out as "
                                              "unreadable or malformed (not listed)", n))
        for uid, dirs in sorted(self.dirs_past.items()):
            self.skipped.append(Skipped(os.path.join(root, "job-*"),
                                        f"{dirs} {dirs_are} of uid {uid} not read: it "
                                        f"has used its share of {self.per_owner} record "
                                        "files", 0, True))


def read_records(shared_root: str, per_owner: int = MAX_PER_OWNER, in_all: int = MAX_RECORDS
                 ) -> tuple[list[RestoreRecord], list[Skipped]]:
    """Every job's restore records under ``shared_root`` (the `[ckpt] shared_root` spool),
    and what was left out with why. Newest jobs first (the highest ids), so the caps leave
    out the oldest: at most ``per_owner`` record files opened per owner of job directories
    (one user cannot push everyone else's records off the page), ``in_all`` records kept. A
    missing root is an error (the caller names the option); an unfit one (a link, another
    user's) is Refused."""
    records: list[RestoreRecord] = []
    r = Reading(per_owner, in_all)
    spool = safeio.open_spool(shared_root)
    with closing(spool):
        jobs = sorted((n for n in os.listdir(spool) if _JOB.fullmatch(n)),
                      key=lambda n: int(n[len("job-"):]), reverse=True)
        for i, job in enumerate(jobs):
            where = os.path.join(shared_root, job, "coord")
            if len(records) >= in_all:
                r.skipped.append(Skipped(os.path.join(shared_root, "job-*"),
                                         f"{len(jobs) - i} older job directories not read: "
                                         f"{in_all} records kept in all", 0, True))
                break
            try:
                recs = _job_records(spool, job, where, r)
            except (OSError, Refused) as exc:
                if not isinstance(exc, FileNotFoundError):
                    r.skipped.append(Skipped(where, str(exc), 0))
                continue
            room = in_all - len(records)
            records.extend(recs[:room])
            if len(recs) > room:
                r.skipped.append(Skipped(where, f"{len(recs) - room} records not counted: "
                                                f"{in_all} records kept in all",
                                         len(recs) - room, True))
    r.summary(shared_root)
    return records, r.skipped


def _job_records(spool: int, job: str, where: str, r: Reading) -> list[RestoreRecord]:
    job_fd, st = safeio.open_dir(spool, job, None, os.path.dirname(where))
    uid = st.st_uid
    with closing(job_fd):
        if r.room(uid) <= 0:
            r.dirs_past[uid] = r.dirs_past.get(uid, 0) + 1
            return []
        coord, _ = safeio.open_dir(job_fd, "coord", uid, where)
    out: list[RestoreRecord] = []
    with closing(coord):
        names = []
        with os.scandir(coord) as it:  # stops at the cap: a huge directory is not listed whole
            for entry in it:
                names.append(entry.name)
                if len(names) > MAX_ENTRIES:
                    raise Refused(f"more than {MAX_ENTRIES} entries: not read")
        wanted = sorted(n for n in names if n.startswith(PREFIX) and _FILE.fullmatch(n))
        for i, name in enumerate(wanted):
            if r.room(uid) <= 0:
                r.skipped.append(Skipped(where, f"{len(wanted) - i} record files not read: uid "
                                                f"{uid} has used its share of {r.per_owner}",
                                         len(wanted) - i, True))
                break
            r.opened[uid] = r.opened.get(uid, 0) + 1
            path = os.path.join(where, name)
            try:
                raw = safeio.read_file(coord, name, uid, MAX_RECORD, path)
                out.append(dataclasses.replace(parse(bytes(raw), job, name), owner=uid))
            except (OSError, Refused, BadRecord) as exc:
                r.left_out(uid, Skipped(path, str(exc)))
            except Exception as exc:  # one user's file must never stop the report
                r.left_out(uid, Skipped(path, f"{type(exc).__name__}: {str(exc)[:80]}"))
    return out


@dataclass(frozen=True)
class TierRestores:
    tier: str
    restores: int  # job restores: one per job and run, whatever its ranks
    median_s: float
    p90_s: float
    median_gib_s: float | None  # None: the restores read no bytes


def job_restores(records: Iterable[RestoreRecord]) -> list[RestoreRecord]:
    """One record per job restore (job and run): its slowest rank's, which the job waited
    for, with the job's bytes summed, ending when the last rank's did. Pure."""
    by: dict[tuple[str, str], list[RestoreRecord]] = {}
    for r in records:
        by.setdefault((r.job, r.run), []).append(r)
    out = []
    for rs in by.values():
        slow = max(rs, key=lambda r: (r.seconds, r.rank))
        saved = [r.saved_at for r in rs if r.saved_at is not None]
        out.append(dataclasses.replace(slow, bytes=sum(r.bytes for r in rs),
                                       at=max(r.at for r in rs),
                                       saved_at=max(saved) if saved else None))
    return out


def per_tier(records: Iterable[RestoreRecord]) -> list[TierRestores]:
    """Each tier's job restores (`job_restores`: a job is counted under the tier its slowest
    rank read): how many, the median and 90th percentile of their seconds, and the median
    read speed. Pure."""
    by: dict[str, list[RestoreRecord]] = {}
    for r in job_restores(records):
        by.setdefault(r.tier, []).append(r)
    out = []
    for tier in TIERS:
        rs = by.get(tier)
        if not rs:
            continue
        secs = sorted(r.seconds for r in rs)
        speeds = [r.bytes / r.seconds / (1 << 30) for r in rs if r.seconds > 0 and r.bytes > 0]
        p90 = secs[min(len(secs) - 1, math.ceil(0.9 * len(secs)) - 1)]
        out.append(TierRestores(tier, len(rs), statistics.median(secs), p90,
                                statistics.median(speeds) if speeds else None))
    return out
