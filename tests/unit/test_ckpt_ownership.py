"""Issue 12, items 1, 4 and 7: read paths refuse another user's files, links and FIFOs; root's
commands never follow a user's links nor hang; a read-only restore changes nothing.

"mallory" is uid 12345: her files are made by root and handed to her with chown (this suite runs
as root; the tests that need that are skipped otherwise).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuwarden.ckpt import codec
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.names import step_dir
from gpuwarden.ckpt.restore import TiersUnavailable, restore
from gpuwarden.ckpt.tier import MANIFEST, CorruptStep, TierError

MALLORY = 12345
JOB = "job-612"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another uid")


def state(seed: int) -> dict[str, Any]:
    return {"w": np.full((8, 8), seed, dtype=np.float32), "tag": f"s{seed}".encode()}


def save(tier: FsTier, step: int, seed: int) -> None:
    shards, data = codec.encode(state(seed))
    tier.commit(Manifest(JOB, step, 1, 0, tuple(shards), time.time(), {}), data)


def chown_tree(path: str | Path, uid: int) -> None:
    for dirpath, dirnames, filenames in os.walk(path):
        for n in (*dirnames, *filenames):
            os.lchown(os.path.join(dirpath, n), uid, uid)
    os.lchown(path, uid, uid)


# ---- item 1: another user can neither plant nor block --------------------------------------
@as_root
def test_mallorys_planted_step_is_refused_and_the_shared_copy_restored(tmp_path: Path) -> None:
    shm, fsx = tmp_path / "shm", tmp_path / "fsx"
    save(FsTier("memory", str(shm), JOB), 999, 666)  # mallory, before alice's job starts
    chown_tree(shm / JOB, MALLORY)
    save(FsTier("shared", str(fsx), JOB), 10, 10)  # alice's own step
    got = restore([FsTier("memory", str(shm), JOB), FsTier("shared", str(fsx), JOB)])
    assert got is not None and got.step == 10 and got.tier == "shared"
    assert got.state["tag"] == b"s10"
    assert any(f"uid {MALLORY}" in s for s in got.skipped)


@as_root
def test_mallorys_directory_alone_is_not_taken_for_a_fresh_start(tmp_path: Path) -> None:
    save(FsTier("memory", str(tmp_path), JOB), 999, 666)
    chown_tree(tmp_path / JOB, MALLORY)
    tier = FsTier("memory", str(tmp_path), JOB)
    with pytest.raises(TierError, match=f"uid {MALLORY}"):
        tier.steps()
    with pytest.raises(TiersUnavailable, match=f"uid {MALLORY}"):
        restore([tier])


@as_root
def test_a_file_of_another_user_inside_our_step_is_refused(tmp_path: Path) -> None:
    t0 = FsTier("memory", str(tmp_path), JOB)
    save(t0, 1, 1)
    os.chown(Path(t0.dir) / step_dir(1) / "w", MALLORY, MALLORY)
    with pytest.raises(CorruptStep, match=f"uid {MALLORY}"):
        t0.load(1)
    os.chown(Path(t0.dir) / step_dir(1) / "w", 0, 0)
    os.chown(Path(t0.dir) / step_dir(1) / MANIFEST, MALLORY, MALLORY)
    assert restore([t0]) is None


@pytest.mark.parametrize("level", ["job", "rank", "step"])
def test_a_symlinked_component_anywhere_is_refused(tmp_path: Path, level: str) -> None:
    """Alice's own intact checkpoint, reached through a link: still refused (O_NOFOLLOW on the
    last component alone would follow the others)."""
    real = FsTier("memory", str(tmp_path / "elsewhere"), JOB)
    save(real, 3, 3)
    spool = tmp_path / "spool"
    spool.mkdir()
    tier = FsTier("memory", str(spool), JOB)
    if level == "job":
        os.symlink(Path(real.dir).parent, spool / JOB)
    else:
        (spool / JOB).mkdir(mode=0o700)
        if level == "rank":
            os.symlink(real.dir, tier.dir)
        else:
            os.mkdir(tier.dir, 0o700)
            os.symlink(Path(real.dir) / step_dir(3), Path(tier.dir) / step_dir(3))
    if level == "step":
        assert tier.steps() == []
        with pytest.raises(CorruptStep):
            tier.load(3)
        assert restore([tier]) is None
    else:
        with pytest.raises(TierError, match="link"):
            tier.steps()
        with pytest.raises(TiersUnavailable):
            restore([tier])


@pytest.mark.timeout(15)
def test_a_fifo_in_place_of_a_shard_or_manifest_never_hangs(tmp_path: Path) -> None:
    fast, slow = FsTier("memory", str(tmp_path / "a"), JOB), FsTier("shared", str(tmp_path / "b"),
                                                                     JOB)
    for t in (fast, slow):
        save(t, 2, 2)
    shard = Path(fast.dir) / step_dir(2) / "w"
    shard.unlink()
    os.mkfifo(shard, 0o600)
    with pytest.raises(CorruptStep, match="not a regular file"):
        fast.load(2)
    got = restore([fast, slow])
    assert got is not None and got.tier == "shared" and got.state["tag"] == b"s2"
    manifest = Path(slow.dir) / step_dir(2) / MANIFEST
    manifest.unlink()
    os.mkfifo(manifest, 0o600)
    assert slow.steps() == []


# ---- item 4: root's commands ---------------------------------------------------------------
def _cli(tmp_path: Path) -> Any:
    from click.testing import CliRunner

    from gpuwarden.cli import cli
    from gpuwarden.config import Config
    from gpuwarden.config.ckpt import CkptConfig
    from gpuwarden.config.context import Context

    ctx = Context()
    ctx._config = replace(Config(), ckpt=CkptConfig(memory_root=str(tmp_path / "shm"),
                                                    shared_root=str(tmp_path / "fsx")))

    def run(*args: str) -> tuple[int, str]:
        res = CliRunner().invoke(cli, list(args), obj=ctx)
        return res.exit_code, res.output
    return run


def _outside(tmp_path: Path) -> FsTier:
    """Files of root's (or another user's) outside every spool: what a link points at."""
    victim = FsTier("memory", str(tmp_path / "victim"), JOB)
    for s in (1, 2, 3):
        save(victim, s, s)
    return victim


@as_root
@pytest.mark.parametrize("level", ["rank", "step"])
def test_root_gc_never_follows_a_users_links(tmp_path: Path, level: str) -> None:
    victim = _outside(tmp_path)
    alice = FsTier("memory", str(tmp_path / "shm"), JOB)
    alice.ensure_dir()
    if level == "rank":
        os.rmdir(alice.dir)
        os.symlink(victim.dir, alice.dir)
    else:
        for s in (1, 2, 3):
            os.symlink(Path(victim.dir) / step_dir(s), Path(alice.dir) / step_dir(s))
    chown_tree(tmp_path / "shm" / JOB, MALLORY)
    code, out = _cli(tmp_path)("ckpt", "gc", JOB, "--keep", "1")
    assert code == 0, out
    for s in (1, 2, 3):
        assert (Path(victim.dir) / step_dir(s) / MANIFEST).exists()
    assert victim.steps() == [1, 2, 3]


@as_root
@pytest.mark.timeout(15)
def test_root_verify_and_ls_never_hang_on_a_fifo_and_report_it(tmp_path: Path) -> None:
    alice = FsTier("memory", str(tmp_path / "shm"), JOB)
    save(alice, 1, 1)
    save(alice, 2, 2)
    shard = Path(alice.dir) / step_dir(2) / "w"
    shard.unlink()
    os.mkfifo(shard, 0o600)
    chown_tree(tmp_path / "shm" / JOB, MALLORY)
    run = _cli(tmp_path)
    code, out = run("ckpt", "verify", JOB)
    assert code == 1 and "memory   step 2: CORRUPT" in out and "not a regular file" in out
    assert "memory   step 1: ok" in out
    code, out = run("ckpt", "ls", JOB)
    assert code == 0 and any(line.split()[:2] == ["memory", "0"]
                             and line.endswith(" 2 step(s): 1, 2") for line in out.splitlines())


# ---- item 7: a read-only restore -------------------------------------------------------------
def test_a_read_only_restore_deletes_nothing(tmp_path: Path) -> None:
    from gpuwarden.ckpt.job import JobCheckpointer, JobEnv
    from gpuwarden.config.ckpt import CkptConfig

    cfg = CkptConfig(memory_root=str(tmp_path / "shm"), shared_root=str(tmp_path / "fsx"),
                     peer_replicas=0)
    env = JobEnv("612", 0, 1, 0, "0", "n1")
    ck = JobCheckpointer(cfg, env)
    for s in (1, 2):
        ck.save(s, state(s))
        assert ck.wait_durable(s, timeout=30)
    ck.finish()
    for root in ("shm", "fsx"):  # step 2 is damaged everywhere: restore walks back to step 1
        (tmp_path / root / JOB / "rank-00000" / step_dir(2) / "tag").write_bytes(b"s9")
    again = JobCheckpointer(cfg, env)
    got = again.restore(read_only=True)
    assert got is not None and got.step == 1 and got.manifest.step == 1
    assert again.ck.tier0.steps() == [1, 2] and again.ck.durable[0].steps() == [1, 2]
    got = again.restore()  # the default drops only what it can read: damaged step 2 stays
    again.finish()
    assert got is not None and got.step == 1
    assert again.ck.tier0.steps() == [1, 2] and again.ck.durable[0].steps() == [1, 2]
