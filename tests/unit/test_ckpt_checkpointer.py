"""The Checkpointer: save to tier 0, write back behind, survive a tier that is away."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuwarden.ckpt.checkpointer import Checkpointer
from gpuwarden.ckpt.fstier import FsTier


def state(step: int) -> dict[str, object]:
    return {"w": np.full((256, 256), step, dtype=np.float32), "tag": f"s{step}".encode()}


def test_saves_become_durable_and_restore_from_the_shared_tier_after_node_loss(
        tmp_path: Path) -> None:
    shm = FsTier("shm", str(tmp_path / "shm"), "job-9")
    fsx = FsTier("fsx", str(tmp_path / "fsx"), "job-9")
    ck = Checkpointer("job-9", shm, [fsx], keep=2)
    for step in (10, 20, 30):
        ck.save(step, state(step))
    assert ck.wait_durable(30, timeout=30)
    ck.close(timeout=30)
    assert fsx.steps()[-1] == 30 and len(fsx.steps()) <= 2 and len(shm.steps()) <= 2
    shutil.rmtree(tmp_path / "shm")  # the node is gone
    again = Checkpointer("job-9", FsTier("shm", str(tmp_path / "shm"), "job-9"), [fsx])
    got = again.restore()
    again.close()
    assert got is not None and got.step == 30 and got.tier == "fsx"
    assert np.array_equal(got.state["w"], state(30)["w"]) and got.state["tag"] == b"s30"


def test_a_tier_that_is_away_delays_write_back_and_loses_nothing(tmp_path: Path) -> None:
    shm = FsTier("shm", str(tmp_path / "shm"), "job-9")
    away = tmp_path / "fsx"
    away.write_text("not a directory: the tier cannot be written")  # like S3 being down
    fsx = FsTier("fsx", str(away), "job-9")
    naps: list[float] = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 3:
            os.unlink(away)  # it comes back
    ck = Checkpointer("job-9", shm, [fsx], sleep=nap)
    ck.save(1, state(1))  # returns at once: training goes on
    ck.save(2, state(2))
    assert ck.wait_durable(2, timeout=30)
    ck.close(timeout=30)
    assert len(naps) >= 3 and fsx.steps()[-1] == 2
    got = Checkpointer("job-9", FsTier("shm", str(tmp_path / "none"), "job-9"), [fsx]).restore()
    assert got is not None and got.step == 2


def test_wait_durable_times_out_while_a_tier_is_away(tmp_path: Path) -> None:
    away = tmp_path / "fsx"
    away.write_text("x")
    ck = Checkpointer("job-9", FsTier("shm", str(tmp_path / "shm"), "job-9"),
                      [FsTier("fsx", str(away), "job-9")], sleep=lambda s: None)
    ck.save(1, state(1))
    assert not ck.wait_durable(1, timeout=0.5)
    ck.close(timeout=5)


def test_ckpt_commands_list_verify_clean_up_and_compute_the_interval(tmp_path: Path) -> None:
    from dataclasses import replace

    from click.testing import CliRunner

    from gpuwarden.cli import cli
    from gpuwarden.config import Config
    from gpuwarden.config.ckpt import CkptConfig
    from gpuwarden.config.context import Context

    cfg = replace(Config(), ckpt=CkptConfig(memory_root=str(tmp_path / "shm"),
                                            shared_root=str(tmp_path / "fsx"), keep=1))
    shm = FsTier("memory", cfg.ckpt.memory_root, "job-7")
    fsx = FsTier("shared", cfg.ckpt.shared_root, "job-7")
    ck = Checkpointer("job-7", shm, [fsx], keep=3)
    for step in (1, 2, 3):
        ck.save(step, state(step))
        # One at a time: a writer that falls behind skips superseded steps, by design.
        assert ck.wait_durable(step, timeout=30)
    ck.close(timeout=30)
    ctx = Context()
    ctx._config = cfg

    def run(*args: str) -> tuple[int, str]:
        res = CliRunner().invoke(cli, list(args), obj=ctx)
        return res.exit_code, res.output

    code, out = run("ckpt", "ls", "job-7")
    rows = {tuple(line.split()[:2]): " ".join(line.split()) for line in out.splitlines()}
    assert code == 0 and rows["memory", "0"].endswith("(this host) 3 step(s): 1, 2, 3")
    assert rows["shared", "0"].endswith(" 3 step(s): 1, 2, 3")
    shard = Path(shm.dir) / "step-000000000002" / "w"
    raw = bytearray(shard.read_bytes())
    raw[7] ^= 1
    shard.write_bytes(bytes(raw))
    code, out = run("ckpt", "verify", "job-7")
    assert code == 1 and "memory   step 2: CORRUPT" in out and "shared   step 2: ok" in out
    code, out = run("ckpt", "gc", "job-7")
    assert code == 0 and shm.steps() == [3] and fsx.steps() == [3]
    code, out = run("ckpt", "interval", "--gpus", "1024", "--mttf", "7.9h", "--cost", "30s")
    assert code == 0 and "Young: every 21.8 min" in out
    code, out = run("ckpt", "ls", "../etc")
    assert code == 1 and "job '../etc'" in out


def test_long_transfers_report_progress_at_most_every_few_seconds(
        caplog: pytest.LogCaptureFixture) -> None:
    from gpuwarden.ckpt.progress import Progress

    now = [0.0]
    p = Progress("s3: uploading step 7", 400 << 20, every_s=5.0, clock=lambda: now[0])
    caplog.set_level("INFO", "gpuwarden.ckpt.progress")
    for _ in range(4):
        now[0] += 2.0
        p(100 << 20)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["s3: uploading step 7: 300 of 400 MiB (75%), 50 MiB/s"]



def test_tier0_retention_never_deletes_the_step_the_writer_is_copying(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """keep=1: step 2 is saved while the writer is still copying step 1 out of tier 0.
    Tier 0's retention (its own thread) must leave step 1 until the writer has it."""
    shm = FsTier("shm", str(tmp_path / "shm"), "job-4")
    fsx = FsTier("fsx", str(tmp_path / "fsx"), "job-4")
    entered, go = threading.Event(), threading.Event()
    real_load, real_commit = shm.load, fsx.commit
    committed: list[int] = []

    def gated_load(step: int, mapped: bool = False) -> Any:
        if step == 1:
            entered.set()
            assert go.wait(30)
        return real_load(step, mapped)

    def commit(manifest: Any, data: Any, **kw: Any) -> Any:
        committed.append(manifest.step)
        return real_commit(manifest, data, **kw)

    shm.load = gated_load  # type: ignore[method-assign]
    fsx.commit = commit  # type: ignore[method-assign]
    ck = Checkpointer("job-4", shm, [fsx], keep=1, sleep=lambda s: None)
    retained = threading.Semaphore(0)
    real_retain = ck._retain_tier0

    def retain(fresh: bool = False) -> None:
        real_retain(fresh)
        retained.release()

    ck._retain_tier0 = retain  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING):
        ck.save(1, state(1))
        assert entered.wait(30) and retained.acquire(timeout=30)
        ck.save(2, state(2))
        assert retained.acquire(timeout=30)  # retention after step 2 has run
        go.set()
        assert ck.wait_durable(2, timeout=30)
        # Once the writer is done with it, step 1 goes from node memory without a next save.
        deadline = time.monotonic() + 30
        while shm.steps() != [2] and time.monotonic() < deadline:
            time.sleep(0.01)
        ck.close(timeout=30)
    assert committed == [1, 2]
    assert "cannot be written back" not in caplog.text
    assert shm.steps() == [2]


def _slow_upload(fsx: FsTier, of: int) -> tuple[threading.Event, threading.Event]:
    """``fsx``'s commit of step ``of`` waits (a long S3 or FSx upload) until released."""
    uploading, go = threading.Event(), threading.Event()
    real_commit = fsx.commit

    def commit(manifest: Any, data: Any, **kw: Any) -> Any:
        if manifest.step == of:
            uploading.set()
            assert go.wait(120)  # longer than any wait of the tests: a stuck upload
        return real_commit(manifest, data, **kw)

    fsx.commit = commit  # type: ignore[method-assign]
    return uploading, go


def _until(cond: Any) -> bool:
    deadline = time.monotonic() + 30
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(cond())


def test_node_memory_stays_at_keep_while_an_upload_is_slow(tmp_path: Path) -> None:
    """The writer has its copy of step 1 in memory; the steps saved meanwhile are superseded
    but the newest. Tier 0 must not keep them all (it would fill node memory)."""
    shm = FsTier("shm", str(tmp_path / "shm"), "job-4")
    fsx = FsTier("fsx", str(tmp_path / "fsx"), "job-4")
    uploading, go = _slow_upload(fsx, 1)
    ck = Checkpointer("job-4", shm, [fsx], keep=1, sleep=lambda s: None)
    ck.save(1, state(1))
    assert uploading.wait(30)
    for step in range(2, 7):
        ck.save(step, state(step))
    assert _until(lambda: shm.steps() == [6]), shm.steps()
    go.set()
    assert ck.wait_durable(6, timeout=30)
    ck.close(timeout=30)


def test_close_frees_the_step_held_for_the_writer(tmp_path: Path) -> None:
    shm = FsTier("shm", str(tmp_path / "shm"), "job-4")
    fsx = FsTier("fsx", str(tmp_path / "fsx"), "job-4")
    uploading, go = _slow_upload(fsx, 1)
    ck = Checkpointer("job-4", shm, [fsx], keep=1, sleep=lambda s: None)
    ck.save(1, state(1))
    assert uploading.wait(30)
    ck.save(2, state(2))
    closing = threading.Thread(target=ck.close, kwargs={"timeout": 30})
    closing.start()
    assert _until(lambda: not ck._janitor.is_alive())
    go.set()
    closing.join(30)
    assert fsx.steps() == [2] and shm.steps() == [2]


def test_a_state_of_more_shards_than_the_fd_limit_allows_restores_from_node_memory(
        tmp_path: Path) -> None:
    """Before Python 3.13 every mapped file holds an fd while its array lives: thousands of
    tensors must not make the mapped restore fail over to the shared tier."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    shm = FsTier("shm", str(tmp_path / "shm"), "job-4", map_reads=True)
    fsx = FsTier("fsx", str(tmp_path / "fsx"), "job-4")
    ck = Checkpointer("job-4", shm, [fsx], keep=1)
    ck.save(1, {f"p{i}": np.full(16, i, dtype=np.float32) for i in range(300)})
    assert ck.wait_durable(1, timeout=30)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        got = ck.restore(mapped=True)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        ck.close(timeout=30)
    assert got is not None and got.tier == "shm" and not got.skipped
    assert int(got.state["p299"][0]) == 299


def test_an_s3_upload_hanging_on_its_timeouts_never_holds_back_the_shared_tier(
        tmp_path: Path) -> None:
    """Seen in CI: S3 stopped, each upload attempt hung for its connect timeouts and retries,
    and the shared filesystem got no step for a minute behind it. The second durable tier has
    a writer of its own."""
    shm = FsTier("shm", str(tmp_path / "shm"), "job-5")
    fsx = FsTier("fsx", str(tmp_path / "fsx"), "job-5")
    s3 = FsTier("s3", str(tmp_path / "s3"), "job-5")
    uploading, go = _slow_upload(s3, of=1)
    ck = Checkpointer("job-5", shm, [fsx, s3], keep=2, sleep=lambda s: None)
    try:
        ck.save(1, state(1))
        assert uploading.wait(30)  # S3's upload of step 1 hangs
        for step in (2, 3, 4):
            ck.save(step, state(step))
        # Every step reaches the shared filesystem while S3 hangs.
        assert _until(lambda: 4 in fsx.steps()), fsx.steps()
        assert 4 not in s3.steps()
    finally:
        go.set()
    assert ck.wait_durable(4, timeout=30)  # S3 catches up with the newest step
    ck.close(timeout=30)
    assert s3.steps()[-1] == 4 and fsx.steps()[-1] == 4
