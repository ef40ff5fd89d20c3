"""Restore records kept in S3 (`restorelog.S3RecordSink`, on a site without a shared
filesystem), read back for `gpuwarden report` as untrusted input.

Every job's nodes hold the bucket's credentials, so anyone can write under any job's prefix:
a record counts only when its MAC (``<name>.mac``, written before it) verifies under the key
of the job it is filed under, derived from the site secret (`jobkey.derive`) for a user
accounting names for that job; the record must then name that job, its rank and run as its
key does (`restorelog.parse`). A job whose user is unknown, a record without a MAC, with a bad
one, malformed or too big is left out and named (`restorelog.Skipped`), never trusted.

The report reads in two passes around its accounting read, which says whose the jobs are:
1. `list_jobs`: one paginated LIST of ``<prefix>/`` with the delimiter ``/``: one name per job,
   never the steps' objects under it (S3 cannot list ``job-*/coord/`` across jobs in one call);
2. `read_records`: for each listed job accounting names a user of, newest first, one LIST of
   ``<prefix>/job-N/coord/`` and two ranged GETs per record (its MAC, then the record, each at
   most its size limit: an object larger than its LIST said is never read whole), a few jobs
   and records at once (`WORKERS`), under `restorelog.read_records`' caps: record files per
   user, records in all, entries per job. The users take turns, the one who has spent least
   of the read's time first: one user's objects cost only that user's share. Each call has
   the client's timeouts, the whole read a deadline: what it did not reach is named, and the
   report goes on.

Only the job's user can make a record count (the key is theirs); anyone with the bucket's
credentials can plant junk under a job's prefix, which costs that job's user's share of record
files read, as junk in their own directories does on a shared tier (docs/report.md).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpuwarden.ckpt import jobkey
from gpuwarden.ckpt.restorelog import (
    JOB_NAME,
    MAC_SUFFIX,
    MAX_ENTRIES,
    MAX_PER_OWNER,
    MAX_RECORD,
    MAX_RECORDS,
    RECORD_NAME,
    BadRecord,
    Reading,
    RestoreRecord,
    Skipped,
    mac_ok,
    parse,
)
from gpuwarden.core.errors import GpuwardenError

log = logging.getLogger(__name__)

MAX_MAC = 128  # "<kid>:<64 hex>", a key id at most 32: 97 bytes
MAX_JOBS = 1_000_000  # job prefixes listed: past it the listing stops, and says so
WORKERS = 8  # S3 calls at once
LIST_S = 120.0  # the jobs' listing, before the accounting read
READ_S = 300.0  # the records, after it
# The report's client: S3's own limits are generous for a job's gigabytes; a page is small.
CONNECT_S, CALL_S, RETRIES = 5.0, 20.0, 3

class S3ReadError(GpuwardenError):
    """The bucket cannot be listed (the message says what to check)."""


@dataclasses.dataclass(frozen=True)
class Place:
    """Where a site's S3 records are: ``s3://<bucket>/<prefix>/job-N/coord/``."""

    bucket: str
    prefix: str
    endpoint: str = ""  # empty: AWS

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def client(place: Place) -> Any:
    """A boto3 client with the S3 tier's bounded timeouts and retries (`s3tier.client`),
    tighter than a job's: these are small objects. Needs the ``s3`` extra
    (ModuleNotFoundError)."""
    from gpuwarden.ckpt.s3tier import S3Settings  # noqa: PLC0415 - boto3 only when used
    from gpuwarden.ckpt.s3tier import client as s3_client  # noqa: PLC0415

    return s3_client(S3Settings(place.bucket, place.prefix, place.endpoint or None,
                                connect_timeout_s=CONNECT_S, read_timeout_s=CALL_S,
                                retries=RETRIES, concurrency=WORKERS))


def advice(exc: BaseException) -> str:
    """What a failed S3 call says, and what to check."""
    from botocore import exceptions as bx  # noqa: PLC0415 - the s3 extra's

    if isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError)):
        return ("no S3 credentials here: give this host boto3's (an instance role, AWS_* "
                "variables or ~/.aws/credentials) with s3:ListBucket and s3:GetObject on the "
                "bucket")
    if isinstance(exc, (bx.EndpointConnectionError, bx.ConnectTimeoutError,
                        bx.ReadTimeoutError)):
        return f"{exc}: check [ckpt] s3_endpoint and that this host reaches it"
    if isinstance(exc, bx.ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code == "NoSuchBucket":
            return f"{exc}: check [ckpt] s3_bucket"
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                    "ExpiredToken", "InvalidToken", "403"):
            return (f"{exc}: the credentials here are refused; they need s3:ListBucket and "
                    "s3:GetObject on the bucket")
    return str(exc)[:300]


def _s3_errors() -> tuple[type[BaseException], ...]:
    from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415

    return (BotoCoreError, ClientError)


def list_jobs(s3: Any, place: Place, deadline: float, max_jobs: int = MAX_JOBS
              ) -> tuple[list[str], list[Skipped]]:
    """Every job with a prefix in the bucket (``job-N``), newest first (the highest ids), from
    one paginated LIST with the delimiter ``/``; and what cut the listing short, if anything
    (``deadline``: time.monotonic()'s). S3ReadError saying what to check when it cannot list."""
    base = f"{place.prefix}/"
    names: list[str] = []
    cut: Skipped | None = None
    try:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=place.bucket, Prefix=base,
                                                            Delimiter="/")
        for page in pages:
            for common in page.get("CommonPrefixes", ()):
                name = str(common.get("Prefix", ""))[len(base):].removesuffix("/")
                if JOB_NAME.fullmatch(name):
                    names.append(name)
            # S3 lists in name order, not by job id: a cut listing misses newer jobs too.
            why = (f"{max_jobs} job prefixes listed" if len(names) >= max_jobs
                   else "the listing's deadline passed" if time.monotonic() > deadline
                   else "")
            if why:
                cut = Skipped(f"{place}/job-*", f"listing stopped after {len(names)} jobs "
                              f"({why}): the jobs named after them not read", 0, True)
                break
    except _s3_errors() as exc:
        raise S3ReadError(f"cannot list s3://{place.bucket}/{base}: {advice(exc)}") from None
    names.sort(key=lambda n: int(n[len("job-"):]), reverse=True)
    return names, [cut] if cut else []


Owners = Sequence[int] | str  # a job's users' uids, or why there are none


def read_records(s3: Any, place: Place, jobs: Sequence[str], owners: Mapping[int, Owners],
                 site: Sequence[tuple[str, bytes]], cluster: str, deadline: float,
                 per_owner: int = MAX_PER_OWNER, in_all: int = MAX_RECORDS,
                 workers: int = WORKERS) -> tuple[list[RestoreRecord], list[Skipped]]:
    """The verified records of ``jobs`` (newest first, `list_jobs`) and what was left out,
    with why. ``owners``: job id -> the uids of the users accounting names for it (a MAC
    verified under one of their keys makes the record theirs: its ``owner``), or why there
    are none; a job not in it is not read (not in the accounting read: older, or no job of
    this cluster). ``site``: the site secret's keys (`jobkey.load_site_keys`), ``cluster``:
    `[cluster] name`, as the prolog derives each job's key. The caps as
    `restorelog.read_records`'; ``deadline``: time.monotonic()'s, for the whole read.

    The users take turns (`TURN` S3 calls each, their own jobs newest first): whatever one
    user files under their jobs, junk included, costs the read only that user's turns, so a
    deadline it makes pass leaves the other users' few records read, not theirs unread."""
    root = str(place)
    r = Reading(per_owner, in_all)
    records: list[RestoreRecord] = []
    todo = [j for j in jobs if int(j[len("job-"):]) in owners]
    if len(todo) < len(jobs):
        r.skipped.append(Skipped(f"{root}/job-*", f"{len(jobs) - len(todo)} jobs' records not "
                                 "read: accounting names no user for them in the span read "
                                 "(older jobs, or prefixes no job of this cluster made)", 0))
    # One queue per set of users a job's key may be derived for (usually one user).
    queues: dict[tuple[int, ...] | str, deque[_Job]] = {}
    for job in todo:
        who = owners[int(job[len("job-"):])]
        queues.setdefault(who if isinstance(who, str) else tuple(sorted(who)),
                          deque()).append(_Job(job, who))
    pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="gpuwarden-s3-records")
    # The next turn is the user's who has spent the least of the read's time so far (ties:
    # the one with the newest job).
    turns = [(0.0, i, who) for i, who in enumerate(queues)]
    why = ""
    try:
        while turns:
            if len(records) >= in_all:
                why = f"{in_all} records kept in all"
            elif time.monotonic() > deadline:
                why = "the read's deadline passed"
            if why:
                break
            spent, i, who = heapq.heappop(turns)
            q = queues[who]
            t0 = time.monotonic()
            for job, got in _turn(pool, s3, place, q, site, cluster, deadline, r):
                room = in_all - len(records)
                records.extend(got[:room])
                if len(got) > room:
                    r.skipped.append(Skipped(f"{root}/{job}/coord",
                                             f"{len(got) - room} records not counted: "
                                             f"{in_all} records kept in all",
                                             len(got) - room, True))
            if q:
                heapq.heappush(turns, (spent + time.monotonic() - t0, i, who))
        for _, _, who in sorted(turns, key=lambda t: t[1]):
            q = queues[who]
            late = sum(len(j.wanted) for j in q)
            if late:
                r.skipped.append(Skipped(f"{root}/{q[0].name}/coord" if q[0].wanted
                                         else f"{root}/job-*",
                                         f"{late} record files not read: {why}", late, True))
            if n := sum(not j.listed for j in q):
                whose = (f"of uid {', '.join(str(u) for u in who)} " if isinstance(who, tuple)
                         else "")
                r.skipped.append(Skipped(f"{root}/job-*", f"{n} jobs {whose}not read: {why}",
                                         0, True))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    r.summary(root, "job prefixes")
    records.sort(key=lambda x: x.job_id, reverse=True)  # newest first, as listed
    return records, r.skipped


TURN = 16  # S3 calls in one user's turn (LISTs of their next jobs, or GETs), at once


@dataclasses.dataclass
class _Job:
    """One job's read, done a turn at a time."""

    name: str
    owners: Owners
    listed: bool = False
    listing: dict[str, int | None] = dataclasses.field(default_factory=dict)
    wanted: deque[str] = dataclasses.field(default_factory=deque)
    keys: list[tuple[int, jobkey.JobKeys]] = dataclasses.field(default_factory=list)


def _turn(pool: ThreadPoolExecutor, s3: Any, place: Place, q: deque[_Job],
          site: Sequence[tuple[str, bytes]], cluster: str, deadline: float, r: Reading
          ) -> list[tuple[str, list[RestoreRecord]]]:
    """One user's turn on their jobs ``q`` (newest first): the LISTs of their next jobs not
    listed yet, or else at most `TURN` record files of those listed; each job's verified
    records. Jobs done leave ``q``."""
    out: list[tuple[str, list[RestoreRecord]]] = []
    if not q[0].listed:
        jobs = [j for j in itertools.islice(q, TURN) if not j.listed]
        for job, listing in zip(jobs, pool.map(lambda j: _listing(s3, place, j.name, deadline),
                                               jobs), strict=True):
            job.listed = True
            if isinstance(listing, Skipped):
                r.skipped.append(listing)
                continue
            job.listing = listing
            job.wanted = deque(_wanted(job, listing, site, cluster, r,
                                       f"{place}/{job.name}/coord"))
    else:
        batch: list[tuple[_Job, str]] = []
        for job in q:
            if not job.listed or len(batch) >= TURN:
                break
            while job.wanted and len(batch) < TURN:
                batch.append((job, job.wanted.popleft()))
        got: dict[str, list[RestoreRecord]] = {}
        late: dict[str, int] = {}
        for (job, _), rec in zip(batch, pool.map(
                lambda jn: _record(s3, place, jn[0].name, jn[1], jn[0].listing, jn[0].keys,
                                   deadline), batch), strict=True):
            if isinstance(rec, RestoreRecord):
                got.setdefault(job.name, []).append(rec)
            elif rec is None:
                late[job.name] = late.get(job.name, 0) + 1
            else:
                r.left_out(job.keys[0][0], rec)
        for name, n in late.items():
            r.skipped.append(Skipped(f"{place}/{name}/coord", f"{n} record files not read: "
                                     "the read's deadline passed", n, True))
        out = list(got.items())
    while q and q[0].listed and not q[0].wanted:
        q.popleft()
    return out


def _wanted(job: _Job, listing: Mapping[str, int | None], site: Sequence[tuple[str, bytes]],
            cluster: str, r: Reading, where: str) -> list[str]:
    """The record files of the job to read, within its users' share (and its keys, set on
    ``job``); why the others are not read, in ``r``."""
    wanted = sorted(n for n in listing if RECORD_NAME.fullmatch(n))
    if not wanted:
        return []
    owners = job.owners
    if isinstance(owners, str):
        r.skipped.append(Skipped(where, f"{len(wanted)} records not read: {owners}",
                                 len(wanted)))
        return []
    try:
        job.keys = [(uid, jobkey.JobKeys.of(jobkey.derive(site, cluster,
                                                          job.name[len("job-"):], uid)))
                    for uid in owners]
    except jobkey.JobKeyError as exc:
        r.skipped.append(Skipped(where, f"{len(wanted)} records not read: {exc}",
                                 len(wanted)))
        return []
    # Junk filed under the job costs its users' share, as records do (one for each user
    # accounting names for the job: the owner is known only once a MAC verifies).
    room = min(r.room(uid) for uid, _ in job.keys)
    if room <= 0:
        for uid, _ in job.keys:
            r.dirs_past[uid] = r.dirs_past.get(uid, 0) + 1
        return []
    if len(wanted) > room:
        r.skipped.append(Skipped(where, f"{len(wanted) - room} record files not read: uid "
                                        f"{job.keys[0][0]} has used its share of "
                                        f"{r.per_owner}", len(wanted) - room, True))
        wanted = wanted[:room]
    for uid, _ in job.keys:
        r.opened[uid] = r.opened.get(uid, 0) + len(wanted)
    return wanted


def _listing(s3: Any, place: Place, job: str, deadline: float) -> dict[str, int | None] | Skipped:
    """The names under the job's ``coord/`` with their listed sizes (None: not given), or why
    not (a job with more than MAX_ENTRIES entries is not read: no listing grows without
    bound)."""
    base = f"{place.prefix}/{job}/coord/"
    where = f"{place}/{job}/coord"
    if time.monotonic() > deadline:
        return Skipped(where, "not listed: the read's deadline passed", 0, True)
    out: dict[str, int | None] = {}
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=place.bucket,
                                                                 Prefix=base):
            for obj in page.get("Contents", ()):
                size = obj.get("Size")
                out[str(obj.get("Key", ""))[len(base):]] = (
                    size if isinstance(size, int) and not isinstance(size, bool) else None)
            if len(out) > MAX_ENTRIES:
                return Skipped(where, f"more than {MAX_ENTRIES} entries: not read", 0)
            if time.monotonic() > deadline:
                return Skipped(where, "listing cut short: the read's deadline passed", 0, True)
    except _s3_errors() as exc:
        return Skipped(where, f"cannot list: {advice(exc)}", 0)
    return out


def _record(s3: Any, place: Place, job: str, name: str, listing: Mapping[str, int | None],
            keys: Sequence[tuple[int, jobkey.JobKeys]], deadline: float
            ) -> RestoreRecord | Skipped | None:
    """The record ``name``, verified under one of ``keys`` and parsed; why not; None when
    the deadline passed first. Never raises: one planted object must never stop the report."""
    key = f"{place.prefix}/{job}/coord/{name}"
    where = f"{place}/{job}/coord/{name}"
    try:
        why = _unfit(name, listing)
        if why:
            return Skipped(where, why)
        if time.monotonic() > deadline:
            return None
        mac = _get(s3, place.bucket, key + MAC_SUFFIX, MAX_MAC)
        raw = _get(s3, place.bucket, key, MAX_RECORD)
        uid = next((uid for uid, k in keys if mac_ok(k, raw, mac)), None)
        if uid is None:
            return Skipped(where, "its MAC does not verify under the job's key (uid "
                                  f"{', '.join(str(u) for u, _ in keys)}): not the job's "
                                  "record, not trusted")
        return dataclasses.replace(parse(raw, job, name), owner=uid)
    except (_TooBig, BadRecord) as exc:
        return Skipped(where, str(exc))
    except Exception as exc:  # boto3's errors, whatever they are; never the report's end
        why = (advice(exc) if isinstance(exc, _s3_errors())
               else f"{type(exc).__name__}: {str(exc)[:80]}")
        return Skipped(where, f"cannot read: {why}")


def _unfit(name: str, listing: Mapping[str, int | None]) -> str:
    """Why the listing alone rules the record out, without a GET ("" when it does not)."""
    if name + MAC_SUFFIX not in listing:
        return f"no {MAC_SUFFIX} beside it (an upload cut short, or not the job's): not trusted"
    for what, n, limit in (("its MAC", listing[name + MAC_SUFFIX], MAX_MAC),
                           ("it", listing[name], MAX_RECORD)):
        if n is not None and n > limit:
            return f"{what}: {n} bytes, at most {limit}: not read"
    return ""


class _TooBig(ValueError):
    pass


def _get(s3: Any, bucket: str, key: str, limit: int) -> bytes:
    """The object's bytes, at most ``limit``: a ranged GET (S3 sends at most ``limit`` + 1
    bytes whatever the object became since the LIST), read no further; _TooBig when it is
    larger."""
    from botocore.exceptions import ClientError  # noqa: PLC0415

    try:
        obj = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{limit}")
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") == "InvalidRange":
            return b""  # an empty object: S3 has no first byte to send
        raise
    body = obj["Body"]
    try:
        data = bytearray()
        while len(data) <= limit and (chunk := body.read(limit + 1 - len(data))):
            data += chunk
    finally:
        body.close()
    if len(data) > limit:
        which = "its MAC" if key.endswith(MAC_SUFFIX) else "it"
        raise _TooBig(f"{which}: more than {limit} bytes: not read")
    return bytes(data)
