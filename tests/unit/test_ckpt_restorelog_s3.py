"""Issue 37, step 12: on a site without a shared filesystem the jobs' restore records are in S3
(`restorelog.S3RecordSink`), and `gpuwarden report` read only the shared tier's: the "parallel
filesystem vs object store" card and ETTR had no measured restore there. The report now reads
them back, each verified with its MAC under its job's key, derived for the user accounting
names for the job; anything else is left out and named."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import EndpointConnectionError, NoCredentialsError
from click.testing import CliRunner

from gpuwarden.ckpt import jobkey, restorelog, restorelog_s3
from gpuwarden.ckpt.jobkey import JobKeys
from gpuwarden.ckpt.restorelog import (
    MAC_SUFFIX,
    MAX_RECORD,
    RestoreRecord,
    S3RecordSink,
    Skipped,
    per_tier,
    record_mac,
)
from gpuwarden.ckpt.restorelog_s3 import Place, list_jobs, read_records
from gpuwarden.cli import cli
from gpuwarden.config import Config
from gpuwarden.config.ckpt import CkptConfig
from gpuwarden.config.context import Context
from gpuwarden.report import cli as report_cli
from gpuwarden.report.collect import RunTally
from tests.unit.fake_s3 import FakeS3
from tests.unit.test_report_numbers import T0

SITE = [("k2", bytes(range(32))), ("k1", bytes(range(50, 82)))]  # k2 signs, k1 still verifies
CLUSTER = "c1"
ALICE, BOB = 23456, 34567
PLACE = Place("ckpt-bucket", "gpuwarden-ckpt")


def keys(job_id: int, uid: int = ALICE, site: list[tuple[str, bytes]] = SITE) -> JobKeys:
    return JobKeys.of(jobkey.derive(site, CLUSTER, str(job_id), uid))


def rec(job_id: int, rank: int = 0, tier: str = "s3", seconds: float = 30.0,
        run: str = "r1-s0", at: float = T0 + 3600) -> RestoreRecord:
    return RestoreRecord(f"job-{job_id}", rank, run, 10, tier, 1 << 30, seconds, at, at - 600)


def write(s3: FakeS3, r: RestoreRecord, k: JobKeys | None = None) -> None:
    """As a job's rank writes it: a real S3RecordSink, under the job's key."""
    S3RecordSink(s3, PLACE.bucket, PLACE.prefix, r.job,
                 k or keys(r.job_id)).record(r.name, r.doc())


def key(r: RestoreRecord, suffix: str = "") -> str:
    return f"{PLACE.prefix}/{r.job}/coord/{r.name}{suffix}"


def read(s3: FakeS3, owners: dict[int, Any] | None = None, **kw: Any
         ) -> tuple[list[RestoreRecord], list[Skipped]]:
    jobs, cut = list_jobs(s3, PLACE, time.monotonic() + 60)
    assert cut == []
    if owners is None:
        owners = {int(j[len("job-"):]): [ALICE] for j in jobs}
    return read_records(s3, PLACE, jobs, owners, SITE, CLUSTER,
                        kw.pop("deadline", time.monotonic() + 60), **kw)


def whys(skipped: list[Skipped]) -> dict[str, str]:
    return {s.where.rsplit("/", 1)[-1]: s.why for s in skipped}


# ---- the reader ---------------------------------------------------------------------------------
def test_records_a_job_wrote_under_its_key_are_read_and_counted_per_tier() -> None:
    s3 = FakeS3()
    for rank in range(3):
        write(s3, rec(612, rank, "s3", 30.0 + rank))
    write(s3, rec(613, 0, "memory", 0.5))
    s3.objects[f"{PLACE.prefix}/job-612/rank-00000/step-000000000010/w"] = b"x" * 100
    records, skipped = read(s3)
    assert skipped == []
    assert {(r.job, r.rank, r.owner) for r in records} == {
        ("job-612", 0, ALICE), ("job-612", 1, ALICE), ("job-612", 2, ALICE),
        ("job-613", 0, ALICE)}
    by = {t.tier: t for t in per_tier(records)}
    assert (by["s3"].restores, by["s3"].median_s) == (1, 32.0)  # the job's slowest rank
    assert (by["memory"].restores, by["memory"].median_s) == (1, 0.5)
    # One LIST of the jobs, one of each job's coord/ (never its steps), two GETs per record.
    lists = [k for op, k in s3.calls if op == "list"]
    assert sorted(lists) == [f"{PLACE.prefix}/", f"{PLACE.prefix}/job-612/coord/",
                             f"{PLACE.prefix}/job-613/coord/"]
    assert sum(op == "get" for op, _ in s3.calls) == 8


def test_records_are_read_newest_job_first_and_under_a_rotated_site_key() -> None:
    s3 = FakeS3()
    write(s3, rec(9, at=T0 + 1), JobKeys.of(jobkey.derive(SITE[1:], CLUSTER, "9", ALICE)))
    write(s3, rec(10, at=T0 + 2))
    write(s3, rec(100, at=T0 + 3))
    records, skipped = read(s3)
    assert skipped == []
    assert [r.job for r in records] == ["job-100", "job-10", "job-9"]  # by id, not by name


def _forge(s3: FakeS3, how: str) -> RestoreRecord:
    """A forged record of job 612, rank 1 (its rank 0 is the job's own)."""
    r = rec(612, 1)
    raw = json.dumps(r.doc(), sort_keys=True).encode()
    if how == "other job's key":
        write(s3, r, keys(613))
    elif how == "other user's key":
        write(s3, r, keys(612, BOB))
    elif how == "other site secret":
        write(s3, r, keys(612, site=[("k2", b"\x09" * 32)]))
    elif how == "no MAC":
        s3.objects[key(r)] = raw
    elif how == "MAC of other bytes":
        write(s3, r)
        s3.objects[key(r)] = json.dumps({**r.doc(), "seconds": 1.0}, sort_keys=True).encode()
    elif how == "another job's record and MAC":
        other = rec(613, 1)
        write(s3, other)
        s3.objects[key(r)] = s3.objects[key(other)]
        s3.objects[key(r, MAC_SUFFIX)] = s3.objects[key(other, MAC_SUFFIX)]
    elif how == "another job's name, this job's MAC":
        body = json.dumps({**r.doc(), "job": "job-613"}, sort_keys=True).encode()
        s3.objects[key(r, MAC_SUFFIX)] = record_mac(keys(612).signing, body)
        s3.objects[key(r)] = body
    elif how == "malformed":
        s3.objects[key(r, MAC_SUFFIX)] = record_mac(keys(612).signing, b"{")
        s3.objects[key(r)] = b"{"
    elif how == "plain hex MAC":  # a shared tier's form: no key id, never a derived key's
        s3.objects[key(r, MAC_SUFFIX)] = record_mac(("", keys(612).signing[1]), raw)
        s3.objects[key(r)] = raw
    return r


@pytest.mark.parametrize(("how", "why"), [
    ("other job's key", "does not verify under the job's key"),
    ("other user's key", "does not verify under the job's key"),
    ("other site secret", "does not verify under the job's key"),
    ("no MAC", "no .mac beside it"),
    ("MAC of other bytes", "does not verify under the job's key"),
    ("another job's record and MAC", "does not verify under the job's key"),
    ("another job's name, this job's MAC", "names job 'job-613', but was found in job-612"),
    ("malformed", "not JSON"),
    ("plain hex MAC", "does not verify under the job's key"),
])
def test_a_forged_record_is_left_out_with_its_reason(how: str, why: str) -> None:
    s3 = FakeS3()
    write(s3, rec(612, 0))
    forged = _forge(s3, how)
    records, skipped = read(s3, {612: [ALICE]})  # job 613 is not in the accounting read
    assert [(r.job, r.rank) for r in records] == [("job-612", 0)]
    named = [s for s in skipped if s.where.endswith(forged.name)]
    assert len(named) == 1 and why in named[0].why and named[0].records == 1, skipped
    assert not named[0].capped


def test_a_job_whose_user_is_unknown_is_left_out_and_counted() -> None:
    s3 = FakeS3()
    for rank in range(2):
        write(s3, rec(612, rank))
    write(s3, rec(613))
    write(s3, rec(614))
    records, skipped = read(s3, {612: "accounting names user 'eve' for it, with no uid here",
                                 613: [ALICE]})
    assert [r.job for r in records] == ["job-613"]
    by = whys(skipped)
    assert by["coord"] == "2 records not read: accounting names user 'eve' for it, with no uid here"
    assert next(s.records for s in skipped if "eve" in s.why) == 2
    # Job 614 is not in the accounting read at all: named once, not read, not a bad record.
    [absent] = [s for s in skipped if "accounting names no user" in s.why]
    assert absent.why.startswith("1 jobs' records not read") and absent.records == 0
    assert not any("job-614" in k for op, k in s3.calls if op in ("get", "list"))


def test_a_job_id_given_out_again_is_verified_for_each_of_its_users() -> None:
    s3 = FakeS3()
    write(s3, rec(612, 0), keys(612, ALICE))
    write(s3, rec(612, 1, run="r0-s0"), keys(612, BOB))
    records, skipped = read(s3, {612: [ALICE, BOB]})
    assert skipped == []
    assert {(r.rank, r.owner) for r in records} == {(0, ALICE), (1, BOB)}


def test_one_user_filling_the_caps_leaves_the_other_users_restores_on_the_page() -> None:
    s3 = FakeS3()
    for j in range(10, 14):
        for rank in range(3):
            write(s3, rec(j, rank), keys(j, BOB))
    write(s3, rec(2), keys(2, ALICE))  # older than all of them
    owners: dict[int, Any] = {j: [BOB] for j in range(10, 14)} | {2: [ALICE]}
    records, skipped = read(s3, owners, per_owner=5, in_all=7)
    assert [r.job for r in records if r.owner == ALICE] == ["job-2"]
    assert sum(r.owner == BOB for r in records) == 5
    assert {r.job for r in records if r.owner == BOB} == {"job-13", "job-12"}  # newest first
    got = {s.why: (s.records, s.capped) for s in skipped}
    assert got[f"1 record files not read: uid {BOB} has used its share of 5"] == (1, True)
    assert got[f"2 job prefixes of uid {BOB} not read: it has used its share of 5 record "
               "files"] == (0, True)
    records, skipped = read(s3, owners, in_all=4)
    assert len(records) == 4 and "job-2" in {r.job for r in records}  # alice's, all the same
    assert {s.why for s in skipped} == {"3 records not counted: 4 records kept in all"}


def test_junk_filed_under_a_job_costs_a_few_log_lines_and_a_job_too_big_is_not_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    s3 = FakeS3()
    for rank in range(30):
        r = rec(50, rank)
        s3.objects[key(r)] = b"junk"
        s3.objects[key(r, MAC_SUFFIX)] = b"junk"
    write(s3, rec(40))
    records, skipped = read(s3)
    assert [r.job for r in records] == ["job-40"]
    listed = [s for s in skipped if "does not verify" in s.why]
    assert len(listed) == restorelog.LINES_PER_OWNER
    assert any(s.why.startswith(f"10 more records of uid {ALICE} left out") for s in skipped)
    monkeypatch.setattr(restorelog_s3, "MAX_ENTRIES", 50)
    s3.calls.clear()
    records, skipped = read(s3)
    assert [r.job for r in records] == ["job-40"]
    assert whys(skipped)["coord"] == "more than 50 entries: not read"
    assert not any("job-50" in k for op, k in s3.calls if op == "get")


class Measured(FakeS3):
    """Counts the bytes each GET sends back."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[str, int] = {}

    def get_object(self, Bucket: str, Key: str, Range: str | None = None) -> dict[str, Any]:
        got = super().get_object(Bucket, Key, Range)
        self.sent[Key] = self.sent.get(Key, 0) + got["ContentLength"]
        return got


def test_a_huge_object_is_never_read_whole() -> None:
    s3 = Measured()
    big, grows, fine = rec(612, 0), rec(612, 1), rec(612, 2)
    for r in (big, grows, fine):
        write(s3, r)
    s3.objects[key(big)] = b" " * (64 << 20)  # listed as 64 MiB: not even asked for
    huge_mac = rec(612, 3)
    write(s3, huge_mac)
    s3.objects[key(huge_mac, MAC_SUFFIX)] = b"0" * (1 << 20)

    def swap(k: str, span: tuple[int, int] | None) -> None:
        if k == key(grows):  # replaced between the LIST and the GET
            s3.objects[k] = b" " * (64 << 20)
    s3.on_get = swap
    records, skipped = read(s3)
    assert [r.rank for r in records] == [2]
    by = whys(skipped)
    assert by[big.name] == f"it: {64 << 20} bytes, at most {MAX_RECORD}: not read"
    assert by[huge_mac.name] == f"its MAC: {1 << 20} bytes, at most 128: not read"
    assert by[grows.name] == f"it: more than {MAX_RECORD} bytes: not read"
    assert key(big) not in s3.sent and key(huge_mac, MAC_SUFFIX) not in s3.sent
    assert s3.sent[key(grows)] == MAX_RECORD + 1


def test_an_empty_object_is_a_bad_record_not_an_error() -> None:
    s3 = FakeS3()
    r = rec(612)
    write(s3, r)
    s3.objects[key(r)] = b""
    records, skipped = read(s3)
    assert records == [] and "does not verify" in whys(skipped)[r.name]


@pytest.mark.parametrize(("error", "says"), [
    (NoCredentialsError(), "no S3 credentials here"),
    (EndpointConnectionError(endpoint_url="http://s3.site:8333"), "check [ckpt] s3_endpoint"),
])
def test_a_bucket_that_cannot_be_listed_says_what_to_check(error: Exception, says: str) -> None:
    class Broken(FakeS3):
        def get_paginator(self, _op: str) -> Any:
            class Pages:
                def paginate(self, **_: Any) -> Any:
                    raise error
            return Pages()
    with pytest.raises(restorelog_s3.S3ReadError, match=r"cannot list s3://ckpt-bucket/") as exc:
        list_jobs(Broken(), PLACE, time.monotonic() + 60)
    assert says in str(exc.value)


def test_the_whole_read_has_a_deadline() -> None:
    s3 = FakeS3(page_size=2)
    for j in range(1, 8):
        write(s3, rec(j))
    jobs, cut = list_jobs(s3, PLACE, time.monotonic() - 1)
    assert len(jobs) == 2  # the first page only
    assert [c.capped for c in cut] == [True] and "listing's deadline passed" in cut[0].why
    jobs, _ = list_jobs(s3, PLACE, time.monotonic() + 60)
    s3.calls.clear()
    records, skipped = read_records(s3, PLACE, jobs, {j: [ALICE] for j in range(1, 8)}, SITE,
                                    CLUSTER, time.monotonic() - 1)
    assert records == []
    assert f"7 jobs of uid {ALICE} not read: the read's deadline passed" in [
        s.why for s in skipped]
    assert not any(op == "get" for op, _ in s3.calls)


def test_one_users_junk_spends_only_their_turns_of_the_reads_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bob files 2000 junk record/.mac pairs under his own newest job; the read's deadline
    passes while they are read. Alice's records, under older jobs, are read all the same."""
    s3 = FakeS3()
    for j in range(600, 610):
        write(s3, rec(j, 0, "s3", 30.0), keys(j, ALICE))
    for i in range(2000):
        base = f"{PLACE.prefix}/job-900/coord/restore-r{i}-s0.rank-0"
        s3.objects[base], s3.objects[base + MAC_SUFFIX] = b"{}", b"0" * 64
    clock = [0.0]  # each GET costs 1 s of the read's 100 s: no wall clock, no flake
    monkeypatch.setattr(restorelog_s3.time, "monotonic", lambda: clock[0])

    def tick(_k: str, _span: tuple[int, int] | None) -> None:
        clock[0] += 1.0
    s3.on_get = tick
    jobs, _ = list_jobs(s3, PLACE, 60.0)
    owners: dict[int, Any] = {j: [ALICE] for j in range(600, 610)} | {900: [BOB]}
    records, skipped = read_records(s3, PLACE, jobs, owners, SITE, CLUSTER, 100.0)
    assert sorted(r.job_id for r in records if r.owner == ALICE) == list(range(600, 610))
    assert 0 < sum(op == "get" and "job-900" in k for op, k in s3.calls) < 200
    late = [s for s in skipped if "job-900" in s.where and "deadline passed" in s.why]
    assert late and all(s.capped for s in late)  # bob's own records are what went unread


def test_the_tally_learns_the_users_of_the_jobs_it_watches() -> None:
    from tests.unit.test_report_numbers import JOBS, job

    tally = RunTally(watch=frozenset({1, 2}))
    tally.add([*JOBS, replace(job(2, "COMPLETED", "a", "n1", 8, T0 + 99_000, 1), user="bob")])
    assert tally.watched_users == {1: {"alice"}, 2: {"alice", "bob"}}


# ---- the report -----------------------------------------------------------------------------------
def _history(tmp_path: Path) -> tuple[list[str], dict[str, Any]]:
    from gpuwarden.accounting.calibrate import solve
    from gpuwarden.fleet.simulate import Fleet, write_history

    out = tmp_path / "hist"
    assert write_history(solve(), Fleet(nodes=128, days=2, seed=3), out).files
    doc = json.loads(next((out / "sacct").glob("*.json")).read_text())
    args = ["report", "--from", str(out / "sacct"), "--events", str(out / "events.txt"),
            "-o", str(tmp_path / "r.html"), "--json", str(tmp_path / "r.json")]
    return args, doc["jobs"][0]


def _site(tmp_path: Path, shared_root: str = "") -> Context:
    etc = tmp_path / "etc"
    etc.mkdir(mode=0o755)
    secret = etc / "ckpt.key"
    secret.write_text(jobkey.format_keys(SITE).decode())
    secret.chmod(0o600)
    cfg = Config()
    cfg = replace(cfg, cluster=replace(cfg.cluster, name=CLUSTER),
                  ckpt=CkptConfig(memory_root=str(tmp_path / "shm"), s3_bucket=PLACE.bucket,
                                  s3_prefix=PLACE.prefix, key_file=str(secret),
                                  shared_root=shared_root))
    return Context(_config=cfg)


def _card(tmp_path: Path) -> tuple[dict[str, Any], list[str], list[str]]:
    t = next(t for t in json.loads((tmp_path / "r.json").read_text())["tradeoffs"]
             if t["key"] == "filesystem_vs_object_store")
    return {f["label"]: f["value"] for f in t["figures"]}, t["assumptions"], t["missing"]


@pytest.fixture
def bucket(monkeypatch: pytest.MonkeyPatch) -> FakeS3:
    s3 = FakeS3()
    monkeypatch.setattr(report_cli, "_s3_client", lambda place: s3)
    monkeypatch.setattr(report_cli, "_uid", {"bob": ALICE}.get)
    return s3


def test_the_report_on_an_s3_only_site_shows_the_measured_restore_times(
        tmp_path: Path, bucket: FakeS3) -> None:
    args, first = _history(tmp_path)
    job_id, at = first["job_id"], float(first["time"]["start"]) + 60
    assert first["user"] == "bob"
    write(bucket, rec(job_id, 0, "s3", 90.0, at=at), keys(job_id, ALICE))
    write(bucket, rec(job_id, 1, "s3", 95.0, at=at), keys(job_id, BOB))  # not bob's key
    res = CliRunner().invoke(cli, args, obj=_site(tmp_path))
    assert res.exit_code == 0, res.output
    fig, assumptions, missing = _card(tmp_path)
    assert fig["restore time from the object store (median)"] == 90.0
    assert any(f"from s3://{PLACE.bucket}/{PLACE.prefix}: s3 1 job restores" in a
               for a in assumptions)
    assert any(m.startswith("1 restore records could not be read") for m in missing)


def test_the_report_reads_both_kinds_of_site_and_says_where(
        tmp_path: Path, bucket: FakeS3) -> None:
    from tests.unit.test_ckpt_restorelog import _coord, _plant

    args, first = _history(tmp_path)
    job_id, at = first["job_id"], float(first["time"]["start"]) + 60
    write(bucket, rec(job_id, 0, "s3", 600.0, at=at), keys(job_id, ALICE))
    root = tmp_path / "shared"
    _plant(_coord(root, f"job-{job_id}"), rec(job_id, 0, "shared", 60.0, run="r2-s0", at=at))
    ctx = _site(tmp_path, shared_root=str(root))
    res = CliRunner().invoke(cli, args, obj=ctx)  # a shared tier: S3 only when asked
    assert res.exit_code == 0, res.output
    assert _card(tmp_path)[0]["restore time from the object store (median)"] is None
    res = CliRunner().invoke(cli, [*args, "--ckpt-s3"], obj=ctx)
    assert res.exit_code == 0, res.output
    fig, assumptions, _ = _card(tmp_path)
    assert fig["restore time from the parallel filesystem (median)"] == 60.0
    assert fig["restore time from the object store (median)"] == 600.0
    assert any(f"from {root} and s3://{PLACE.bucket}/{PLACE.prefix}:" in a for a in assumptions)


def test_the_report_goes_on_when_the_bucket_cannot_be_listed(
        tmp_path: Path, bucket: FakeS3, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(**_: Any) -> Any:
        raise NoCredentialsError()
    monkeypatch.setattr(bucket, "get_paginator", lambda _op: type("P", (), {
        "paginate": staticmethod(broken)})())
    args, _ = _history(tmp_path)
    with caplog.at_level(logging.WARNING):
        res = CliRunner().invoke(cli, args, obj=_site(tmp_path))
    assert res.exit_code == 0, res.output
    assert "no S3 credentials here" in caplog.text
    _, _, missing = _card(tmp_path)
    assert any("--ckpt-s3" in m for m in missing)


def test_ckpt_s3_without_the_site_secret_is_refused(tmp_path: Path, bucket: FakeS3) -> None:
    args, _ = _history(tmp_path)
    res = CliRunner().invoke(cli, [*args, "--ckpt-s3"], obj=Context(_config=Config()))
    assert res.exit_code == 2 and "--ckpt-s3: needs [ckpt] s3_bucket and key_file" in res.output
