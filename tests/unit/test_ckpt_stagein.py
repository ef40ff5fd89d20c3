"""Prolog stage-in of a requeued job's newest common step into node memory (tier 0)."""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuwarden.ckpt import codec, stagein
from gpuwarden.ckpt.fstier import ANY_JOB_USER, FsTier
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.names import step_dir
from gpuwarden.ckpt.restore import restore
from gpuwarden.ckpt.stagein import Request, select
from gpuwarden.config import Config
from gpuwarden.config.ckpt import CkptConfig
from gpuwarden.hooks import entry
from tests.fakes import FakeSlurm
from tests.unit.test_entry import break_gpu, node_env  # noqa: F401 - the fixture, for below

JOB = "job-42"
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: it chowns files or setuids")


def rank_state(rank: int, step: int) -> dict[str, Any]:
    rng = np.random.default_rng(rank * 1000 + step)
    return {"weights": rng.standard_normal((256, 256)).astype(np.float32),
            "optimizer": bytes([rank]) * 1000}


def save(root: Path, rank: int, step: int, world: int = 4) -> None:
    """As Checkpointer.save does it, straight onto the shared tier."""
    shards, data = codec.encode(rank_state(rank, step))
    m = Manifest(JOB, step, world, rank, tuple(shards), time.time(), {})
    FsTier("shared", str(root), JOB, rank).commit(m, data)


def env_for(**over: str) -> dict[str, str]:
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_UID": str(os.getuid()),
           "SLURM_JOB_GID": str(os.getgid()), "SLURM_JOB_NODELIST": "c[1-2]",
           "SLURMD_NODENAME": "c2", "SLURM_JOB_RESTART_COUNT": "1"}
    env.update(over)
    return {k: v for k, v in env.items() if v != "-"}  # "-": leave the variable out


class Inline:
    """The runner seam, in-process: no fork, no setuid; counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, work: Callable[[], int], req: Request) -> int | None:
        self.calls += 1
        return work()


@pytest.fixture
def tiers(tmp_path: Path) -> tuple[CkptConfig, Path, Path]:
    shared, mem = tmp_path / "fsx", tmp_path / "shm"
    shared.mkdir()
    for rank in range(4):
        save(shared, rank, 10)
        if rank != 1:  # rank 1 never got step 20 out: 10 is the newest common step
            save(shared, rank, 20)
    return CkptConfig(memory_root=str(mem), shared_root=str(shared)), shared, mem


def mem_steps(mem: Path, rank: int) -> list[int]:
    # The test looks as root at the job user's directory: held to that directory's owner.
    return FsTier("memory", str(mem), JOB, rank, owner=ANY_JOB_USER).steps()


# ---- the pure selection -----------------------------------------------------------------------
def test_the_newest_step_all_ranks_hold_and_this_nodes_block_of_ranks() -> None:
    held = {0: [10, 20, 30], 1: [20, 30], 2: [10, 20, 30, 40], 3: [20, 30]}
    assert select(held, 4, ["c1", "c2"], "c2") == stagein.Selection(30, range(2, 4))
    assert select(held, 4, ["c1", "c2"], "c1").ranks == range(2)
    assert select(held, 4, ["c1", "c2", "c3", "c4"], "c3").ranks == range(2, 3)


def test_a_rank_missing_the_newest_step_means_an_older_one() -> None:
    held = {0: [4, 5], 1: [4, 5], 2: [4], 3: [4, 5]}
    assert select(held, 4, ["a", "b"], "a").step == 4


def test_no_common_step_or_a_rank_with_nothing_means_none() -> None:
    assert select({0: [1], 1: [2]}, 2, ["a"], "a") == stagein.Selection(None, range(2))
    assert select({0: [1], 1: [1]}, 3, ["a"], "a").step is None  # rank 2 has no directory
    assert select({0: [1], 1: [1], 2: []}, 3, ["a"], "a").step is None


def test_ranks_that_do_not_divide_over_the_nodes_are_not_guessed() -> None:
    sel = select({0: [1], 1: [1], 2: [1]}, 3, ["a", "b"], "a")
    assert sel.step is None and "3 ranks do not divide evenly over 2 nodes" in sel.why


def test_a_node_outside_the_nodelist_stages_nothing() -> None:
    sel = select({0: [1]}, 1, ["a", "b"], "c")
    assert not sel.ranks and "node c is not in the job's nodelist" in sel.why


def test_a_huge_world_size_from_a_manifest_is_not_ranged_over() -> None:
    assert select({0: [1]}, 10**12, ["a"], "a").step is None  # returns at once


# ---- staging, in-process ----------------------------------------------------------------------
def test_stage_in_copies_this_nodes_ranks_of_the_newest_common_step(
        tiers: tuple[CkptConfig, Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    cfg, shared, mem = tiers
    caplog.set_level(logging.INFO, "gpuwarden.ckpt.stagein")
    runner = Inline()
    stagein.stage_in(cfg, env_for(), runner)
    assert runner.calls == 1
    assert [mem_steps(mem, r) for r in range(4)] == [[], [], [10], [10]]
    for r in (2, 3):
        got = restore([FsTier("memory", str(mem), JOB, r)])
        assert got is not None and got.step == 10
        assert np.array_equal(got.state["weights"], rank_state(r, 10)["weights"])
    assert oct(os.lstat(mem).st_mode & 0o7777) == "0o1777"
    summary = [r.message for r in caplog.records if "of ranks 2-3" in r.message]
    assert summary[0].startswith(f"stage-in job 42: step 10 of ranks 2-3 into {mem} from {shared}: "
                                 "0.5 MiB in ")
    # A second prolog on the same node (or a surviving one) copies nothing.
    caplog.clear()
    stagein.stage_in(cfg, env_for(), runner)
    assert "0.0 MiB" in caplog.text and "2 of 2 ranks already there" in caplog.text


def test_a_corrupt_shared_shard_skips_that_rank_only(
        tiers: tuple[CkptConfig, Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    cfg, shared, mem = tiers
    caplog.set_level(logging.INFO, "gpuwarden.ckpt.stagein")
    shard = shared / JOB / "rank-00003" / step_dir(10) / "weights"
    raw = bytearray(shard.read_bytes())
    raw[7] ^= 0x01
    shard.write_bytes(bytes(raw))
    stagein.stage_in(cfg, env_for(), Inline())
    assert mem_steps(mem, 2) == [10] and mem_steps(mem, 3) == []
    assert "rank 3 step 10 not staged" in caplog.text and "checksum mismatch" in caplog.text
    assert "1 of 2 ranks failed" in caplog.text


def test_nothing_on_the_shared_tier_is_nothing_to_do(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "gpuwarden.ckpt.stagein")
    cfg = CkptConfig(memory_root=str(tmp_path / "shm"), shared_root=str(tmp_path / "fsx"))
    stagein.stage_in(cfg, env_for(), Inline())
    assert "no checkpoint of job-42" in caplog.text


@pytest.mark.parametrize("over", [{"SLURM_JOB_RESTART_COUNT": "0"},
                                  {"SLURM_JOB_RESTART_COUNT": "-"}])
def test_a_first_start_stages_nothing(tiers: tuple[CkptConfig, Path, Path],
                                      over: dict[str, str]) -> None:
    cfg, _, mem = tiers
    runner = Inline()
    stagein.stage_in(cfg, env_for(**over), runner)
    assert runner.calls == 0 and not mem.exists()


def test_stage_in_off_or_no_shared_tier_stages_nothing(tiers: tuple[CkptConfig, Path, Path]) -> None:
    cfg, _, mem = tiers
    runner = Inline()
    stagein.stage_in(replace(cfg, stage_in=False), env_for(), runner)
    stagein.stage_in(replace(cfg, shared_root=""), env_for(), runner)
    assert runner.calls == 0 and not mem.exists()


@pytest.mark.parametrize(("field", "value"), [
    ("SLURM_JOB_ID", "42; rm -rf /"), ("SLURM_JOB_ID", "-"), ("SLURM_JOB_UID", "root"),
    ("SLURM_JOB_UID", "-1"), ("SLURM_JOB_GID", "1.5"), ("SLURMD_NODENAME", "../etc"),
    ("SLURM_JOB_NODELIST", "c[1-"), ("SLURM_JOB_NODELIST", "-"), ("SLURM_JOB_USER", "a b"),
    ("SLURM_JOB_RESTART_COUNT", "x"),
])
def test_malformed_input_is_named_and_skipped(tiers: tuple[CkptConfig, Path, Path], field: str,
                                              value: str, caplog: pytest.LogCaptureFixture) -> None:
    cfg, _, mem = tiers
    runner = Inline()
    stagein.stage_in(cfg, env_for(**{field: value}), runner)
    assert runner.calls == 0 and not mem.exists()
    assert f"skipped: {field}=" in caplog.text


def test_without_a_gid_the_users_primary_group_is_used() -> None:
    req = stagein.parse_request(CkptConfig(shared_root="/fsx"), env_for(SLURM_JOB_GID="-"))
    me = pwd.getpwuid(os.getuid())
    assert req is not None and req.gid == me.pw_gid and me.pw_gid in req.groups
    assert req.job == JOB and req.nodes == ("c1", "c2") and req.node == "c2"


def test_a_user_name_that_is_not_the_uids_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    other = "nobody" if os.getuid() != NOBODY else "root"
    cfg = CkptConfig(shared_root="/fsx")
    assert stagein.parse_request(cfg, env_for(SLURM_JOB_USER=other)) is None
    assert "is not uid" in caplog.text


# ---- root's checks of tier 0 ------------------------------------------------------------------
def test_a_memory_root_that_is_a_link_is_refused_and_left_alone(
        tiers: tuple[CkptConfig, Path, Path], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    cfg, _, mem = tiers
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    mem.symlink_to(target)
    runner = Inline()
    stagein.stage_in(cfg, env_for(), runner)
    assert runner.calls == 0 and oct(target.stat().st_mode & 0o7777) == "0o700"
    assert f"tier 0: {mem} is a symbolic link, not a directory" in caplog.text


def test_a_memory_root_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    assert "is not a directory" in stagein.prepare_memory_root(str(tmp_path / "f"))


@as_root
def test_a_memory_root_owned_by_another_uid_is_refused_and_left_alone(
        tiers: tuple[CkptConfig, Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    cfg, _, mem = tiers
    mem.mkdir()
    mem.chmod(0o777)
    os.chown(mem, NOBODY, NOBODY)
    runner = Inline()
    stagein.stage_in(cfg, env_for(), runner)
    assert runner.calls == 0
    assert os.lstat(mem).st_uid == NOBODY and oct(mem.stat().st_mode & 0o7777) == "0o777"
    assert f"{mem} belongs to uid {NOBODY}, not root" in caplog.text


def test_a_memory_root_of_ours_with_another_mode_is_made_sticky(tmp_path: Path) -> None:
    mem = tmp_path / "shm"
    mem.mkdir(mode=0o755)
    assert stagein.prepare_memory_root(str(mem)) == ""
    assert oct(mem.stat().st_mode & 0o7777) == "0o1777"
    assert "owned by uid" in stagein.prepare_memory_root(str(mem), owner=os.geteuid() + 1)


# ---- the real runner: fork, drop privileges, deadline ------------------------------------------
@pytest.fixture
def open_dir() -> Iterator[Path]:
    """Under /tmp, traversable by others (pytest's own tmp_path is 0700 root)."""
    base = Path(tempfile.mkdtemp(prefix="gpuwarden-stagein-"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@as_root
def test_the_copy_runs_as_the_job_user_and_its_files_are_theirs(open_dir: Path) -> None:
    shared, mem = open_dir / "fsx", open_dir / "shm"
    shared.mkdir(mode=0o1777)
    for rank in range(4):
        save(shared, rank, 10)
    for dirpath, _, files in os.walk(shared / JOB):  # as the user's own job would have left it
        for name in [dirpath, *(os.path.join(dirpath, f) for f in files)]:
            os.chown(name, NOBODY, NOBODY)
    cfg = CkptConfig(memory_root=str(mem), shared_root=str(shared), stage_in_budget_s=60)
    stagein.stage_in(cfg, env_for(SLURM_JOB_UID=str(NOBODY), SLURM_JOB_GID=str(NOBODY)))
    assert os.lstat(mem).st_uid == 0 and oct(os.lstat(mem).st_mode & 0o7777) == "0o1777"
    staged = mem / JOB / "rank-00002" / step_dir(10)
    assert sorted(os.listdir(staged)) == ["MANIFEST.json", "optimizer", "weights"]
    for p in [mem / JOB, staged.parent, staged, *staged.iterdir()]:
        st = os.lstat(p)
        assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY), p
    assert mem_steps(mem, 3) == [10] and mem_steps(mem, 0) == []


@as_root
def test_the_user_cannot_read_what_root_could(open_dir: Path) -> None:
    """Root's privileges never reach the copy: a shared tier only root can read stays unread."""
    shared, mem = open_dir / "fsx", open_dir / "shm"
    for rank in range(4):
        save(shared, rank, 10)  # job dirs 0700 root
    cfg = CkptConfig(memory_root=str(mem), shared_root=str(shared), stage_in_budget_s=60)
    stagein.stage_in(cfg, env_for(SLURM_JOB_UID=str(NOBODY), SLURM_JOB_GID=str(NOBODY)))
    assert not (mem / JOB).exists()


@as_root
def test_a_copy_past_its_budget_is_killed() -> None:
    req = Request("42", os.getuid(), os.getgid(), (os.getgid(),), "c1", ("c1",), "/m", "/s", 0.3)
    start = time.monotonic()
    def slow() -> int:
        time.sleep(600)
        return 0

    assert stagein.run_as(slow, req) is None
    assert time.monotonic() - start < 10  # not the 600 s the copy would take
    # A copy within its budget answers; a generous one, so a loaded machine cannot fire it.
    assert stagein.run_as(lambda: 3, replace(req, budget_s=60.0)) == 3


# ---- the prolog's hook ------------------------------------------------------------------------
def test_for_prolog_never_raises(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                 caplog: pytest.LogCaptureFixture) -> None:
    def boom(*_: object) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(stagein, "attempt", boom)
    spool = tmp_path / "shm"
    stagein.for_prolog(replace(Config(), ckpt=CkptConfig(memory_root=str(spool))), env_for())
    assert "stage-in: internal error" in caplog.text
    # Every job's prolog makes tier 0's spool, root's and sticky, before any job can.
    assert spool.stat().st_mode & 0o7777 == 0o1777


def test_a_planted_spool_is_reported_and_nothing_is_staged(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(stagein, "attempt", lambda *_, **__: pytest.fail("staged into a planted "
                                                                           "spool"))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "shm").symlink_to(tmp_path / "elsewhere")
    stagein.for_prolog(replace(Config(), ckpt=CkptConfig(memory_root=str(tmp_path / "shm"))),
                       env_for())
    assert "checkpoint tier 0" in caplog.text


@pytest.fixture
def prolog_env(request: pytest.FixtureRequest) -> tuple[entry.Env, FakeSlurm, Path]:
    """test_entry's node: a fake Slurm and fake GPUs, healthy until broken."""
    return request.getfixturevalue("node_env")  # type: ignore[no-any-return]


@pytest.fixture
def hook_calls(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    calls: list[object] = []
    monkeypatch.setattr(stagein, "for_prolog", lambda cfg, environ: calls.append(environ))
    return calls


def test_the_prolog_stages_in_when_it_lets_the_job_run(
        prolog_env: tuple[entry.Env, FakeSlurm, Path], hook_calls: list[object]) -> None:
    env, _, _ = prolog_env
    assert entry.prolog(env) == 0 and hook_calls == [env.environ]


def test_the_prolog_does_not_stage_in_when_it_fails_the_job(
        prolog_env: tuple[entry.Env, FakeSlurm, Path], hook_calls: list[object]) -> None:
    env, _, tmp = prolog_env
    break_gpu(tmp)
    assert entry.prolog(env) == 1 and hook_calls == []


def test_a_critical_node_past_the_drain_cap_still_stages_in(
        prolog_env: tuple[entry.Env, FakeSlurm, Path], hook_calls: list[object]) -> None:
    env, slurm, tmp = prolog_env
    for name in ("c1", "c2"):
        slurm.drain(name, "earlier")
    break_gpu(tmp)
    assert entry.prolog(env) == 0 and len(hook_calls) == 1


def test_stage_in_keeps_the_prolog_import_path_light() -> None:
    code = ("import sys, gpuwarden.hooks.entry, gpuwarden.ckpt.stagein; "
            "bad = [m for m in ('numpy', 'xxhash', 'gpuwarden.ckpt.fstier') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr


def test_a_user_database_that_does_not_answer_skips_stage_in_in_bounded_time(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """LDAP down must not hang the prolog: the lookup is given up on, staging is skipped."""
    monkeypatch.setattr(stagein, "_NSS_S", 0.2)
    monkeypatch.setattr(stagein.pwd, "getpwuid", lambda uid: time.sleep(600))
    start = time.monotonic()
    assert stagein.parse_request(CkptConfig(shared_root="/fsx/x"), env_for()) is None
    assert time.monotonic() - start < 10  # not the 600 s the lookup would take
    assert "did not answer" in caplog.text
