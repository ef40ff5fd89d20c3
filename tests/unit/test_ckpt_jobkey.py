"""Issue 37, step 2 (docs/design/object-store-sites.md section 3): the per-job key the prolog
derives from the site secret, writes for the job's user, the job reads, the epilog removes."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from gpuwarden.ckpt import jobkey
from gpuwarden.config import Config
from gpuwarden.config.ckpt import CkptConfig
from gpuwarden.slurm.models import Job

from .test_ckpt_jobdirs import as_user

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the prolog runs as root (chown)")
ALICE, MALLORY = 23456, 12345
JOB_ID = "612"
ENV = {"SLURM_JOB_ID": JOB_ID, "SLURM_JOB_UID": str(ALICE), "SLURM_JOB_GID": str(ALICE)}
SECRET_A, SECRET_B = bytes(range(32)), bytes(range(100, 132))
SITE = [("a1b2c3d4", SECRET_A)]


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory other uids can reach (pytest's tmp_path is root's 0700)."""
    d = tempfile.mkdtemp(prefix="gpuwarden-jobkey-")
    os.chmod(d, 0o755)
    try:
        yield Path(d)
    finally:
        shutil.rmtree(d)


def site_file(base: Path, text: str | None = None, mode: int = 0o600) -> Path:
    etc = base / "etc"
    etc.mkdir(mode=0o755, exist_ok=True)
    path = etc / "ckpt.key"
    path.write_text(text if text is not None else
                    "".join(f"{kid} {secret.hex()}\n" for kid, secret in SITE))
    path.chmod(mode)
    return path


def config(base: Path, key_file: Path | str) -> Config:
    return replace(Config(), ckpt=CkptConfig(memory_root=str(base / "shm"),
                                             key_file=str(key_file),
                                             job_key_dir=str(base / "run" / "gpuwarden-ckpt")))


def key_path(base: Path, job: str = JOB_ID) -> Path:
    return base / "run" / "gpuwarden-ckpt" / f"job-{job}.key"


# ---- derivation (pure) ------------------------------------------------------------------------
def test_the_job_key_is_the_designs_hmac_of_cluster_job_and_uid() -> None:
    want = hmac.new(SECRET_A, b"gpuwarden-ckpt-job-key\0v1\0c1\x00612\x0023456",
                    hashlib.sha256).digest()
    assert jobkey.derive(SITE, "c1", "612", ALICE) == [("a1b2c3d4", want)]


def test_the_job_key_is_the_same_on_every_node_and_after_a_requeue() -> None:
    # Nothing of the node or the run goes in: two derivations anywhere agree.
    site = [("new", SECRET_B), ("a1b2c3d4", SECRET_A)]
    assert jobkey.derive(site, "c1", "612", ALICE) == jobkey.derive(list(site), "c1", "612", ALICE)


@pytest.mark.parametrize("other", [("c1", "613", ALICE), ("c1", "612", MALLORY),
                                   ("c2", "612", ALICE)])
def test_the_job_key_differs_by_job_uid_and_cluster(other: tuple[str, str, int]) -> None:
    assert jobkey.derive(SITE, *other)[0][1] != jobkey.derive(SITE, "c1", "612", ALICE)[0][1]


def test_each_site_key_id_derives_its_own_key_signing_first() -> None:
    got = jobkey.derive([("b", SECRET_B), ("a", SECRET_A)], "c1", "612", ALICE)
    assert [kid for kid, _ in got] == ["b", "a"] and got[0][1] != got[1][1]


@pytest.mark.parametrize("args", [("c1", "61a", ALICE), ("c1", "", ALICE), ("c\x001", "612", ALICE),
                                  ("", "612", ALICE), ("c1", "612", -1)])
def test_derivation_refuses_inputs_that_could_collide(args: tuple[str, str, int]) -> None:
    with pytest.raises(jobkey.JobKeyError):
        jobkey.derive(SITE, *args)


def test_job_keys_never_show_their_bytes() -> None:
    keys = jobkey.JobKeys.of(jobkey.derive(SITE, "c1", "612", ALICE))
    shown = repr(keys) + str(keys)
    assert keys.signing[1].hex() not in shown and repr(keys.signing[1]) not in shown
    assert "a1b2c3d4" in shown and jobkey.fingerprint(keys.signing[1]) in shown


# ---- the site secret (root) -------------------------------------------------------------------
def test_the_site_file_is_read_in_order_comments_allowed(base: Path) -> None:
    path = site_file(base, f"# rotated 2026-12\nb2 {SECRET_B.hex()}\n\na1 {SECRET_A.hex()}\n")
    assert jobkey.load_site_keys(str(path)) == [("b2", SECRET_B), ("a1", SECRET_A)]


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o644])
def test_a_site_file_others_could_read_is_refused(base: Path, mode: int) -> None:
    path = site_file(base, mode=mode)
    with pytest.raises(jobkey.JobKeyError, match=f"mode {mode:o}.*chmod 600"):
        jobkey.load_site_keys(str(path))


@root_only
def test_a_site_file_not_roots_is_refused(base: Path) -> None:
    path = site_file(base)
    os.chown(path, MALLORY, MALLORY)
    with pytest.raises(jobkey.JobKeyError, match=f"uid {MALLORY}"):
        jobkey.load_site_keys(str(path))


def test_a_site_file_that_is_a_link_is_refused(base: Path) -> None:
    real = site_file(base)
    link = base / "etc" / "link.key"
    link.symlink_to(real)
    with pytest.raises(jobkey.JobKeyError, match="link"):
        jobkey.load_site_keys(str(link))


def test_a_fifo_in_place_of_the_site_file_never_blocks(base: Path) -> None:
    (base / "etc").mkdir(mode=0o755)
    os.mkfifo(base / "etc" / "ckpt.key", 0o600)
    with pytest.raises(jobkey.JobKeyError, match="not a regular file"):
        jobkey.load_site_keys(str(base / "etc" / "ckpt.key"))


@pytest.mark.parametrize("text", [
    "", "# only a comment\n", f"a1 {SECRET_A.hex()[:-2]}\n", f"a1 {SECRET_A.hex()}zz\n",
    f"a1  {SECRET_A.hex()}\n", f"a:1 {SECRET_A.hex()}\n", f"{SECRET_A.hex()}\n",
    f"a1 {SECRET_A.hex().upper()}\n", f"a1 {SECRET_A.hex()}\na1 {SECRET_B.hex()}\n",
    "".join(f"k{i} {SECRET_A.hex()}\n" for i in range(9)), "a1 " + "0" * 64 + "\n",
])
def test_a_malformed_site_file_is_refused_without_showing_its_bytes(base: Path, text: str) -> None:
    path = site_file(base, text)
    with pytest.raises(jobkey.JobKeyError) as err:
        jobkey.load_site_keys(str(path))
    assert str(path) in str(err.value) and SECRET_A.hex()[:16] not in str(err.value)


def test_a_site_file_in_a_directory_others_can_write_is_refused(base: Path) -> None:
    path = site_file(base)
    os.chmod(base / "etc", 0o777)
    with pytest.raises(jobkey.JobKeyError, match="writable by group or others"):
        jobkey.load_site_keys(str(path))


# ---- the job's key file (root writes, the job's user reads) -----------------------------------
def write(base: Path, job: str = JOB_ID, uid: int = ALICE) -> list[tuple[str, bytes]]:
    keys = jobkey.derive([("b2", SECRET_B), ("a1", SECRET_A)], "c1", job, uid)
    jobkey.write_job_keys(str(base / "run" / "gpuwarden-ckpt"), job, uid, uid, keys)
    return keys


@root_only
def test_the_key_file_is_the_job_users_0400_in_roots_0711_directory(base: Path) -> None:
    keys = write(base)
    d = os.lstat(base / "run" / "gpuwarden-ckpt")
    assert (d.st_uid, stat.S_IMODE(d.st_mode)) == (0, 0o711)
    f = os.lstat(key_path(base))
    assert stat.S_ISREG(f.st_mode) and (f.st_uid, stat.S_IMODE(f.st_mode)) == (ALICE, 0o400)
    assert key_path(base).read_bytes() == b"".join(f"{k} {v.hex()}\n".encode() for k, v in keys)
    assert os.listdir(base / "run" / "gpuwarden-ckpt") == [f"job-{JOB_ID}.key"]  # no temp left


@root_only
def test_a_key_directory_left_too_open_is_set_back_to_0711(base: Path) -> None:
    (base / "run" / "gpuwarden-ckpt").mkdir(parents=True, mode=0o755)
    write(base)
    assert stat.S_IMODE(os.lstat(base / "run" / "gpuwarden-ckpt").st_mode) == 0o711


@root_only
@pytest.mark.parametrize("planted", ["file", "link", "directory"])
def test_a_pre_existing_entry_is_replaced_never_followed(base: Path, planted: str) -> None:
    kdir = base / "run" / "gpuwarden-ckpt"
    kdir.mkdir(parents=True, mode=0o711)
    target = base / "target"
    target.write_text("precious\n")
    old = key_path(base)
    if planted == "file":
        old.write_text("old contents\n")
        os.chown(old, MALLORY, MALLORY)
    elif planted == "link":
        old.symlink_to(target)
    else:
        old.mkdir()
        (old / "inside").write_text("x")
    write(base)
    assert target.read_text() == "precious\n"
    f = os.lstat(old)
    assert stat.S_ISREG(f.st_mode) and (f.st_uid, stat.S_IMODE(f.st_mode)) == (ALICE, 0o400)


@root_only
def test_a_key_directory_that_is_a_link_or_another_users_is_refused(base: Path) -> None:
    (base / "run").mkdir(mode=0o755)
    elsewhere = base / "elsewhere"
    elsewhere.mkdir(mode=0o711)
    (base / "run" / "gpuwarden-ckpt").symlink_to(elsewhere)
    with pytest.raises(jobkey.JobKeyError, match="link"):
        write(base)
    assert os.listdir(elsewhere) == []
    (base / "run" / "gpuwarden-ckpt").unlink()
    (base / "run" / "gpuwarden-ckpt").mkdir(mode=0o711)
    os.chown(base / "run" / "gpuwarden-ckpt", MALLORY, MALLORY)
    with pytest.raises(jobkey.JobKeyError, match=f"uid {MALLORY}"):
        write(base)


@root_only
def test_the_jobs_user_reads_her_keys_through_the_0711_directory(base: Path) -> None:
    keys = write(base)
    kdir = str(base / "run" / "gpuwarden-ckpt")

    def read() -> None:
        got = jobkey.read_job_keys(kdir, JOB_ID)
        assert got.signing == keys[0] and dict(got.by_kid) == dict(keys)

    assert as_user(ALICE, read) == 0


@root_only
def test_another_user_can_neither_read_nor_list_the_keys(base: Path) -> None:
    write(base)
    kdir = str(base / "run" / "gpuwarden-ckpt")

    def mallory() -> None:
        with pytest.raises(jobkey.JobKeyError, match="cannot open|belongs to uid"):
            jobkey.read_job_keys(kdir, JOB_ID)
        with pytest.raises(PermissionError):
            os.listdir(kdir)

    assert as_user(MALLORY, mallory) == 0


@root_only
def test_the_reader_refuses_another_users_file(base: Path) -> None:
    write(base)  # alice's, read here by root
    with pytest.raises(jobkey.JobKeyError, match=f"belongs to uid {ALICE}"):
        jobkey.read_job_keys(str(base / "run" / "gpuwarden-ckpt"), JOB_ID)


@root_only
def test_the_reader_refuses_a_link_and_a_wider_mode(base: Path) -> None:
    write(base, uid=0)
    kdir = str(base / "run" / "gpuwarden-ckpt")
    os.chmod(key_path(base), 0o440)
    with pytest.raises(jobkey.JobKeyError, match="mode 440"):
        jobkey.read_job_keys(kdir, JOB_ID)
    os.rename(key_path(base), key_path(base, "1"))
    os.chmod(key_path(base, "1"), 0o400)
    key_path(base).symlink_to(key_path(base, "1"))
    with pytest.raises(jobkey.JobKeyError, match="link"):
        jobkey.read_job_keys(kdir, JOB_ID)


@root_only
@pytest.mark.parametrize("text", [
    b"", b"a1 " + b"0" * 63 + b"\n", b"a1 " + SECRET_A.hex().encode(),  # no newline
    b"# a comment\n", b"a1 " + SECRET_A.hex().encode() + b"\n\n",
    b"a1 " + SECRET_A.hex().encode() + b"\na1 " + SECRET_B.hex().encode() + b"\n",
    b"".join(b"k%d " % i + SECRET_A.hex().encode() + b"\n" for i in range(9)),
    b"a1 " + SECRET_A.hex().encode() + b"\n" + b"x" * 1100,
])
def test_the_reader_refuses_bad_contents(base: Path, text: bytes) -> None:
    write(base, uid=0)
    os.chmod(key_path(base), 0o600)
    key_path(base).write_bytes(text)
    os.chmod(key_path(base), 0o400)
    with pytest.raises(jobkey.JobKeyError, match=str(key_path(base))):
        jobkey.read_job_keys(str(base / "run" / "gpuwarden-ckpt"), JOB_ID)


def test_the_reader_says_when_there_is_no_key_file(base: Path) -> None:
    with pytest.raises(jobkey.JobKeyError, match="key_file"):
        jobkey.read_job_keys(str(base / "run" / "gpuwarden-ckpt"), JOB_ID)


# ---- the prolog and epilog hooks --------------------------------------------------------------
@root_only
def test_the_prolog_writes_and_the_epilog_removes_the_jobs_key(
        base: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = config(base, site_file(base))
    caplog.set_level(logging.INFO)
    jobkey.for_prolog(cfg, ENV)
    want = jobkey.derive(SITE, cfg.cluster.name, JOB_ID, ALICE)
    assert key_path(base).read_bytes() == f"a1b2c3d4 {want[0][1].hex()}\n".encode()
    assert "a1b2c3d4" in caplog.text and jobkey.fingerprint(want[0][1]) in caplog.text
    assert want[0][1].hex() not in caplog.text and SECRET_A.hex() not in caplog.text
    jobkey.for_epilog(cfg, ENV)
    assert not key_path(base).exists()


@root_only
def test_a_requeue_on_another_node_writes_the_same_key(base: Path) -> None:
    cfg = config(base, site_file(base))
    jobkey.for_prolog(cfg, ENV)
    first = key_path(base).read_bytes()
    jobkey.for_epilog(cfg, ENV)
    other = replace(cfg, ckpt=replace(cfg.ckpt, job_key_dir=str(base / "node2")))
    jobkey.for_prolog(other, {**ENV, "SLURM_JOB_RESTART_COUNT": "1"})
    assert (base / "node2" / f"job-{JOB_ID}.key").read_bytes() == first


def test_without_key_file_the_hooks_do_nothing(base: Path) -> None:
    cfg = config(base, "")
    jobkey.for_prolog(cfg, ENV)
    jobkey.for_epilog(cfg, ENV)
    assert not (base / "run").exists()


@pytest.mark.parametrize("case", ["no site file", "site file 0644", "site file a fifo",
                                  "bad environment", "no uid", "key dir is a file"])
def test_the_hooks_never_raise(base: Path, case: str, caplog: pytest.LogCaptureFixture) -> None:
    env, path = dict(ENV), base / "etc" / "ckpt.key"
    if case == "site file 0644":
        path = site_file(base, mode=0o644)
    elif case == "site file a fifo":
        (base / "etc").mkdir(mode=0o755)
        os.mkfifo(path, 0o600)
    elif case == "bad environment":
        env["SLURM_JOB_ID"] = "../../etc/passwd"
    elif case == "no uid":
        del env["SLURM_JOB_UID"]
    elif case == "key dir is a file":
        path = site_file(base)
        (base / "run").mkdir(mode=0o755)
        (base / "run" / "gpuwarden-ckpt").write_text("not a directory")
    caplog.set_level(logging.ERROR)
    jobkey.for_prolog(config(base, path), env)
    jobkey.for_epilog(config(base, path), env)
    assert "checkpoint job key" in caplog.text
    assert not key_path(base).exists() or case == "key dir is a file"


def test_the_prolog_gives_up_on_a_hung_read(base: Path, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(jobkey, "KEY_S", 0.3)
    monkeypatch.setattr(jobkey, "load_site_keys", lambda path: time.sleep(600))
    caplog.set_level(logging.ERROR)
    jobkey.for_prolog(config(base, site_file(base)), ENV)
    assert "no answer within" in caplog.text


@root_only
def test_the_epilog_removes_a_link_never_its_target(base: Path) -> None:
    cfg = config(base, site_file(base))
    jobkey.for_prolog(cfg, ENV)
    target = base / "target"
    target.write_text("precious\n")
    key_path(base).unlink()
    key_path(base).symlink_to(target)
    jobkey.for_epilog(cfg, ENV)
    assert not os.path.lexists(key_path(base)) and target.read_text() == "precious\n"


# ---- ckpt tidy --------------------------------------------------------------------------------
def job(job_id: int, *state: str) -> Job:
    return Job(job_id, "train", "alice", state, "", "gpu", "c1", 1, 0, 0, "", "")


@root_only
def test_tidy_removes_the_keys_of_jobs_that_are_over_or_forgotten(base: Path) -> None:
    kdir = base / "run" / "gpuwarden-ckpt"
    for j in ("5", "6", "7", "8", "9", "12"):
        write(base, j)
    (kdir / ".job-8.key.0123456789ab.tmp").write_text("a crash's leftover")
    (kdir / "notes").write_text("an admin's")
    (kdir / ".job-6.key").write_text("not a name the prolog makes")
    known = [job(6, "COMPLETED"), job(7, "RUNNING"), job(9, "PENDING", "REQUEUED"),
             job(10, "RUNNING")]
    got = jobkey.tidy(str(kdir), lambda: known)
    assert sorted(got.removed) == [".job-8.key.0123456789ab.tmp", "job-5.key", "job-6.key",
                                   "job-8.key"]
    assert sorted(os.listdir(kdir)) == [".job-6.key", "job-12.key", "job-7.key", "job-9.key",
                                        "notes"]
    assert got.kept["job-12.key"].startswith("Slurm does not know job 12")
    assert got.kept["job-7.key"] == "job 7 is RUNNING"


def test_tidy_asks_slurm_nothing_when_there_is_nothing_to_tidy(base: Path) -> None:
    def never() -> list[Job]:
        raise AssertionError("asked Slurm")

    assert jobkey.tidy(str(base / "absent"), never).removed == []
    (base / "keys").mkdir(mode=0o711)
    assert jobkey.tidy(str(base / "keys"), never).removed == []


@root_only
def test_ckpt_tidy_removes_this_nodes_keys_of_jobs_that_are_over(base: Path) -> None:
    from click.testing import CliRunner

    from gpuwarden.cli import cli
    from gpuwarden.config.context import Context

    for j in ("5", "7"):
        write(base, j)
    asked = []

    class Slurm:
        def jobs(self) -> list[Job]:
            asked.append(1)
            return [job(5, "COMPLETED"), job(7, "RUNNING")]
    ctx = Context(client_factory=lambda cfg: Slurm())  # type: ignore[arg-type,return-value]
    ctx._config = config(base, site_file(base))
    res = CliRunner().invoke(cli, ["ckpt", "tidy", "-v"], obj=ctx)
    assert res.exit_code == 0, res.output
    kdir = base / "run" / "gpuwarden-ckpt"
    assert f"{kdir}: removed 1 job key file (job-5.key)" in res.output
    assert "kept job-7.key: job 7 is RUNNING" in res.output and "kept 1: jobs not over" in res.output
    assert os.listdir(kdir) == ["job-7.key"] and asked == [1]
