"""Issue 12, item 1: the prolog makes each job's tier-0 directories (a squatter's entry moved
aside), the epilog removes what a finished job leaves behind and keeps what a requeue needs."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gpuwarden.ckpt import codec, jobdirs
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.restore import restore
from gpuwarden.config import Config
from gpuwarden.config.ckpt import CkptConfig
from gpuwarden.core.errors import SlurmUnavailableError
from gpuwarden.slurm.models import Job

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the prolog and epilog run as root")
ALICE, MALLORY = 23456, 12345
JOB_ID = "612"
ENV = {"SLURM_JOB_ID": JOB_ID, "SLURM_JOB_UID": str(ALICE), "SLURM_JOB_GID": str(ALICE),
       "SLURM_JOB_USER": "alice"}


@pytest.fixture
def spool() -> Iterator[Path]:
    """A spool other uids can reach (pytest's tmp_path is root's 0700)."""
    base = tempfile.mkdtemp(prefix="gpuwarden-jobdirs-")
    os.chmod(base, 0o755)
    try:
        yield Path(base) / "gpuwarden-ckpt"
    finally:
        shutil.rmtree(base)


def config(spool: Path) -> Config:
    return replace(Config(), ckpt=CkptConfig(memory_root=str(spool)))


def as_user(uid: int, work: Callable[[], None]) -> int:
    """Run ``work`` in a child that has become ``uid``; its exit status (0: it passed)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child leaves through os._exit
        code = 1
        try:
            os.setgroups([])
            os.setegid(uid)
            os.seteuid(uid)
            work()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def save_and_restore(spool: Path) -> None:
    tier = FsTier("memory", str(spool), f"job-{JOB_ID}")
    w = np.arange(16, dtype=np.float32)
    shards, data = codec.encode({"w": w})
    tier.commit(Manifest(f"job-{JOB_ID}", 1, 1, 0, tuple(shards), time.time(), {}), data)
    got = restore([tier])
    assert got is not None and np.array_equal(got.state["w"], w)


def squat(spool: Path, name: str, uid: int = MALLORY) -> Path:
    spool.mkdir(mode=0o1777, exist_ok=True)
    os.chmod(spool, 0o1777)
    entry = spool / name
    entry.mkdir(mode=0o777)
    (entry / "rank-00000").mkdir()
    os.chown(entry / "rank-00000", uid, uid)
    os.chown(entry, uid, uid)
    return entry


def test_a_squatted_job_directory_no_longer_makes_the_job_fail(
        spool: Path, caplog: pytest.LogCaptureFixture) -> None:
    squat(spool, f"job-{JOB_ID}")
    assert as_user(ALICE, lambda: save_and_restore(spool)) != 0  # without the prolog: refused
    caplog.set_level(logging.WARNING)
    jobdirs.for_prolog(config(spool), ENV)
    for name in (f"job-{JOB_ID}", f"job-{JOB_ID}.peer"):
        st = os.lstat(spool / name)
        assert (st.st_uid, st.st_mode & 0o7777) == (ALICE, 0o700)
    aside = [n for n in os.listdir(spool) if n.startswith(f".squatted.job-{JOB_ID}.")]
    assert len(aside) == 1 and os.lstat(spool / aside[0]).st_uid == MALLORY
    assert f"uid {MALLORY}" in caplog.text and "moved aside" in caplog.text
    assert as_user(ALICE, lambda: save_and_restore(spool)) == 0
    assert os.lstat(spool).st_mode & 0o7777 == 0o1777


def test_the_prolog_moves_a_planted_link_aside_without_following_it(spool: Path,
                                                                    tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir(mode=0o755)
    spool.mkdir(mode=0o1777)
    os.chmod(spool, 0o1777)
    os.symlink(target, spool / f"job-{JOB_ID}.peer")
    os.lchown(spool / f"job-{JOB_ID}.peer", MALLORY, MALLORY)
    jobdirs.for_prolog(config(spool), ENV)
    assert os.stat(target).st_uid == 0 and os.stat(target).st_mode & 0o777 == 0o755
    assert os.lstat(spool / f"job-{JOB_ID}.peer").st_uid == ALICE


def test_the_prolog_keeps_a_requeued_jobs_own_directory(spool: Path) -> None:
    jobdirs.for_prolog(config(spool), ENV)
    assert as_user(ALICE, lambda: save_and_restore(spool)) == 0
    jobdirs.for_prolog(config(spool), {**ENV, "SLURM_JOB_RESTART_COUNT": "1"})
    assert FsTier("memory", str(spool), f"job-{JOB_ID}", owner=ALICE).steps() == [1]


class FakeSlurm:
    def __init__(self, *state: str, error: Exception | None = None) -> None:
        self.state, self.error = state, error

    def job(self, job_id: int) -> Job:
        if self.error is not None:
            raise self.error
        return Job(job_id, "train", "alice", self.state, "", "gpu", "c1", 1, 0, 0, "", "")


def prepared(spool: Path, tmp_path: Path) -> Path:
    jobdirs.for_prolog(config(spool), ENV)
    assert as_user(ALICE, lambda: save_and_restore(spool)) == 0
    squat(spool, f".squatted.job-{JOB_ID}.{MALLORY}.1")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("root's")
    peer = spool / f"job-{JOB_ID}.peer"
    os.rmdir(peer)
    os.symlink(outside, peer)  # alice swapped her own .peer for a link
    return outside


@pytest.mark.parametrize("state", [("COMPLETED",), ("FAILED", "COMPLETING"), ("CANCELLED",),
                                   ("TIMEOUT",), ("NODE_FAIL",), ("OUT_OF_MEMORY",)])
def test_the_epilog_removes_a_finished_jobs_tier0_and_peer_dirs_and_nothing_else(
        spool: Path, tmp_path: Path, state: tuple[str, ...]) -> None:
    outside = prepared(spool, tmp_path)
    other = squat(spool, "job-613", ALICE)
    jobdirs.for_epilog(config(spool), ENV, FakeSlurm(*state))
    assert sorted(os.listdir(spool)) == ["job-613"] and other.is_dir()
    assert (outside / "keep.txt").read_text() == "root's"


@pytest.mark.parametrize("slurm", [FakeSlurm("PENDING"), FakeSlurm("PENDING", "REQUEUED"),
                                   FakeSlurm("PENDING", "COMPLETING", "REQUEUED"),
                                   FakeSlurm("REQUEUE_HOLD"), FakeSlurm("SPECIAL_EXIT"),
                                   FakeSlurm(error=SlurmUnavailableError("slurmctld is down"))])
def test_the_epilog_keeps_what_a_requeue_will_use_and_keeps_it_when_unsure(
        spool: Path, tmp_path: Path, slurm: FakeSlurm, caplog: pytest.LogCaptureFixture) -> None:
    prepared(spool, tmp_path)
    caplog.set_level(logging.INFO)
    jobdirs.for_epilog(config(spool), ENV, slurm)
    assert f"job-{JOB_ID}" in os.listdir(spool) and f"job-{JOB_ID}.peer" in os.listdir(spool)
    assert not [n for n in os.listdir(spool) if n.startswith(".squatted.")]
    assert FsTier("memory", str(spool), f"job-{JOB_ID}", owner=ALICE).steps() == [1]
    assert "keeping" in caplog.text


@pytest.mark.parametrize("environ", [{}, {"SLURM_JOB_ID": "../1", "SLURM_JOB_UID": "1"},
                                     {"SLURM_JOB_ID": "1", "SLURM_JOB_UID": "x"}])
def test_bad_environment_is_logged_and_changes_nothing(
        spool: Path, environ: dict[str, str], caplog: pytest.LogCaptureFixture) -> None:
    jobdirs.for_prolog(config(spool), environ)
    jobdirs.for_epilog(config(spool), environ, FakeSlurm("COMPLETED"))
    assert not spool.exists() or os.listdir(spool) == []
    assert "SLURM_JOB" in caplog.text
