"""Issue 37, trust case 10d: `gpuwarden ckpt ls|verify|gc` on a site without a shared
filesystem ([ckpt] s3_bucket and key_file, no shared_root) authenticate the job's S3 steps with
the keys the job signs them with. Root derives them from the site secret for the job's uid
(slurmctld's, else accounting's, or --uid); the job's user reads the prolog's key file on a node
of the job. Elsewhere S3 steps are said to be unauthenticated, never ok, and never deleted.

This suite runs as root; "alice" (the job's user, uid 2001 in the Slurm fixture) is played by
reporting her uid as the effective one, her key file chowned to her as the prolog does."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from gpuwarden.ckpt import codec, jobkey, s3tier
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.jobkey import JobKeys, derive
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.peer import job_key
from gpuwarden.ckpt.s3tier import S3Settings, S3Tier
from gpuwarden.cli import cli
from gpuwarden.config import Config
from gpuwarden.config.ckpt import CkptConfig
from gpuwarden.config.context import Context
from gpuwarden.slurm import jobuid
from gpuwarden.slurm.runner import CommandResult
from tests.fakes import FakeRunner, fail, ok

from .fake_s3 import FakeS3

FIXTURE = Path(__file__).parent.parent / "fixtures" / "slurm_26.05" / "scontrol_show_job.json"
ALICE, BOB = 2001, 34567  # alice runs job 190 in the fixture
JOB_ID, JOB = "190", "job-190"
CLUSTER, BUCKET, PREFIX = "c1", "site-bucket", "gpuwarden-ckpt"
OLD = [("k1", b"\x01" * 32)]  # the site secret before a rotation
SITE = [("k2", b"\x02" * 32), *OLD]  # k2 signs now, k1 still verifies
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="chowns the key file to the job's user")


class Bucket(FakeS3):
    """The fake bucket, also listed by "directory" (``Delimiter``), as `ckpt ls` lists ranks."""

    def get_paginator(self, op: str) -> Any:
        flat, outer = super().get_paginator(op), self

        class Pages:
            def paginate(self, Bucket: str, Prefix: str, Delimiter: str = "") -> Any:
                if not Delimiter:
                    return flat.paginate(Bucket=Bucket, Prefix=Prefix)
                heads = sorted({Prefix + k[len(Prefix):].split(Delimiter)[0] + Delimiter
                                for k in outer.objects if k.startswith(Prefix)
                                and Delimiter in k[len(Prefix):]})
                return [{"CommonPrefixes": [{"Prefix": h} for h in heads]}]
        return Pages()


@pytest.fixture
def bucket(monkeypatch: pytest.MonkeyPatch) -> Bucket:
    s3 = Bucket()
    monkeypatch.setattr(s3tier, "client", lambda _settings: s3)
    return s3


@pytest.fixture
def slurm(monkeypatch: pytest.MonkeyPatch) -> FakeRunner:
    """Slurm's commands as root's `ckpt` runs them: scripted per test, each call recorded."""
    run = FakeRunner()
    monkeypatch.setattr(jobuid, "runner", lambda _slurm, _end: run)
    return run


def scontrol_knows_the_job(argv: Any) -> CommandResult:
    assert list(argv) == ["scontrol", "show", "job", JOB_ID, "--json"]
    return ok(argv, FIXTURE.read_text())


def scontrol_forgot_it(argv: Any) -> CommandResult:
    assert argv[0] == "scontrol"
    return fail(argv, "slurm_load_jobs error: Invalid job id specified")


def sacct_says(uid: int | None) -> Any:
    def answer(argv: Any) -> CommandResult:
        assert argv[0] == "sacct" and f"--jobs={JOB_ID}" in argv
        return ok(argv, "" if uid is None else f"{JOB_ID}|{uid}\n")
    return answer


def site_file(base: Path) -> Path:
    etc = base / "etc"
    etc.mkdir(mode=0o755, exist_ok=True)
    path = etc / "ckpt.key"
    path.write_bytes(jobkey.format_keys(SITE))
    path.chmod(0o600)
    return path


def key_dir(base: Path) -> Path:
    return base / "run" / "gpuwarden-ckpt"


def config(base: Path, **ckpt: Any) -> Config:
    c = Config()
    return replace(c, cluster=replace(c.cluster, name=CLUSTER), ckpt=CkptConfig(**{
        "memory_root": str(base / "shm"), "s3_bucket": BUCKET, "key_file": str(site_file(base)),
        "job_key_dir": str(key_dir(base)), **ckpt}))


def runner(base: Path, **ckpt: Any) -> Any:
    ctx = Context()
    ctx._config = config(base, **ckpt)

    def run(*args: str) -> tuple[int, str, str]:
        res = CliRunner().invoke(cli, list(args), obj=ctx)
        assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
        return res.exit_code, res.stdout, res.stderr
    return run


def keys(site: list[tuple[str, bytes]] = SITE, job: str = JOB_ID, uid: int = ALICE) -> JobKeys:
    """What the prolog derives for ``job`` run by ``uid``, and the job signs with."""
    return JobKeys.of(derive(site, CLUSTER, job, uid))


def commit(bucket: Bucket, step: int, signed: JobKeys, rank: int = 0) -> None:
    """Step ``step`` of job 190's rank, as a job holding ``signed`` writes it."""
    t = S3Tier("s3", S3Settings(BUCKET, PREFIX), JOB, rank, s3=bucket, keys=signed)
    shards, data = codec.encode({"w": np.full(64, step, dtype="<f4"), "tag": b"t"})
    t.commit(Manifest(JOB, step, 1, rank, tuple(shards), time.time(), {}), data)


def s3_steps(bucket: Bucket) -> list[int]:
    base = f"{PREFIX}/{JOB}/rank-00000/step-"
    return sorted(int(k[len(base):].split("/")[0]) for k in bucket.objects
                  if k.startswith(base) and k.endswith("/MANIFEST.json"))


def s3_lines(out: str) -> dict[int, str]:
    return {int(line.split()[2].rstrip(":")): line for line in out.splitlines()
            if line.startswith("s3 ") and " step " in line}


def no_key_shown(text: str) -> None:
    for _kid, secret in SITE:
        assert secret.hex() not in text
    for k in (keys(), keys(OLD)):
        for key in k.by_kid.values():
            assert key.hex() not in text


@pytest.fixture
def alice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command run by the job's user, not root."""
    monkeypatch.setattr(os, "geteuid", lambda: ALICE)


# ---- root derives the job's keys ---------------------------------------------------------------
def test_root_verifies_a_jobs_s3_steps_with_its_keys_derived_for_slurms_uid(
        tmp_path: Path, bucket: Bucket, slurm: FakeRunner) -> None:
    commit(bucket, 10, keys(OLD))  # signed before the site rotated its secret
    commit(bucket, 20, keys())
    slurm.script = [scontrol_knows_the_job]
    code, out, err = runner(tmp_path)("ckpt", "verify", JOB)
    assert code == 0, out + err
    lines = s3_lines(out)
    assert sorted(lines) == [10, 20] and all(": ok (" in line for line in lines.values())
    assert "uid 2001 (scontrol)" in err
    assert jobkey.fingerprint(keys().signing[1]) in err  # the key id and fingerprint, no key
    no_key_shown(out + err)
    assert [c[0] for c in slurm.calls] == ["scontrol"]


def test_a_finished_jobs_uid_comes_from_accounting(tmp_path: Path, bucket: Bucket,
                                                   slurm: FakeRunner) -> None:
    commit(bucket, 20, keys())
    slurm.script = [scontrol_forgot_it, sacct_says(ALICE)]
    code, out, err = runner(tmp_path)("ckpt", "verify", JOB)
    assert code == 0 and ": ok (" in s3_lines(out)[20], out + err
    assert "uid 2001 (sacct)" in err
    assert [c[0] for c in slurm.calls] == ["scontrol", "sacct"]


def test_root_refuses_steps_signed_with_another_jobs_or_users_key(
        tmp_path: Path, bucket: Bucket, slurm: FakeRunner) -> None:
    commit(bucket, 10, keys(job="191"))  # alice's other job, planted into this one's prefix
    commit(bucket, 20, keys(uid=BOB))  # bob's job 190 (before Slurm's ids were reset)
    commit(bucket, 30, keys())
    slurm.script = [scontrol_knows_the_job]
    code, out, err = runner(tmp_path)("ckpt", "verify", JOB)
    assert code == 1, out + err
    lines = s3_lines(out)
    for step in (10, 20):
        assert "CORRUPT" in lines[step] and "not authenticated with this job's key" in lines[step]
    assert ": ok (" in lines[30]


def test_a_wrong_uid_refuses_every_step_and_slurm_is_not_asked(
        tmp_path: Path, bucket: Bucket, slurm: FakeRunner) -> None:
    commit(bucket, 10, keys())
    commit(bucket, 20, keys())
    code, out, err = runner(tmp_path)("ckpt", "verify", JOB, "--uid", str(BOB))
    assert code == 1, out + err
    assert all("CORRUPT" in line and ": ok" not in line for line in s3_lines(out).values())
    assert "uid 34567 (--uid)" in err
    assert slurm.calls == []


def test_the_right_uid_given_verifies_a_job_slurm_has_forgotten(
        tmp_path: Path, bucket: Bucket, slurm: FakeRunner) -> None:
    commit(bucket, 10, keys())
    code, out, err = runner(tmp_path)("ckpt", "verify", JOB, "--uid", str(ALICE))
    assert code == 0 and ": ok (" in s3_lines(out)[10], out + err


def test_without_a_uid_root_is_told_to_pass_one_and_nothing_changes(
        tmp_path: Path, bucket: Bucket, slurm: FakeRunner) -> None:
    for step in (10, 20, 30):
        commit(bucket, step, keys())
    before = dict(bucket.objects)
    for command in ("verify", "gc", "ls"):
        slurm.script = [scontrol_forgot_it, sacct_says(None)]
        code, out, err = runner(tmp_path)("ckpt", command, JOB)
        assert code == 1, out + err
        assert "--uid" in err and "job 190" in err and "has no record of job 190" in err
    assert bucket.objects == before


def test_a_slurm_that_does_not_answer_is_a_deadline_not_a_hang(
        tmp_path: Path, bucket: Bucket, slurm: FakeRunner) -> None:
    from gpuwarden.slurm.runner import CommandTimeoutError
    slurm.script = [CommandTimeoutError(["scontrol"], 5), CommandTimeoutError(["sacct"], 5)]
    code, _out, err = runner(tmp_path)("ckpt", "verify", JOB)
    assert code == 1 and "did not answer within" in err and "--uid" in err


def test_root_gc_deletes_only_what_retention_allows_and_never_an_unauthenticated_step(
        tmp_path: Path, bucket: Bucket, slurm: FakeRunner) -> None:
    commit(bucket, 10, keys(uid=BOB))  # not the job's: never deleted, never counted
    for step in (20, 30, 40):
        commit(bucket, step, keys())
    commit(bucket, 50, keys(job="191"))
    slurm.script = [scontrol_knows_the_job]
    code, out, err = runner(tmp_path)("ckpt", "gc", JOB, "--keep", "1")
    assert code == 0, out + err
    assert s3_steps(bucket) == [10, 40, 50]
    assert "s3       deleted 2, left unreadable step(s) 10, 50 in place" in out


def test_root_without_the_site_secret_deletes_nothing_and_says_so(
        tmp_path: Path, bucket: Bucket, slurm: FakeRunner) -> None:
    for step in (20, 30, 40):
        commit(bucket, step, keys())
    run = runner(tmp_path)
    (tmp_path / "etc" / "ckpt.key").chmod(0o644)  # refused: readable by others
    code, out, err = run("ckpt", "gc", JOB, "--keep", "1")
    assert code == 0 and s3_steps(bucket) == [20, 30, 40], out + err
    assert "cannot be authenticated" in err and "mode 644" in err
    assert slurm.calls == []  # no uid needed without a secret to derive from


def test_root_ls_lists_the_s3_steps_with_the_derived_keys(
        tmp_path: Path, bucket: Bucket, slurm: FakeRunner) -> None:
    commit(bucket, 10, keys())
    slurm.script = [scontrol_knows_the_job]
    code, out, err = runner(tmp_path)("ckpt", "ls", JOB)
    assert code == 0, out + err
    assert any(line.split()[:2] == ["s3", "0"] and line.endswith("1 step(s): 10")
               for line in out.splitlines()), out
    assert "cannot be authenticated" not in err


@root_only
def test_a_real_jobs_step_verifies_with_the_keys_root_derives(
        tmp_path: Path, bucket: Bucket, slurm: FakeRunner) -> None:
    """A job of root's (uid 0: this suite's), saving through JobCheckpointer with the key
    file the prolog wrote; root's verify, given the uid, derives the same keys."""
    from gpuwarden.ckpt.job import JobCheckpointer, JobEnv

    cfg = config(tmp_path, peer_replicas=0)
    jobkey.write_job_keys(cfg.ckpt.job_key_dir, JOB_ID, 0, 0, derive(SITE, CLUSTER, JOB_ID, 0))
    ck = JobCheckpointer(cfg.ckpt, JobEnv(JOB_ID, 0, 1, 0, "0", "n1"))
    ck.save(5, {"w": np.arange(256, dtype="<f4"), "tag": b"x"})
    assert ck.finish(5, timeout=30)
    assert s3_steps(bucket) == [5]
    code, out, err = runner(tmp_path, peer_replicas=0)("ckpt", "verify", JOB, "--uid", "0")
    assert code == 0 and ": ok (" in s3_lines(out)[5], out + err
    code, out, err = runner(tmp_path, peer_replicas=0)("ckpt", "verify", JOB, "--uid", "1")
    assert code == 1 and "CORRUPT" in s3_lines(out)[5]


# ---- the job's user ------------------------------------------------------------------------------
@pytest.fixture
def alices_key_file(tmp_path: Path) -> None:
    """The prolog's doing on a node of the job: alice's key file, hers, 0400."""
    jobkey.write_job_keys(str(key_dir(tmp_path)), JOB_ID, ALICE, ALICE,
                          derive(SITE, CLUSTER, JOB_ID, ALICE))


@root_only
def test_the_user_on_a_node_of_the_job_verifies_with_the_prologs_key_file(
        tmp_path: Path, bucket: Bucket, slurm: FakeRunner, alices_key_file: None,
        alice: None) -> None:
    commit(bucket, 10, keys(OLD))
    commit(bucket, 20, keys())
    commit(bucket, 30, keys(uid=BOB))
    code, out, err = runner(tmp_path)("ckpt", "verify", JOB)
    assert code == 1, out + err
    lines = s3_lines(out)
    assert ": ok (" in lines[10] and ": ok (" in lines[20] and "CORRUPT" in lines[30]
    assert slurm.calls == []  # the user's own key file: Slurm is not asked
    no_key_shown(out + err)


def test_the_user_elsewhere_is_told_where_s3_steps_can_be_authenticated(
        tmp_path: Path, bucket: Bucket, slurm: FakeRunner, alice: None) -> None:
    for step in (10, 20, 30):
        commit(bucket, step, keys())
    before = dict(bucket.objects)
    run = runner(tmp_path)
    code, out, err = run("ckpt", "verify", JOB)
    assert code == 1, out + err
    assert "S3 steps cannot be authenticated on this host" in err
    assert "a node of job 190" in err and "as root" in err and "--uid" in err
    lines = s3_lines(out)
    assert sorted(lines) == [10, 20, 30]
    assert all("NOT AUTHENTICATED" in line and "ok" not in line for line in lines.values())
    code, out, err = run("ckpt", "ls", JOB)
    assert code == 0 and "S3 steps cannot be authenticated on this host" in err
    code, out, err = run("ckpt", "gc", JOB, "--keep", "1")
    assert code == 0 and bucket.objects == before
    assert "left unreadable step(s) 10, 20, 30 in place" in out
    assert slurm.calls == []


def test_uid_is_refused_where_it_means_nothing(tmp_path: Path, bucket: Bucket,
                                               slurm: FakeRunner,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    code, _out, err = runner(tmp_path, key_file="", shared_root=str(tmp_path / "fsx"))(
        "ckpt", "verify", JOB, "--uid", "5")
    assert code == 2 and "--uid" in err and "key_file" in err
    monkeypatch.setattr(os, "geteuid", lambda: ALICE)
    code, _out, err = runner(tmp_path)("ckpt", "ls", JOB, "--uid", "5")
    assert code == 2 and "--uid" in err and "root" in err


# ---- with a shared tier -----------------------------------------------------------------------------
@pytest.fixture
def shared_job(tmp_path: Path) -> Iterator[bytes]:
    """The job's directory on the shared tier and its random peer.key (what a job on a site
    with shared_root signs with, before the site set key_file)."""
    t = FsTier("shared", str(tmp_path / "fsx"), JOB)
    t.ensure_dir()
    yield job_key(os.path.dirname(t.dir))


def test_a_shared_tier_site_reads_its_peer_key_as_before(
        tmp_path: Path, bucket: Bucket, slurm: FakeRunner, shared_job: bytes) -> None:
    commit(bucket, 10, JobKeys.shared(shared_job))
    code, out, err = runner(tmp_path, key_file="", shared_root=str(tmp_path / "fsx"))(
        "ckpt", "verify", JOB)
    assert code == 0 and ": ok (" in s3_lines(out)[10], out + err
    assert slurm.calls == []


def test_a_shared_tier_site_with_key_file_verifies_both_keys_the_job_signs_with(
        tmp_path: Path, bucket: Bucket, slurm: FakeRunner, shared_job: bytes) -> None:
    commit(bucket, 10, JobKeys.shared(shared_job))  # before the site set key_file
    commit(bucket, 20, keys())  # after: the derived key signs
    slurm.script = [scontrol_knows_the_job]
    code, out, err = runner(tmp_path, shared_root=str(tmp_path / "fsx"))("ckpt", "verify", JOB)
    assert code == 0, out + err
    lines = s3_lines(out)
    assert ": ok (" in lines[10] and ": ok (" in lines[20]


def test_scontrols_record_is_read_as_a_number_and_sacct_never_guessed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuwarden.slurm.settings import SlurmConfig
    doc = json.loads(FIXTURE.read_text())
    doc["jobs"][0]["user_id"] = "2001"  # not a number: not trusted
    run = FakeRunner([ok([], json.dumps(doc)), ok([], f"{JOB_ID}|2001\n{JOB_ID}|34567\n")])
    got = jobuid.job_uid(JOB_ID, run, 5)
    assert got.uid is None and "has no user_id" in got.why and "several uids" in got.why
    run = FakeRunner([fail([], "Invalid job id specified"), ok([], f"1900|7\n{JOB_ID}|2001\n")])
    assert jobuid.job_uid(JOB_ID, run, 5) == jobuid.Found(2001, "sacct")
    assert jobuid.lookup("x1", SlurmConfig()).uid is None


def test_the_lookup_ends_by_its_deadline_and_a_missing_slurm_is_an_answer(
        tmp_path: Path) -> None:
    from gpuwarden.slurm.runner import CommandTimeoutError
    from gpuwarden.slurm.settings import SlurmConfig
    with pytest.raises(CommandTimeoutError):  # its deadline passed: nothing is started
        jobuid.runner(SlurmConfig(), time.monotonic()).run(["scontrol", "ping"], 5)
    got = jobuid.lookup(JOB_ID, SlurmConfig(bin_dir=str(tmp_path / "no-slurm")))
    assert got.uid is None and got.why.count("bin_dir") == 2  # each command said why
