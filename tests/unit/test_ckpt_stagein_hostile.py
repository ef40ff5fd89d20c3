"""Prolog stage-in under a hung user database, huge steps, and planted links or FIFOs."""

from __future__ import annotations

import ctypes
import logging
import os
import pwd
import shutil
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path

import pytest

from gpuwarden.ckpt import codec, stagein
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.names import step_dir
from gpuwarden.config.ckpt import CkptConfig
from tests.unit.test_ckpt_stagein import JOB, Inline, env_for, mem_steps
from tests.unit.test_ckpt_stagein import tiers as tiers  # the fixture, for `staged`

_LIBC = ctypes.PyDLL(None)  # PyDLL: calls keep the GIL, as a blocked NSS module's C code does


@pytest.fixture
def staged(request: pytest.FixtureRequest) -> tuple[CkptConfig, Path, Path]:
    """test_ckpt_stagein's shared tier: 4 ranks, step 10 the newest all of them hold."""
    return request.getfixturevalue("tiers")  # type: ignore[no-any-return]


def hung_in_c(*_: object) -> list[int]:
    _LIBC.sleep(600)  # in C, GIL held: no other thread of this process runs meanwhile
    return []


# ---- the user database ------------------------------------------------------------------------
def test_a_user_database_hung_in_c_with_the_gil_cannot_stall_the_prolog(
        staged: tuple[CkptConfig, Path, Path], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """os.getgrouplist blocked in a hung LDAP holds the GIL: a thread's timeout never fires,
    and every requeued job's prolog stalled towards PrologEpilogTimeout (a drained node)."""
    cfg, _, mem = staged
    monkeypatch.setattr(stagein, "_NSS_S", 0.3)
    monkeypatch.setattr(stagein.os, "getgrouplist", hung_in_c)
    user = pwd.getpwuid(os.getuid()).pw_name
    runner = Inline()
    start = time.monotonic()
    stagein.stage_in(cfg, env_for(SLURM_JOB_USER=user), runner)
    assert time.monotonic() - start < 10.0  # not the 600 s of the hung lookup
    assert runner.calls == 0 and not (mem / JOB).exists()
    assert f"uid {os.getuid()}: the user database did not answer within 0.3 s" in caplog.text


def test_a_user_database_that_fails_is_named_and_skipped(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken(*_: object) -> list[int]:
        raise OSError("nss_ldap: cannot reach the server")
    monkeypatch.setattr(stagein.os, "getgrouplist", broken)
    assert stagein.parse_request(CkptConfig(shared_root="/fsx"), env_for()) is None
    assert "the user database lookup failed (OSError: nss_ldap" in caplog.text


def test_an_unknown_uid_with_a_gid_still_stages_with_the_primary_group_only() -> None:
    req = stagein.parse_request(CkptConfig(shared_root="/fsx"),
                                env_for(SLURM_JOB_UID="4000000000", SLURM_JOB_GID="4000000001"))
    assert req is not None and req.groups == (4000000001,)


# ---- streaming, as the job's user ---------------------------------------------------------------
def test_stage_in_streams_a_large_rank_through_a_small_buffer(tmp_path: Path) -> None:
    """A rank's step was read whole into the prolog's memory, outside the job's cgroup."""
    shared, mem = tmp_path / "fsx", tmp_path / "shm"
    big = os.urandom(32 << 20)
    for rank in range(2):
        shards, data = codec.encode({"big": big if rank == 1 else b"small"})
        FsTier("shared", str(shared), JOB, rank).commit(
            Manifest(JOB, 7, 2, rank, tuple(shards), time.time(), {}), data)
    cfg = CkptConfig(memory_root=str(mem), shared_root=str(shared))
    tracemalloc.start()
    try:
        stagein.stage_in(cfg, env_for(), Inline())  # this node, c2, runs rank 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak / 2**20:.0f} MiB held at once to stage a 32 MiB shard"
    _, got = FsTier("memory", str(mem), JOB, 1).load(7)
    assert bytes(got["big"]) == big


def test_the_copy_refuses_to_run_as_anyone_but_the_jobs_user(
        staged: tuple[CkptConfig, Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    """run_as drops to the job's user before stage(); stage() itself checks it did."""
    cfg, _, mem = staged
    req = stagein.parse_request(cfg, env_for())
    assert req is not None
    other = replace(req, uid=os.geteuid() + 4242)
    assert stagein.stage(other) == 2
    assert not (mem / JOB).exists()
    assert f"refusing to copy as uid {os.geteuid()}" in caplog.text


# ---- planted links and FIFOs on the shared tier ---------------------------------------------------
@pytest.mark.timeout(15)
def test_a_fifo_as_a_shared_shard_is_refused_without_waiting(
        staged: tuple[CkptConfig, Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    cfg, shared, mem = staged
    shard = shared / JOB / "rank-00003" / step_dir(10) / "weights"
    shard.unlink()
    os.mkfifo(shard)
    start = time.monotonic()
    stagein.stage_in(cfg, env_for(), Inline())
    assert time.monotonic() - start < 5
    assert mem_steps(mem, 2) == [10] and mem_steps(mem, 3) == []
    assert "weights: not a regular file: refusing it" in caplog.text


def test_a_linked_rank_directory_on_the_shared_tier_is_not_staged(
        staged: tuple[CkptConfig, Path, Path], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    cfg, shared, mem = staged
    caplog.set_level(logging.INFO, "gpuwarden.ckpt.stagein")
    rank3 = shared / JOB / "rank-00003"
    shutil.move(rank3, tmp_path / "elsewhere")
    rank3.symlink_to(tmp_path / "elsewhere")
    stagein.stage_in(cfg, env_for(), Inline())
    # Rank 3 then holds nothing on the shared tier: no step is every rank's, none is staged.
    assert mem_steps(mem, 2) == [] and mem_steps(mem, 3) == []
    assert "rank 3:" in caplog.text and "rank-00003 is not a directory (a link?)" in caplog.text
