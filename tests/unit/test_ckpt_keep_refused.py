"""Never delete what restore could not read: the restart cleanup, retention, `ckpt gc` and a
new commit of the same step number leave a refused copy (a bad manifest, another user's
entry, damage) in place, and delete only steps that read as this job's and rank's.

"mallory" is uid 12345 (tests that chown to her need root and are skipped otherwise).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuwarden.ckpt.checkpointer import Checkpointer
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.job import JobCheckpointer, JobEnv
from gpuwarden.ckpt.names import step_dir
from gpuwarden.ckpt.tier import MANIFEST
from gpuwarden.config.ckpt import CkptConfig

MALLORY = 12345
JOB = "job-88"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another uid")


def state(step: int) -> dict[str, Any]:
    return {"w": np.full((8, 8), step, dtype=np.float32), "tag": f"s{step}".encode()}


def config(tmp_path: Path) -> CkptConfig:
    return CkptConfig(memory_root=str(tmp_path / "shm"), shared_root=str(tmp_path / "fsx"),
                      peer_replicas=0, keep=5)


def job(tmp_path: Path) -> JobCheckpointer:
    return JobCheckpointer(config(tmp_path), JobEnv("88", 0, 1, 0, "0", "n1"))


def saved(tmp_path: Path, *steps: int) -> None:
    ck = job(tmp_path)
    for s in steps:
        ck.save(s, state(s))
        assert ck.wait_durable(s, timeout=30)
    ck.finish()


def step_path(tmp_path: Path, root: str, step: int) -> Path:
    return tmp_path / root / JOB / "rank-00000" / step_dir(step)


def spoil_manifest(where: Path) -> None:
    """An edit that the digest catches (a byte-swapped dtype): the manifest is refused."""
    doc = json.loads((where / MANIFEST).read_text())
    doc["shards"][1]["dtype"] = ">f4"
    (where / MANIFEST).write_text(json.dumps(doc))


def tiers(tmp_path: Path) -> list[FsTier]:
    return [FsTier("memory", str(tmp_path / "shm"), JOB), FsTier("shared", str(tmp_path / "fsx"),
                                                                  JOB)]


# ---- the restart cleanup ---------------------------------------------------------------------
def test_a_restart_keeps_a_newer_step_whose_manifest_it_refused(tmp_path: Path) -> None:
    saved(tmp_path, 1, 2)
    for root in ("shm", "fsx"):
        spoil_manifest(step_path(tmp_path, root, 2))
    ck = job(tmp_path)
    got = ck.restore()
    ck.finish()
    assert got is not None and got.step == 1
    for t in tiers(tmp_path):
        assert t.steps() == [1, 2], f"{t.name} deleted the step it could not read"


def test_nothing_restored_means_nothing_refused_is_deleted(tmp_path: Path) -> None:
    saved(tmp_path, 1)
    for root in ("shm", "fsx"):
        spoil_manifest(step_path(tmp_path, root, 1))
    ck = job(tmp_path)
    assert ck.restore() is None  # start fresh...
    ck.finish()
    for t in tiers(tmp_path):  # ...but what restore could not read is still there
        assert t.steps() == [1]
        assert (step_path(tmp_path, "shm" if t.name == "memory" else "fsx", 1) / "w").exists()


def test_a_restart_still_drops_a_readable_step_of_an_abandoned_run(tmp_path: Path) -> None:
    saved(tmp_path, 1, 2)
    ck = job(tmp_path)
    assert ck.ck.restore(at_most=1) is not None  # as if the ranks had agreed on step 1
    ck.ck.forget_newer(1)
    ck.finish()
    for t in tiers(tmp_path):
        assert t.steps() == [1]


@as_root
def test_a_new_save_moves_another_users_entry_aside_and_never_deletes_it(
        tmp_path: Path) -> None:
    saved(tmp_path, 1)
    planted = step_path(tmp_path, "shm", 2)
    shutil.copytree(step_path(tmp_path, "shm", 1), planted)
    for p in (planted, *planted.iterdir()):
        os.lchown(p, MALLORY, MALLORY)
    ck = job(tmp_path)
    got = ck.restore()
    assert got is not None and got.step == 1
    ck.save(2, state(22))
    assert ck.wait_durable(2, timeout=30)
    ck.finish()
    memory = tiers(tmp_path)[0]
    assert memory.load(2)[1]["tag"] == b"s22"
    aside = [p for p in planted.parent.iterdir() if p.name.startswith(".refused.")]
    assert len(aside) == 1 and aside[0].stat().st_uid == MALLORY
    assert sorted(p.name for p in aside[0].iterdir()) == [MANIFEST, "tag", "w"]


def test_a_new_save_moves_a_damaged_copy_of_the_same_step_aside(tmp_path: Path) -> None:
    saved(tmp_path, 1, 2)
    for root in ("shm", "fsx"):
        spoil_manifest(step_path(tmp_path, root, 2))
    ck = job(tmp_path)
    assert ck.restore() is not None
    ck.save(2, state(22))
    assert ck.wait_durable(2, timeout=30)
    ck.finish()
    for t in tiers(tmp_path):
        assert t.load(2)[1]["tag"] == b"s22"
        aside = [n for n in os.listdir(t.dir) if n.startswith(".refused.step-000000000002.")]
        assert len(aside) == 1, f"{t.name}: the damaged copy was deleted"
        assert t.gc_temp(older_than_s=-1) == 0 and aside[0] in os.listdir(t.dir)


# ---- retention and gc ------------------------------------------------------------------------
def test_retention_never_deletes_a_refused_step_nor_counts_it(tmp_path: Path) -> None:
    memory = FsTier("memory", str(tmp_path / "shm"), JOB)
    ck = Checkpointer(JOB, memory, [], keep=2)
    ck.save(1, state(1))
    spoil_manifest(Path(memory.dir) / step_dir(1))
    for s in (2, 3, 4):
        ck.save(s, state(s))
    ck.close(timeout=30)
    assert memory.steps() == [1, 3, 4]  # two readable steps kept, the refused one left


def _cli(tmp_path: Path) -> Any:
    from click.testing import CliRunner

    from gpuwarden.cli import cli
    from gpuwarden.config import Config
    from gpuwarden.config.context import Context

    ctx = Context()
    ctx._config = replace(Config(), ckpt=config(tmp_path))

    def run(*args: str) -> tuple[int, str]:
        res = CliRunner().invoke(cli, list(args), obj=ctx)
        return res.exit_code, res.output
    return run


def test_gc_leaves_a_refused_step_in_place_and_says_so(tmp_path: Path) -> None:
    saved(tmp_path, 2, 3)
    for root in ("shm", "fsx"):  # a step directory copied to another number
        shutil.copytree(step_path(tmp_path, root, 3), step_path(tmp_path, root, 1))
    code, out = _cli(tmp_path)("ckpt", "gc", JOB, "--keep", "1")
    assert code == 0, out
    assert "memory   deleted 1, left unreadable step(s) 1 in place" in out
    for t in tiers(tmp_path):
        assert t.steps() == [1, 3]


@as_root
def test_gc_never_removes_another_users_entry_under_a_temp_name(tmp_path: Path) -> None:
    saved(tmp_path, 1)
    rank_dir = step_path(tmp_path, "shm", 1).parent
    theirs, ours = rank_dir / ".step-000000000005.abc", rank_dir / ".step-000000000006.def"
    theirs.mkdir(mode=0o700)
    (theirs / "x").write_bytes(b"keep me")
    os.lchown(theirs, MALLORY, MALLORY)
    ours.mkdir(mode=0o700)
    link = rank_dir / ".step-000000000007.ghi"
    link.symlink_to(tmp_path)
    for p in (theirs, ours, link):
        os.utime(p, (time.time() - 7200,) * 2, follow_symlinks=False)
    code, out = _cli(tmp_path)("ckpt", "gc", JOB)
    assert code == 0, out
    assert (theirs / "x").read_bytes() == b"keep me" and link.is_symlink()
    assert not ours.exists()
