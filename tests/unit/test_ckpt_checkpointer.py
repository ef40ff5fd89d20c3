"""The Checkpointer: save to tier 0, write back behind, survive a tier that is away."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

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
