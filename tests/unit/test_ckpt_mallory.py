"""Issue 12, the second hostile review ("mallory", an unprivileged user): each reproduced defect
(/tmp/mallory/r*.py) as a test. Tests that need another uid or chown run as root only."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gpuwarden.ckpt import codec, jobdirs
from gpuwarden.ckpt.checkpointer import Checkpointer
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.manifest import LEGACY, Manifest, Shard
from gpuwarden.ckpt.restore import restore
from gpuwarden.ckpt.s3mac import step_mac
from gpuwarden.ckpt.s3tier import MAC, S3Settings, S3Tier, manifest_mac
from gpuwarden.ckpt.tier import CorruptStep, TierError
from gpuwarden.config import Config
from gpuwarden.config.ckpt import CkptConfig
from gpuwarden.core import safefs as safeio
from gpuwarden.slurm.models import Job

from .test_ckpt_s3tier import FakeS3
from .test_safefs import deep_tree

ALICE, MALLORY = 23456, 12345
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown, another uid)")


@pytest.fixture
def spool() -> Iterator[Path]:
    """A sticky spool in a directory other uids can reach."""
    base = tempfile.mkdtemp(prefix="gpuwarden-mallory-")
    os.chmod(base, 0o755)
    path = Path(base) / "spool"
    path.mkdir()
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        with safeio.closing(os.open(os.path.dirname(base), os.O_RDONLY)) as fd:
            safeio.remove_at(fd, os.path.basename(base))
        # Whatever the code under test left (a failing run), rm(1) takes any depth.
        subprocess.run(["rm", "-rf", "--one-file-system", base], check=False)


def state(value: float) -> dict[str, np.ndarray]:
    return {"w": np.full(1000, value, dtype="<f4")}


def damage(tier: FsTier, step: int) -> None:
    path = Path(tier.dir) / f"step-{step:012d}" / "w"
    raw = bytearray(path.read_bytes())
    raw[7] ^= 1
    os.chmod(path, 0o600)
    path.write_bytes(bytes(raw))


# ---- 1: saving a damaged step again -------------------------------------------------------------
@pytest.mark.parametrize("same_bytes", [True, False])
def test_saving_a_damaged_step_again_sets_it_aside_and_makes_the_new_one_durable(
        tmp_path: Path, same_bytes: bool) -> None:
    mem = FsTier("memory", str(tmp_path / "shm"), "job-1")
    shared = FsTier("shared", str(tmp_path / "shared"), "job-1")
    ck = Checkpointer("job-1", mem, [shared], keep=3)
    for s in (9, 10):
        ck.save(s, state(s))
        assert ck.wait_durable(s, 10)
    ck.close(5)
    for t in (mem, shared):
        damage(t, 10)
    ck = Checkpointer("job-1", mem, [shared], keep=3)
    try:
        got = ck.restore()
        assert got is not None and got.step == 9
        ck.forget_newer(got.step)
        new = state(10) if same_bytes else state(10.5)
        ck.save(10, new)
        assert ck.wait_durable(10, 10)
    finally:
        ck.close(5)
    for t in (mem, shared):
        _, data = t.load(10)  # the new copy, not the damaged one
        assert codec.checksum(data["w"]) == codec.checksum(new["w"].tobytes())
        aside = [n for n in os.listdir(t.dir) if n.startswith(".refused.step-000000000010.")]
        assert len(aside) == 1  # the damaged copy is kept for an operator, never deleted


def test_saving_a_legacy_step_again_writes_version_2(tmp_path: Path) -> None:
    t = FsTier("memory", str(tmp_path), "job-5")
    shards, data = codec.encode({"w": np.arange(4, dtype="<f4")})
    t.ensure_dir()
    d = Path(t.dir) / "step-000000000005"
    d.mkdir(mode=0o700)
    (d / "w").write_bytes(bytes(memoryview(data["w"]).cast("B")))
    (d / "MANIFEST.json").write_text(
        Manifest("job-5", 5, 1, 0, tuple(shards), 1.0, {}, version=LEGACY).to_json())
    assert t.manifest(5).version == LEGACY
    t.commit(Manifest("job-5", 5, 1, 0, tuple(shards), 2.0, {}), data)
    assert json.loads((d / "MANIFEST.json").read_text())["version"] == 2


def test_a_legacy_manifest_is_warned_about_once_per_process(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    t = FsTier("memory", str(tmp_path), "job-6")
    shards, data = codec.encode({"w": np.arange(4, dtype="<f4")})
    t.ensure_dir()
    d = Path(t.dir) / "step-000000000005"
    d.mkdir(mode=0o700)
    (d / "w").write_bytes(bytes(memoryview(data["w"]).cast("B")))
    (d / "MANIFEST.json").write_text(
        Manifest("job-6", 5, 1, 0, tuple(shards), 1.0, {}, version=LEGACY).to_json())
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        t.manifest(5)
        t.load(5)
    assert caplog.text.count("legacy version-1 manifest") == 1


# ---- 2: a deep tree planted where the epilog removes -------------------------------------------
# (The removal itself, deep and bounded: test_safefs.py.)


class Finished:
    def job(self, job_id: int) -> Job:
        return Job(job_id, "train", "alice", ("COMPLETED",), "", "gpu", "c1", 1, 0, 0, "", "")


class Broken:
    def job(self, job_id: int) -> Job:
        raise RuntimeError("a bug anywhere below the hook")


def config(spool: Path, shared: str = "") -> Config:
    return replace(Config(), ckpt=CkptConfig(memory_root=str(spool), shared_root=shared))


ENV = {"SLURM_JOB_ID": "13", "SLURM_JOB_UID": str(ALICE), "SLURM_JOB_GID": str(ALICE)}


@root_only
def test_a_deep_squatted_tree_neither_crashes_the_epilog_nor_keeps_the_jobs_directory(
        spool: Path, caplog: pytest.LogCaptureFixture) -> None:
    jobdirs.for_prolog(config(spool), ENV)
    deep_tree(spool, f".squatted.job-13.{MALLORY}.1", 1200)
    with safeio.closing(os.open(spool, os.O_RDONLY)) as fd:
        os.chown(f".squatted.job-13.{MALLORY}.1", MALLORY, MALLORY, dir_fd=fd)
    jobdirs.for_epilog(config(spool), ENV, Finished())
    assert os.listdir(spool) == []


@root_only
def test_one_entry_that_cannot_go_does_not_keep_the_others(
        spool: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    jobdirs.for_prolog(config(spool), ENV)
    (spool / f".squatted.job-13.{MALLORY}.1").mkdir()
    real = safeio.remove_at

    def remove_at(parent: int, name: str) -> bool:
        if name.startswith(".squatted."):
            raise RecursionError("as shutil.rmtree did on a deep tree")
        return real(parent, name)
    monkeypatch.setattr(safeio, "remove_at", remove_at)
    caplog.set_level(logging.ERROR)
    jobdirs.for_epilog(config(spool), ENV, Finished())
    assert sorted(os.listdir(spool)) == [f".squatted.job-13.{MALLORY}.1"]
    assert "RecursionError" in caplog.text


def test_the_prolog_and_epilog_hooks_never_raise(spool: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    jobdirs.for_epilog(config(spool), ENV, Broken())  # type: ignore[arg-type]

    def boom(*_a: object) -> None:
        raise RecursionError("anything at all")
    monkeypatch.setattr(jobdirs, "prepare", boom)
    jobdirs.for_prolog(config(spool), ENV)


# ---- 3: squatting on the shared tier -----------------------------------------------------------
@root_only
def test_a_squatted_shared_job_directory_names_its_owner_and_what_to_do(spool: Path) -> None:
    (spool / "job-712").mkdir(mode=0o700)
    os.chown(spool / "job-712", MALLORY, MALLORY)
    tier = FsTier("shared", str(spool), "job-712", owner=ALICE)
    with pytest.raises(TierError, match=rf"belongs to uid {MALLORY}.*admin should move it aside"):
        tier.ensure_dir()


@root_only
def test_the_prolog_makes_the_jobs_shared_directory_and_moves_a_squat_aside(
        spool: Path, tmp_path: Path) -> None:
    shared = Path(tempfile.mkdtemp(prefix="gpuwarden-shared-", dir=spool.parent))
    os.chmod(shared, 0o1777)
    (shared / "job-13").mkdir(mode=0o700)
    os.chown(shared / "job-13", MALLORY, MALLORY)
    jobdirs.for_prolog(config(spool, str(shared)), ENV)
    st = os.lstat(shared / "job-13")
    assert (st.st_uid, st.st_mode & 0o7777) == (ALICE, 0o700)
    assert [n for n in os.listdir(shared) if n.startswith(".squatted.job-13.")]
    assert FsTier("shared", str(shared), "job-13", owner=ALICE).steps() == []  # usable


# ---- 4: steps planted in a site-wide S3 bucket -------------------------------------------------
def test_s3_refuses_steps_not_authenticated_with_the_jobs_key(tmp_path: Path) -> None:
    s3, settings = FakeS3(), S3Settings("site-bucket")
    alice_key, mallory_key = b"a" * 32, b"m" * 32
    mem = FsTier("memory", str(tmp_path), "job-612")
    shards, data = codec.encode({"w": np.ones(4, "<f4")})
    mem.commit(Manifest("job-612", 5, 1, 0, tuple(shards), 1.0, {}), data)
    # mallory, with the nodes' shared credentials: once with her own key, once with none
    shards, data = codec.encode({"w": np.full(4, 666, "<f4")})
    S3Tier("s3", settings, "job-612", 0, s3=s3, key=mallory_key).commit(
        Manifest("job-612", 999, 1, 0, tuple(shards), 1.0, {}), data)
    planted = Manifest("job-612", 998, 1, 0, tuple(shards), 1.0, {})
    for shard in shards:
        s3.objects[f"gpuwarden-ckpt/job-612/rank-00000/step-000000000998/{shard.name}"] = \
            bytes(memoryview(data[shard.name]).cast("B"))
    s3.objects["gpuwarden-ckpt/job-612/rank-00000/step-000000000998/MANIFEST.json"] = \
        planted.to_json().encode()
    got = restore([mem, S3Tier("s3", settings, "job-612", 0, s3=s3, key=alice_key)])
    assert got is not None and (got.step, got.tier) == (5, "memory")
    assert np.array_equal(got.state["w"], np.ones(4, "<f4"))
    with pytest.raises(CorruptStep, match="no job key"):
        S3Tier("s3", settings, "job-612", 0, s3=s3).manifest(999)


def test_s3_steps_written_with_the_jobs_key_restore(tmp_path: Path) -> None:
    s3, key = FakeS3(), b"k" * 32
    tier = S3Tier("s3", S3Settings("b"), "job-1", 0, s3=s3, key=key)
    shards, data = codec.encode({"w": np.arange(8, dtype="<f4")})
    tier.commit(Manifest("job-1", 3, 1, 0, tuple(shards), 1.0, {}), data)
    raw = s3.objects["gpuwarden-ckpt/job-1/rank-00000/step-000000000003/MANIFEST.json"]
    mac = s3.objects[f"gpuwarden-ckpt/job-1/rank-00000/step-000000000003/{MAC}"]
    head, records = mac.split(b"\n", 1)  # the MAC, then each shard's keyed digest
    assert head == b"v2 " + step_mac(key, raw, records).encode() and records.count(b"\n") == 1
    got = restore([tier])
    assert got is not None and got.step == 3
    assert tier.verify(3).step == 3


# ---- 5: the squat vanishes while the prolog claims it ------------------------------------------
@root_only
def test_the_prolog_looks_again_when_the_squat_vanishes_under_it(
        spool: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (spool / "job-13").mkdir()
    os.chown(spool / "job-13", MALLORY, MALLORY)
    real = safeio.lstat_at

    def lstat_at(parent: int, name: str) -> os.stat_result | None:
        st = real(parent, name)
        if name == "job-13" and st is not None and st.st_uid == MALLORY:
            os.rmdir(name, dir_fd=parent)  # mallory removes her squat just now
        return st
    monkeypatch.setattr(safeio, "lstat_at", lstat_at)
    jobdirs.for_prolog(config(spool), ENV)
    monkeypatch.undo()
    for name in ("job-13", "job-13.peer"):
        assert os.lstat(spool / name).st_uid == ALICE


@root_only
def test_the_peer_directory_is_made_even_when_the_jobs_directory_cannot_be(
        spool: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = jobdirs.claim

    def claim(spool_fd: int, name: str, *a: object) -> str:
        if name == "job-13":
            raise jobdirs.JobDirError("still taken")
        return real(spool_fd, name, *a)  # type: ignore[arg-type]
    monkeypatch.setattr(jobdirs, "claim", claim)
    jobdirs.for_prolog(config(spool), ENV)
    assert os.lstat(spool / "job-13.peer").st_uid == ALICE


# ---- 6: root's verify and a huge declared shard ------------------------------------------------
def test_root_verify_streams_a_huge_sparse_shard_in_bounded_memory(spool: Path) -> None:
    size = 3 << 30
    d = spool / "job-666" / "rank-00000" / "step-000000000001"
    d.mkdir(parents=True)
    for p in (spool / "job-666", spool / "job-666" / "rank-00000", d):
        os.chmod(p, 0o700)
    with open(d / "w", "wb") as fh:
        fh.truncate(size)  # sparse: costs no memory to make
    m = Manifest("job-666", 1, 1, 0, (Shard("w", size, "0" * 16),), 1.0, {})
    (d / "MANIFEST.json").write_text(m.to_json())
    (spool.parent / "gw.toml").write_text(f'[ckpt]\nmemory_root = "{spool}"\n')

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    exe = shutil.which("gpuwarden", path=os.path.dirname(sys.executable))
    assert exe is not None
    p = subprocess.run([exe, "--config", str(spool.parent / "gw.toml"), "ckpt", "verify",
                        "job-666"], preexec_fn=limit, capture_output=True, text=True,
                       timeout=60, check=False)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "shard w: checksum mismatch" in p.stdout and "Traceback" not in p.stderr


def test_verify_reads_a_step_like_load(tmp_path: Path) -> None:
    t = FsTier("memory", str(tmp_path), "job-2")
    w = np.arange(3 << 18, dtype="<f4")  # 3 MiB: several chunks
    shards, data = codec.encode({"w": w, "tag": b""})
    t.commit(Manifest("job-2", 1, 1, 0, tuple(shards), time.time(), {}), data)
    assert t.verify(1).step == 1
    damage(t, 1)
    with pytest.raises(CorruptStep, match="shard w: checksum mismatch"):
        t.verify(1)


def test_the_s3_mac_is_not_a_plain_digest() -> None:
    raw = b'{"x": 1}'
    assert manifest_mac(b"k" * 32, raw) != hashlib.sha256(raw).hexdigest()
