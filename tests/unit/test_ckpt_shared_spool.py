"""The shared tier's spool does not grow by one empty `job-N` per job: the epilog removes what a
finished job left empty (never while it will run again), `ckpt tidy` what no epilog saw, and
neither ever removes what a user put there or follows a link."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from gpuwarden.ckpt import jobdirs, sharedspool
from gpuwarden.config import Config
from gpuwarden.config.ckpt import CkptConfig
from gpuwarden.core.errors import SlurmUnavailableError
from gpuwarden.slurm.models import Job
from tests.unit.test_ckpt_jobdirs import ALICE, ENV, JOB_ID, MALLORY, FakeSlurm

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the prolog and epilog run as root")
NAME = f"job-{JOB_ID}"


@pytest.fixture
def roots() -> Iterator[tuple[Path, Path]]:
    """Tier 0's spool (the prolog makes it) and the shared root (the admin's, root's, 1777)."""
    base = Path(tempfile.mkdtemp(prefix="gpuwarden-shared-spool-"))
    os.chmod(base, 0o755)
    shared = base / "fsx"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    try:
        yield base / "shm", shared
    finally:
        shutil.rmtree(base)


def config(roots: tuple[Path, Path]) -> Config:
    shm, shared = roots
    return replace(Config(), ckpt=CkptConfig(memory_root=str(shm), shared_root=str(shared)))


def alices(path: Path, mode: int = 0o700) -> Path:
    path.mkdir(mode=mode)
    os.chmod(path, mode)
    os.chown(path, ALICE, ALICE)
    return path


FINISHED = [("COMPLETED",), ("FAILED", "COMPLETING"), ("CANCELLED",), ("TIMEOUT",),
            ("NODE_FAIL",), ("OUT_OF_MEMORY",), ("PREEMPTED",)]


@pytest.mark.parametrize("state", FINISHED)
def test_a_finished_jobs_empty_shared_directory_is_removed(
        roots: tuple[Path, Path], state: tuple[str, ...]) -> None:
    _, shared = roots
    jobdirs.for_prolog(config(roots), ENV)
    assert os.lstat(shared / NAME).st_uid == ALICE  # the prolog made it, for every job
    other = alices(shared / "job-613")  # another job's (still running, say): not this epilog's
    squatted = alices(shared / f".squatted.{NAME}.{MALLORY}.1")  # an admin's to look at
    jobdirs.for_epilog(config(roots), ENV, FakeSlurm(*state))
    assert sorted(os.listdir(shared)) == sorted([other.name, squatted.name])


@pytest.mark.parametrize("slurm", [FakeSlurm("PENDING"), FakeSlurm("PENDING", "REQUEUED"),
                                   FakeSlurm("PENDING", "COMPLETING", "REQUEUED"),
                                   FakeSlurm("REQUEUE_HOLD"), FakeSlurm("SPECIAL_EXIT"),
                                   FakeSlurm("RUNNING"), FakeSlurm("WHATEVER_NEW"),
                                   FakeSlurm(error=SlurmUnavailableError("slurmctld is down"))])
def test_a_job_that_will_run_again_or_that_slurm_cannot_place_keeps_its_shared_directory(
        roots: tuple[Path, Path], slurm: FakeSlurm) -> None:
    _, shared = roots
    jobdirs.for_prolog(config(roots), ENV)
    jobdirs.for_epilog(config(roots), ENV, slurm)
    assert os.listdir(shared) == [NAME] and os.lstat(shared / NAME).st_uid == ALICE


@pytest.mark.parametrize("content", ["step", "restore record", "key", "user file", "empty dir"])
def test_a_shared_directory_holding_anything_is_kept_whole(
        roots: tuple[Path, Path], content: str) -> None:
    _, shared = roots
    jobdirs.for_prolog(config(roots), ENV)
    job = shared / NAME
    made = {"step": job / "rank-00000" / "step-000000000010" / "MANIFEST.json",
            "restore record": job / "coord" / "restore-r0-s0.rank-0",
            "key": job / "peer.key", "user file": job / "notes.txt",
            "empty dir": job / "rank-00000"}[content]
    made.parent.mkdir(parents=True, exist_ok=True)
    if content == "empty dir":
        made.mkdir(exist_ok=True)
    else:
        made.write_text("mine")
    jobdirs.for_epilog(config(roots), ENV, FakeSlurm("COMPLETED"))
    assert made.exists() and (made.is_dir() or made.read_text() == "mine")


def test_what_the_prolog_did_not_make_is_never_removed_nor_followed(
        roots: tuple[Path, Path], tmp_path: Path) -> None:
    """Empty, but not the prolog's: a link to an empty directory, a file, another user's
    directory, one the user opened up (0755). Each stays as it is, and so does a link's
    target."""
    _, shared = roots
    cfg = config(roots)
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    cases = {"701": "link", "702": "file", "703": "mallory", "704": "0755"}
    os.symlink(target, shared / "job-701")
    (shared / "job-702").write_text("")
    alices(shared / "job-703")
    os.chown(shared / "job-703", MALLORY, MALLORY)
    alices(shared / "job-704", 0o755)
    for job_id in cases:
        jobdirs.for_epilog(cfg, {**ENV, "SLURM_JOB_ID": job_id}, FakeSlurm("COMPLETED"))
    assert sorted(os.listdir(shared)) == [f"job-{j}" for j in sorted(cases)]
    assert os.path.islink(shared / "job-701") and target.is_dir()
    assert os.lstat(shared / "job-703").st_uid == MALLORY


def test_a_requeued_job_keeps_its_directory_until_its_last_run_ends(
        roots: tuple[Path, Path]) -> None:
    _, shared = roots
    cfg = config(roots)
    jobdirs.for_prolog(cfg, ENV)
    jobdirs.for_epilog(cfg, ENV, FakeSlurm("PENDING", "COMPLETING", "REQUEUED"))
    jobdirs.for_prolog(cfg, {**ENV, "SLURM_JOB_RESTART_COUNT": "1"})
    assert os.listdir(shared) == [NAME]
    jobdirs.for_epilog(cfg, ENV, FakeSlurm("COMPLETED"))
    assert os.listdir(shared) == []


# ---- ckpt tidy: what no epilog saw ------------------------------------------------------------
def job(job_id: int, *state: str) -> Job:
    return Job(job_id, "train", "alice", state, "", "gpu", "c1", 1, 0, 0, "", "")


def test_tidy_removes_what_no_epilog_saw_and_only_that(
        roots: tuple[Path, Path], tmp_path: Path) -> None:
    """Slurm knows jobs 500 (cancelled while requeued: no epilog ran), 501 (requeued), 502
    (running) and 504 (done); 400 and 503 finished long ago (Slurm forgot them: their ids are
    below the newest it knows); 900 is a number Slurm has not given yet."""
    _, shared = roots
    for n in (400, 500, 501, 502, 503, 504, 900):
        alices(shared / f"job-{n}")
    alices(shared / "job-401")
    (shared / "job-401" / "rank-00000").mkdir()  # a checkpoint: the user's
    os.symlink(tmp_path, shared / "job-402")
    alices(shared / "job-403x")  # not a job directory's name
    asked = []

    def jobs() -> list[Job]:
        asked.append(1)
        return [job(500, "CANCELLED"), job(501, "PENDING", "REQUEUED"), job(502, "RUNNING"),
                job(504, "COMPLETED")]
    got = sharedspool.tidy(str(shared), jobs)
    assert sorted(got.removed) == ["job-400", "job-500", "job-503", "job-504"] and asked == [1]
    assert sorted(os.listdir(shared)) == ["job-401", "job-402", "job-403x", "job-501", "job-502",
                                          "job-900"]
    assert "holds the job's files" in got.kept["job-401"]
    assert "REQUEUED" in got.kept["job-501"] and "Slurm does not know" in got.kept["job-900"]


def test_tidy_keeps_unknown_jobs_while_slurm_knows_none_and_asks_nothing_when_clean(
        roots: tuple[Path, Path]) -> None:
    _, shared = roots

    def never() -> list[Job]:
        raise AssertionError("no candidate: Slurm must not be asked")
    assert sharedspool.tidy(str(shared), never).removed == []
    alices(shared / "job-5")
    got = sharedspool.tidy(str(shared), list)
    assert got.removed == [] and os.listdir(shared) == ["job-5"]


def test_ckpt_tidy_says_what_it_removed_and_why_it_kept_the_rest(
        roots: tuple[Path, Path]) -> None:
    from click.testing import CliRunner

    from gpuwarden.cli import cli
    from gpuwarden.config.context import Context

    _, shared = roots
    for n in (7, 8, 9):
        alices(shared / f"job-{n}")
    (shared / "job-8" / "peer.key").write_text("k")

    class Slurm:
        def jobs(self) -> list[Job]:
            return [job(8, "COMPLETED"), job(9, "RUNNING")]
    ctx = Context(client_factory=lambda cfg: Slurm())  # type: ignore[arg-type,return-value]
    ctx._config = config(roots)
    res = CliRunner().invoke(cli, ["ckpt", "tidy"], obj=ctx)
    assert res.exit_code == 0, res.output
    assert f"{shared}: removed 1 empty job directory (job-7)" in res.output
    assert "kept 1: holding files" in res.output and "kept 1: jobs not over" in res.output
    assert "kept job-9" not in res.output
    res = CliRunner().invoke(cli, ["ckpt", "tidy", "-v"], obj=ctx)
    assert "kept job-9: job 9 is RUNNING" in res.output, res.output
    ctx._config = replace(Config(), ckpt=CkptConfig(memory_root=str(shared)))
    res = CliRunner().invoke(cli, ["ckpt", "tidy"], obj=ctx)
    assert res.exit_code != 0 and "set [ckpt] shared_root" in res.output


# ---- the prologs of a job's nodes, all at once ------------------------------------------------
def test_another_nodes_half_made_directory_is_finished_not_moved_aside(
        roots: tuple[Path, Path]) -> None:
    """Node A's prolog made job-N (root's, 0700) and has not chowned it yet when node B's
    looks: B hands it to the job's user instead of moving it aside as a squatter's, which
    left a root directory on the shared tier for good."""
    _, shared = roots
    (shared / NAME).mkdir(mode=0o700)  # node A, between mkdir and chown
    jobdirs.for_prolog(config(roots), ENV)
    st = os.lstat(shared / NAME)
    assert (st.st_uid, st.st_mode & 0o7777) == (ALICE, 0o700)
    assert os.listdir(shared) == [NAME]


def test_a_directory_another_node_chowned_first_is_kept_not_taken_for_root_squash(
        roots: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Node B chowns the directory node A just made before A opens it: A must keep it, not
    take it for a root-squashed one and remove the job's directory."""
    _, shared = roots
    real_mkdir = os.mkdir

    def mkdir_then_other_node(path: str, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        real_mkdir(path, mode, dir_fd=dir_fd)
        if path == NAME:
            os.chown(path, ALICE, ALICE, dir_fd=dir_fd)  # node B's prolog, in between
    monkeypatch.setattr(jobdirs.os, "mkdir", mkdir_then_other_node)
    with jobdirs.closing(os.open(shared, os.O_RDONLY | os.O_DIRECTORY)) as fd:
        assert jobdirs.claim(fd, NAME, ALICE, ALICE, str(shared)) == "kept"
    assert os.lstat(shared / NAME).st_uid == ALICE and os.listdir(shared) == [NAME]


def test_roots_directory_holding_something_is_still_moved_aside(
        roots: tuple[Path, Path]) -> None:
    _, shared = roots
    (shared / NAME).mkdir(mode=0o700)
    (shared / NAME / "secret").write_text("root's")
    jobdirs.for_prolog(config(roots), ENV)
    assert os.lstat(shared / NAME).st_uid == ALICE and os.listdir(shared / NAME) == []
    [aside] = [n for n in os.listdir(shared) if n.startswith(f".squatted.{NAME}.0.")]
    assert (shared / aside / "secret").read_text() == "root's"
